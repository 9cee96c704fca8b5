import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { openBundle, readNpy } from '@kdtree/format';
import { runCli } from './test-support/run-cli.js';

const HF = join(import.meta.dirname, '..', '..', 'reference', 'fixtures', 'hf');
const dir = mkdtempSync(join(tmpdir(), 'kdtree-ref-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('kdtree gen-model and golden', () => {
  it('gen-model writes a bundle with config and golden; golden reproduces it, on KDTR', async () => {
    const out = join(dir, 'tiny.kdtr');
    const draft = join(dir, 'draft.kdtr');
    const r = runCli(['gen-model', '--preset', 'tiny', '--seed', '3', '-o', out, '--quant', 'kimi-k2', '--draft', draft, '--json']);
    expect(r.status, r.stderr).toBe(0);
    const summary = JSON.parse(r.stdout);
    expect(summary).toMatchObject({ preset: 'tiny', seed: 3, quant: 'kimi-k2', draft: { output: draft, noise: 0.05 } });
    const b = await openBundle(out);
    expect(b.metadata.golden).toEqual(summary.golden);
    expect((b.metadata.config as { model_type: string }).model_type).toBe('kimi_k2');
    await b.close();
    const g = runCli(['golden', out, '--prompt', summary.golden.prompt.join(','), '--max-new', '16', '--json']);
    expect(g.status, g.stderr).toBe(0);
    expect(JSON.parse(g.stdout)).toEqual({ schema: 'kdtree.golden/1', prompt: summary.golden.prompt, tokens: summary.golden.tokens, ddtree: null, logits: null });
    const spec = runCli(['golden', out, '--prompt', summary.golden.prompt.join(','), '--max-new', '16', '--draft', draft]);
    expect(spec.stdout).toMatch(/ddtree: identical to greedy; \d+ target forwards for 16 tokens/);
  });

  it('golden runs directly on a HuggingFace directory and writes teacher-forced logits', async () => {
    const fixture = join(HF, 'yarn-qlora-moe');
    const expected = JSON.parse(readFileSync(join(fixture, 'golden.json'), 'utf8'));
    const npy = join(dir, 'logits.npy');
    const g = runCli(['golden', fixture, '--prompt', expected.prompt.join(','), '--max-new', String(expected.max_new), '--logits', npy, '--json']);
    expect(g.status, g.stderr).toBe(0);
    expect(JSON.parse(g.stdout).tokens).toEqual(expected.tokens);
    const logits = await readNpy(npy);
    expect(logits.shape).toEqual([expected.prompt.length + expected.max_new, 256]);
  });

  it('golden runs on a compressed-tensors K2.5 checkpoint through a safetensors index', () => {
    const fixture = join(HF, 'rope-noqlora-grouped-int4-k25');
    const expected = JSON.parse(readFileSync(join(fixture, 'golden.json'), 'utf8'));
    const g = runCli(['golden', join(fixture, 'model.safetensors.index.json'), '--prompt', expected.prompt.join(','), '--max-new', '12', '--json']);
    expect(g.status, g.stderr).toBe(0);
    expect(JSON.parse(g.stdout).tokens).toEqual(expected.tokens);
  });

  it('errors are one line naming what is wrong', () => {
    const fixture = join(HF, 'yarn-qlora-moe');
    expect(runCli(['golden', fixture, '--prompt', '1,x', '--max-new', '2']).stderr).toMatch(/--prompt: expected comma-separated non-negative token ids, got 'x'/);
    expect(runCli(['golden', fixture, '--prompt', '1,999', '--max-new', '2']).stderr).toMatch(/token 999 is outside the vocabulary \[0, 256\)/);
    expect(runCli(['golden', join(fixture, 'model.safetensors'), '--prompt', '1', '--max-new', '1', '--config', join(dir, 'missing.json')]).stderr).toMatch(/missing\.json: no such file/);
    expect(runCli(['gen-model', '--preset', 'huge', '--seed', '1', '-o', join(dir, 'x.kdtr')]).stderr).toMatch(/--preset: expected one of tiny, small, k2-mini/);
  });
});
