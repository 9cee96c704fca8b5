import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { openBundle, writeSafetensors } from '@kdtree/format';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function bytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = (i * 131 + seed * 17 + (i >> 7)) & 0xff;
  return out;
}

async function sampleCheckpoint(path: string) {
  await writeSafetensors(
    path,
    [
      { name: 'model.embed_tokens.weight', dtype: 'BF16', shape: [100, 16], data: bytes(3200, 1) },
      { name: 'model.layers.0.mlp.down_proj.weight', dtype: 'F32', shape: [16, 40], data: bytes(2560, 2) },
      { name: 'model.norm.weight', dtype: 'F16', shape: [16], data: bytes(32, 3) },
    ],
    { metadata: { format: 'pt' } },
  );
}

describe('kdtree CLI', () => {
  it('prints help for the tool and for every command', () => {
    const top = runCli(['--help']);
    expect(top.status).toBe(0);
    for (const name of ['import', 'export', 'inspect', 'verify', 'demo', 'backend']) {
      expect(top.stdout).toContain(name);
      const r = runCli([name, '--help']);
      expect(r.status, name).toBe(0);
      expect(r.stdout).toMatch(/^usage: kdtree /);
    }
  });

  it('reports usage errors in one line with exit code 2', () => {
    const r = runCli(['import', 'a.safetensors']);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/^kdtree: error: import: -o OUT.kdtr is required/);
    expect(runCli(['frobnicate']).stderr).toMatch(/unknown command 'frobnicate'/);
    expect(runCli(['inspect', '--bogus', 'x']).status).toBe(2);
  });

  it('safetensors -> KDTR -> safetensors reproduces the file byte for byte', async () => {
    const src = join(dir, 'src.safetensors');
    await sampleCheckpoint(src);
    const kdtr = join(dir, 'src.kdtr');
    const imp = runCli(['import', src, '-o', kdtr, '--json']);
    expect(imp.stderr).toBe('');
    expect(JSON.parse(imp.stdout)).toMatchObject({ output: kdtr, tensors: 3, bytes: 5792 });
    const out = join(dir, 'back.safetensors');
    expect(runCli(['export', kdtr, '-o', out, '-q']).status).toBe(0);
    expect(readFileSync(out).equals(readFileSync(src))).toBe(true);
  });

  it('imports a HuggingFace directory with its config and exports a directory back', async () => {
    const model = join(dir, 'hf');
    mkdirSync(model);
    await sampleCheckpoint(join(model, 'model.safetensors'));
    writeFileSync(join(model, 'config.json'), JSON.stringify({ model_type: 'deepseek_v3', hidden_size: 16 }));
    const kdtr = join(dir, 'hf.kdtr');
    expect(runCli(['import', model, '-o', kdtr, '-q']).status).toBe(0);
    const b = await openBundle(kdtr);
    expect(b.metadata.config).toEqual({ model_type: 'deepseek_v3', hidden_size: 16 });
    await b.close();
    const outDir = join(dir, 'hf-out/');
    expect(runCli(['export', kdtr, '-o', outDir, '-q']).status).toBe(0);
    expect(readFileSync(join(outDir, 'model.safetensors')).equals(readFileSync(join(model, 'model.safetensors')))).toBe(true);
    expect(JSON.parse(readFileSync(join(outDir, 'config.json'), 'utf8'))).toEqual({ model_type: 'deepseek_v3', hidden_size: 16 });
  });

  it('verify passes an intact bundle and names the tensor with a flipped byte', async () => {
    const src = join(dir, 'v.safetensors');
    await sampleCheckpoint(src);
    const kdtr = join(dir, 'v.kdtr');
    expect(runCli(['import', src, '-o', kdtr, '-q']).status).toBe(0);
    const ok = runCli(['verify', kdtr, '-q']);
    expect(ok.status).toBe(0);
    expect(ok.stdout).toMatch(/^OK .*3 tensors/);
    const b = await openBundle(kdtr);
    const target = b.get('model.layers.0.mlp.down_proj.weight');
    await b.close();
    const file = readFileSync(kdtr);
    file[target.offset + 100] ^= 1;
    writeFileSync(kdtr, file);
    const bad = runCli(['verify', kdtr, '-q']);
    expect(bad.status).toBe(1);
    expect(bad.stderr.trim().split('\n')).toHaveLength(1);
    expect(bad.stderr).toMatch(/tensor 'model\.layers\.0\.mlp\.down_proj\.weight': checksum mismatch/);
    const js = runCli(['verify', kdtr, '--json']);
    expect(js.status).toBe(1);
    expect(JSON.parse(js.stdout).failures[0].tensor).toBe('model.layers.0.mlp.down_proj.weight');
  });

  it('inspect prints a table and a stable JSON schema', async () => {
    const src = join(dir, 'i.safetensors');
    await sampleCheckpoint(src);
    const kdtr = join(dir, 'i.kdtr');
    runCli(['import', src, '-o', kdtr, '-q']);
    const text = runCli(['inspect', kdtr]);
    expect(text.status).toBe(0);
    expect(text.stdout).toMatch(/model\.norm\.weight\s+F16\s+\[16\]\s+32/);
    const js = JSON.parse(runCli(['inspect', kdtr, '--json', '--filter', 'norm']).stdout);
    expect(Object.keys(js)).toEqual(['schema', 'path', 'format', 'version', 'file_bytes', 'tensor_count', 'tensor_bytes', 'metadata', 'tensors', 'drafter']);
    expect(js.schema).toBe('kdtree.inspect/1');
    expect(js.tensor_count).toBe(3);
    expect(js.tensors).toEqual([{ name: 'model.norm.weight', dtype: 'F16', shape: [16], offset: expect.any(Number), size: 32, crc32: expect.stringMatching(/^[0-9a-f]{8}$/), file: kdtr }]);
  });

  it('fails with one clear line on bad input files', () => {
    const junk = join(dir, 'junk.kdtr');
    writeFileSync(junk, 'KDTR but not really');
    const r = runCli(['verify', junk]);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/^kdtree: error: .*junk\.kdtr: /);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    const missing = runCli(['inspect', join(dir, 'nope.kdtr')]);
    expect(missing.stderr).toMatch(/nope\.kdtr: no such file or directory/);
  });

  it('writes a multi-file bundle with --shard-size', async () => {
    const src = join(dir, 's.safetensors');
    await sampleCheckpoint(src);
    const index = join(dir, 'sharded.kdtr.json');
    expect(runCli(['import', src, '-o', index, '--shard-size', '4KiB', '-q']).status).toBe(0);
    const js = JSON.parse(runCli(['inspect', index, '--json']).stdout);
    expect(js.format).toBe('kdtr-index');
    expect(new Set(js.tensors.map((t: { file: string }) => t.file)).size).toBeGreaterThan(1);
    expect(runCli(['verify', index, '-q']).status).toBe(0);
  });

  it('runs the demo on the engine: every mode exact; a second run reuses the cached models, a third regenerates a damaged drafter', () => {
    const cache = mkdtempSync(join(tmpdir(), 'kdtree-demo-cache-'));
    const weights = join(cache, 'small-seed1-walk-dflash8', 'model.safetensors');
    try {
      for (const run of ['first', 'second', 'damaged'] as const) {
        if (run === 'damaged') {
          // the DFlash drafter's weights damaged in the cache (safetensors carry no checksum)
          const bytes = readFileSync(weights);
          bytes.fill(0x55, bytes.length - 4000);
          writeFileSync(weights, bytes);
        }
        const r = runCli(['demo', '--preset', 'small', '--max-new', '24', '--cache', cache, '--backend', 'cpu']);
        expect(r.status, r.stderr).toBe(0);
        expect(r.stdout).toMatch(run === 'second' ? /reused .*small-seed1-walk-int4\.kdtr/ : /generated .*small-seed1-walk-int4\.kdtr/);
        if (run === 'damaged') expect(r.stderr).toMatch(/the cached models in .* are stale or damaged; generating them again/);
        for (const mode of ['greedy', 'chain, dflash, 7 nodes', 'ddtree, dflash, budget 7', 'ddtree, dflash, budget 16', 'ddtree, dflash, budget auto', 'ddtree, dflash, budget auto, 2nd run', 'chain, draft model', 'ddtree, draft model, budget 16', 'ddtree, ngram']) {
          expect(r.stdout).toMatch(new RegExp(`${mode}.*\\byes$`, 'm'));
        }
        // the built drafter predicts the walk: its chain accepts more than the bonus token a step
        const chain = /^chain, dflash, 7 nodes\s+\S+\s+\S+\s+(\S+)/m.exec(r.stdout);
        expect(Number(chain?.[1])).toBeGreaterThan(2);
        expect(r.stdout).toMatch(/re-imported model decodes the same tokens on the engine/);
        expect(r.stdout).toMatch(/demo OK/);
      }
    } finally {
      rmSync(cache, { recursive: true, force: true });
    }
  });
});
