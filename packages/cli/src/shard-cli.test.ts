/**
 * kdtree shard: a tp8 model (gen-model --preset tp8, INT4 routed experts) cut over 2 and 8 ranks
 * runs with `kdtree run DIR --tp N` to the tokens of `kdtree golden`, greedy and DDTree; the
 * --json summary; and what it refuses: a non-empty directory without --force, an output over its
 * input, a shard directory as input, a model that does not split (leaving no directory behind),
 * and a run on another number of ranks than the shards were cut for.
 */
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-shard-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const model = join(dir, 'tp8.kdtr');
let golden: { prompt: number[]; tokens: number[] };

describe('kdtree shard', () => {
  beforeAll(() => {
    const r = runCli(['gen-model', '--preset', 'tp8', '--seed', '2', '--quant', 'kimi-k2', '-o', model, '--quiet']);
    expect(r.status, r.stderr).toBe(0);
    const g = runCli(['golden', model, '--prompt', '1,7,42,3,99,5,64,11', '--max-new', '16', '--eos', '', '--json']);
    expect(g.status, g.stderr).toBe(0);
    golden = JSON.parse(g.stdout);
  });

  it('cuts over 2 and 8 ranks (--json, schema kdtree.shard/1); kdtree run DIR --tp N gives the tokens of kdtree golden, greedy and DDTree', () => {
    for (const tp of [2, 8]) {
      const out = join(dir, `tp${tp}`);
      const r = runCli(['shard', model, '--tp', String(tp), '-o', out, '--json']);
      expect(r.status, r.stderr).toBe(0);
      const summary = JSON.parse(r.stdout);
      expect(summary).toMatchObject({ schema: 'kdtree.shard/1', model, output: out, index: join(out, 'tp-index.json'), tp, tensors: 41, splits: { column: 17, row: 8, replicated: 16 } });
      expect(summary.ranks.map((x: { file: string }) => x.file)).toEqual(Array.from({ length: tp }, (_, i) => join(out, `rank-${i}.kdtr`)));
      expect(readdirSync(out).sort()).toEqual([...Array.from({ length: tp }, (_, i) => `rank-${i}.kdtr`), 'tp-index.json'].sort());
      const specs = tp === 8 ? [[], ['--spec', 'ddtree', '--budget', '6', '--depth', '3']] : [[]];
      for (const spec of specs) {
        const run = runCli(['run', out, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--tp', String(tp), '--json', ...spec]);
        expect(run.status, run.stderr).toBe(0);
        expect(JSON.parse(run.stdout)).toMatchObject({ tokens: golden.tokens, stats: { backend: 'cpu', tp } });
      }
      // every rank file is a checked KDTR bundle
      const verify = runCli(['verify', join(out, `rank-${tp - 1}.kdtr`), '--quiet']);
      expect(verify.status, verify.stderr).toBe(0);
    }
  }, 120_000);

  it('refuses a non-empty directory without --force, an output over its input, a shard directory as input', () => {
    const out = join(dir, 'busy');
    mkdirSync(out);
    writeFileSync(join(out, 'notes.txt'), 'mine');
    const busy = runCli(['shard', model, '--tp', '2', '-o', out]);
    expect(busy.status).toBe(2);
    expect(busy.stderr).toContain(`shard: -o ${out} is not empty (1 entries); choose an empty or new directory, or pass --force to write into it`);
    const forced = runCli(['shard', model, '--tp', '2', '-o', out, '--force', '--quiet']);
    expect(forced.status, forced.stderr).toBe(0);
    expect(readdirSync(out).sort()).toEqual(['notes.txt', 'rank-0.kdtr', 'rank-1.kdtr', 'tp-index.json']);

    const inside = join(dir, 'inside');
    mkdirSync(inside);
    copyFileSync(model, join(inside, 'rank-1.kdtr'));
    const over = runCli(['shard', join(inside, 'rank-1.kdtr'), '--tp', '2', '-o', inside, '--force']);
    expect(over.status).toBe(2);
    expect(over.stderr).toContain(`-o ${join(inside, 'rank-1.kdtr')} is the input ${join(inside, 'rank-1.kdtr')}; writing it would destroy the input`);

    const again = runCli(['shard', out, '--tp', '2', '-o', join(dir, 'again')]);
    expect(again.status).toBe(2);
    expect(again.stderr).toContain(`shard: ${out} is already a shard directory (tp-index.json); cut the bundle it came from`);
  }, 60_000);

  it('a model that does not split: the tensor and dimension, exit 1, no directory left; a run on other ranks: the index and both numbers', () => {
    const out = join(dir, 'three');
    const r = runCli(['shard', model, '--tp', '3', '-o', out]);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/^kdtree: error: model\.layers\.0\.self_attn\.q_b_proj\.weight \[128, 32\]: its heads \(num_attention_heads\) \(8\) does not split over 3 ranks\n$/);
    expect(existsSync(out)).toBe(false);
    const run = runCli(['run', join(dir, 'tp8'), '--prompt', '1,2', '--max-new', '2', '--backend', 'cpu', '--tp', '4']);
    expect(run.status).toBe(1);
    expect(run.stderr).toContain(`${join(dir, 'tp8', 'tp-index.json')}: the shards were cut for tp 8, but the model is being loaded on tp 4 (run with --tp 8, or cut it again: kdtree shard MODEL --tp 4 -o DIR)`);
  }, 60_000);
});
