/**
 * Files written by the peers themselves (Python `safetensors.save_file` and transformers'
 * `save_pretrained` with sharding), from tools/fixtures/gen_safetensors_fixtures.py.
 */
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { openBundle } from './kdtr-reader.js';
import { KdtrWriter } from './kdtr-writer.js';
import { openSafetensors, writeSafetensors } from './safetensors.js';
import { tempDir } from './test-support/tmp.js';

const FIXTURES = join(import.meta.dirname, '..', 'fixtures', 'python-safetensors');
const manifest = JSON.parse(readFileSync(join(FIXTURES, 'manifest.json'), 'utf8')) as {
  files: Record<string, Record<string, { dtype: string; shape: number[]; sha256: string }>>;
};
const TORCH_TO_DTYPE: Record<string, string> = {
  bfloat16: 'BF16', float16: 'F16', float32: 'F32', float64: 'F64', int64: 'I64', int32: 'I32', int16: 'I16', int8: 'I8',
  uint8: 'U8', uint16: 'U16', uint32: 'U32', uint64: 'U64', bool: 'BOOL', float8_e4m3fn: 'F8_E4M3',
};
const dir = tempDir();
const sha256 = (b: Uint8Array) => createHash('sha256').update(b).digest('hex');

describe('checkpoints written by Python safetensors and transformers', () => {
  it('reads every dtype, shape and byte of save_file output', async () => {
    const st = await openSafetensors(join(FIXTURES, 'single.safetensors'));
    const expected = manifest.files['single.safetensors'];
    expect(st.metadata).toEqual(expected.__metadata__);
    const names = Object.keys(expected).filter((n) => n !== '__metadata__');
    expect([...st.names].sort()).toEqual([...names].sort());
    for (const name of names) {
      const info = st.get(name);
      expect(info.dtype, name).toBe(TORCH_TO_DTYPE[expected[name].dtype]);
      expect(info.shape, name).toEqual(expected[name].shape);
      expect(sha256(await st.read(name)), name).toBe(expected[name].sha256);
    }
    await st.close();
  });

  it('reads a sharded save_pretrained directory through its index', async () => {
    const st = await openSafetensors(join(FIXTURES, 'hf-sharded'));
    expect(st.format).toBe('safetensors-index');
    const shards = Object.entries(manifest.files).filter(([f]) => f.startsWith('hf-sharded/'));
    expect(shards.length).toBeGreaterThan(1);
    for (const [, tensors] of shards) {
      for (const [name, e] of Object.entries(tensors)) {
        if (name === '__metadata__') continue;
        expect(sha256(await st.read(name)), name).toBe(e.sha256);
      }
    }
    await st.close();
  });

  it('safetensors -> KDTR -> safetensors reproduces the Python file byte for byte', async () => {
    const source = join(FIXTURES, 'single.safetensors');
    const st = await openSafetensors(source);
    const kdtrPath = join(dir, 'py.kdtr');
    const w = await KdtrWriter.create(kdtrPath, { metadata: { 'safetensors.metadata': st.metadata } });
    for (const t of st.tensors) await w.add({ name: t.name, dtype: t.dtype, shape: t.shape }, st.chunks(t.name));
    await w.close();
    await st.close();
    const b = await openBundle(kdtrPath);
    expect((await b.verify()).ok).toBe(true);
    const out = join(dir, 'py-back.safetensors');
    await writeSafetensors(out, b.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, data: () => b.chunks(t.name) })), {
      metadata: b.metadata['safetensors.metadata'] as Record<string, string>,
    });
    await b.close();
    expect(readFileSync(out).equals(readFileSync(source))).toBe(true);
  });
});
