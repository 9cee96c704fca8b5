import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { crc32 } from './crc32.js';
import type { Dtype } from './dtypes.js';
import {
  BadMagicError,
  ChecksumMismatchError,
  DuplicateTensorError,
  FormatError,
  InvalidFieldError,
  TensorNotFoundError,
  TruncatedFileError,
  UnknownDtypeError,
  UsageError,
} from './errors.js';
import { KDTR_ALIGNMENT, KDTR_PREAMBLE_BYTES } from './kdtr-layout.js';
import { openBundle } from './kdtr-reader.js';
import { KdtrWriter, ShardedKdtrWriter } from './kdtr-writer.js';
import { expectSameBytes, seededBytes, tempDir } from './test-support/tmp.js';

const dir = tempDir();
let counter = 0;
const path = (name = 'b') => join(dir, `${name}-${counter++}.kdtr`);

interface Sample {
  name: string;
  dtype: Dtype;
  shape: number[];
  bytes: Uint8Array;
}

function sample(name: string, dtype: Dtype, shape: number[], seed: number): Sample {
  const sizes: Record<string, number> = { F64: 8, F32: 4, F16: 2, BF16: 2, I64: 8, I32: 4, I16: 2, I8: 1, U8: 1, U16: 2, U32: 4, BOOL: 1, U64: 8, F8_E4M3: 1, F8_E5M2: 1 };
  const n = shape.reduce((a, b) => a * b, 1);
  return { name, dtype, shape, bytes: seededBytes(n * sizes[dtype], seed) };
}

const SAMPLES: Sample[] = [
  sample('model.embed_tokens.weight', 'BF16', [37, 24], 1),
  sample('layers.0.norm', 'F32', [24], 2),
  sample('scalar', 'F64', [], 3),
  sample('empty', 'F16', [0, 5], 4),
  sample('ids', 'I64', [3], 5),
  sample('qw', 'I32', [7, 3], 6),
  sample('i16', 'I16', [5], 7),
  sample('i8', 'I8', [9], 8),
  sample('u8', 'U8', [4097], 9),
  sample('u16', 'U16', [3], 10),
  sample('u32', 'U32', [2, 2], 11),
  sample('mask', 'BOOL', [6], 12),
];

async function writeSamples(file: string, samples = SAMPLES, metadata: Record<string, unknown> = { config: { hidden_size: 24 } }) {
  const w = await KdtrWriter.create(file, { metadata });
  for (const s of samples) await w.add({ name: s.name, dtype: s.dtype, shape: s.shape }, s.bytes);
  return w.close();
}

async function drain(chunks: AsyncIterable<Uint8Array>): Promise<number> {
  let n = 0;
  for await (const c of chunks) n += c.byteLength;
  return n;
}

describe('KDTR write and read', () => {
  it('round-trips every dtype, scalars and empty tensors, in file order', async () => {
    const file = path();
    await writeSamples(file);
    const b = await openBundle(file);
    expect(b.version).toBe('1.0');
    expect(b.metadata).toEqual({ config: { hidden_size: 24 } });
    expect(b.names).toEqual(SAMPLES.map((s) => s.name));
    for (const s of SAMPLES) {
      const info = b.get(s.name);
      expect(info.dtype).toBe(s.dtype);
      expect(info.shape).toEqual(s.shape);
      expect(info.offset % KDTR_ALIGNMENT).toBe(0);
      expect(info.crc32).toBe(crc32(s.bytes));
      expectSameBytes(await b.read(s.name, { verify: true }), s.bytes, s.name);
    }
    const offsets = b.tensors.map((t) => t.offset);
    expect([...offsets].sort((x, y) => x - y)).toEqual(offsets);
    await b.close();
  });

  it('reads into a caller buffer, by range and as chunks', async () => {
    const big = sample('big', 'F32', [3, 1_000_003], 42);
    const file = path();
    await writeSamples(file, [big]);
    const b = await openBundle(file);
    const target = new Uint8Array(big.bytes.byteLength + 100);
    const view = await b.readInto('big', target);
    expect(view.byteLength).toBe(big.bytes.byteLength);
    expectSameBytes(view, big.bytes);
    expectSameBytes(await b.readRange('big', 4_000_012, 4000), big.bytes.subarray(4_000_012, 4_004_012));
    const parts: Uint8Array[] = [];
    for await (const chunk of b.chunks('big', { chunkBytes: 1 << 20, depth: 2 })) parts.push(chunk.slice());
    expectSameBytes(Buffer.concat(parts), big.bytes);
    await expect(b.readInto('big', new Uint8Array(10))).rejects.toThrow(UsageError);
    await expect(b.readRange('big', big.bytes.byteLength - 1, 2)).rejects.toThrow(/byte range outside the tensor/);
    await expect(b.read('nope')).rejects.toThrow(TensorNotFoundError);
    await b.close();
  });

  it('accepts streamed chunks and keeps memory to the chunk', async () => {
    const file = path();
    const w = await KdtrWriter.create(file);
    const chunks = [seededBytes(1000, 1), seededBytes(24, 2)];
    async function* gen() {
      for (const c of chunks) yield c;
    }
    await w.add({ name: 'streamed', dtype: 'U8', shape: [1024] }, gen());
    await w.close();
    const b = await openBundle(file);
    expectSameBytes(await b.read('streamed'), Buffer.concat(chunks));
    await b.close();
  });

  it('refuses data whose length differs from the shape, and stays usable', async () => {
    const file = path();
    const w = await KdtrWriter.create(file);
    await expect(w.add({ name: 'short', dtype: 'F32', shape: [4] }, new Uint8Array(15))).rejects.toThrow(/shorter than its shape.*16 bytes/);
    await expect(w.add({ name: 'long', dtype: 'F32', shape: [4] }, new Uint8Array(17))).rejects.toThrow(/longer than its shape/);
    await expect(w.add({ name: 'bad', dtype: 'F12' as Dtype, shape: [4] }, new Uint8Array(16))).rejects.toThrow(UnknownDtypeError);
    await w.add({ name: 'ok', dtype: 'F32', shape: [4] }, seededBytes(16, 3));
    await expect(w.add({ name: 'ok', dtype: 'F32', shape: [4] }, seededBytes(16, 3))).rejects.toThrow(DuplicateTensorError);
    await w.close();
    const b = await openBundle(file);
    expect(b.names).toEqual(['ok']);
    expect((await b.verify()).ok).toBe(true);
    await b.close();
  });

  it('publishes atomically: nothing under the final name until close, no temp files after', async () => {
    const sub = join(dir, `atomic-${counter++}`);
    await import('node:fs/promises').then((fs) => fs.mkdir(sub));
    const file = join(sub, 'x.kdtr');
    const w = await KdtrWriter.create(file);
    await w.add({ name: 'a', dtype: 'U8', shape: [10] }, seededBytes(10, 1));
    expect(readdirSync(sub).filter((n) => n === 'x.kdtr')).toEqual([]);
    // The temp file of an interrupted writer never reads as a valid bundle.
    const temp = join(sub, readdirSync(sub)[0]);
    await expect(openBundle(temp)).rejects.toThrow(BadMagicError);
    await w.abort();
    expect(readdirSync(sub)).toEqual([]);
    const w2 = await KdtrWriter.create(file);
    await w2.add({ name: 'a', dtype: 'U8', shape: [10] }, seededBytes(10, 1));
    await w2.close();
    expect(readdirSync(sub)).toEqual(['x.kdtr']);
  });

  it('detects a flipped byte in any tensor, naming that tensor', async () => {
    const file = path();
    const result = await writeSamples(file);
    const pristine = readFileSync(file);
    for (const entry of result.tensors.filter((t) => t.size > 0)) {
      const copy = Buffer.from(pristine);
      copy[entry.offset + Math.floor(entry.size / 2)] ^= 0x10;
      writeFileSync(file, copy);
      const b = await openBundle(file);
      const r = await b.verify();
      expect(r.ok).toBe(false);
      expect(r.failures.map((f) => f.tensor)).toEqual([entry.name]);
      // Every read path checks the CRC by default; only an explicit opt-out returns the bytes.
      await expect(b.read(entry.name)).rejects.toThrow(ChecksumMismatchError);
      await expect(b.readTyped(entry.name)).rejects.toThrow(ChecksumMismatchError);
      await expect(b.readInto(entry.name, new Uint8Array(entry.size))).rejects.toThrow(ChecksumMismatchError);
      await expect(b.readRange(entry.name, 0, 1)).rejects.toThrow(ChecksumMismatchError);
      await expect(drain(b.chunks(entry.name, { chunkBytes: 4096 }))).rejects.toThrow(ChecksumMismatchError);
      await expect(b.read(entry.name)).rejects.toThrow(new RegExp(`tensor '${entry.name.replace(/\./g, '\\.')}': field 'crc32': tensor data checksum mismatch`));
      expect((await b.read(entry.name, { verify: false })).byteLength).toBe(entry.size);
      expect((await b.readRange(entry.name, 0, 1, undefined, { verify: false })).byteLength).toBe(1);
      expect(await drain(b.chunks(entry.name, { verify: false }))).toBe(entry.size);
      await b.close();
    }
  });

  it('a stream hands out its last chunk only after the checksum matched', async () => {
    const file = path();
    const result = await writeSamples(file);
    const big = result.tensors.reduce((a, t) => (t.size > a.size ? t : a));
    const copy = readFileSync(file);
    copy[big.offset + big.size - 1] ^= 1;
    writeFileSync(file, copy);
    const b = await openBundle(file);
    let received = 0;
    await expect((async () => {
      for await (const chunk of b.chunks(big.name, { chunkBytes: 4096 })) received += chunk.byteLength;
    })()).rejects.toThrow(ChecksumMismatchError);
    expect(received).toBeLessThan(big.size);
    await b.close();
  });

  it('rejects truncation, foreign files and trailing bytes with typed errors', async () => {
    const file = path();
    await writeSamples(file);
    const pristine = readFileSync(file);
    writeFileSync(file, pristine.subarray(0, pristine.length - 1));
    await expect(openBundle(file)).rejects.toThrow(TruncatedFileError);
    writeFileSync(file, Buffer.concat([pristine, Buffer.from([0])]));
    await expect(openBundle(file)).rejects.toThrow(/trailing bytes/);
    writeFileSync(file, pristine.subarray(0, 30));
    await expect(openBundle(file)).rejects.toThrow(TruncatedFileError);
    writeFileSync(file, Buffer.from('PK\x03\x04 definitely a zip file'));
    await expect(openBundle(file)).rejects.toThrow(BadMagicError);
    writeFileSync(file, Buffer.alloc(0));
    await expect(openBundle(file)).rejects.toThrow(BadMagicError);
  });

  it('supports using `await using` to close', async () => {
    const file = path();
    await writeSamples(file, SAMPLES.slice(0, 2));
    const handle = await openBundle(file);
    await handle[Symbol.asyncDispose]();
    await expect(handle.read(SAMPLES[0].name)).rejects.toThrow(/closed/);
  });

  it('writes an empty bundle that opens', async () => {
    const file = path();
    const w = await KdtrWriter.create(file, { metadata: { note: 'empty' } });
    const r = await w.close();
    expect(r.fileLength).toBeGreaterThan(KDTR_PREAMBLE_BYTES);
    const b = await openBundle(file);
    expect(b.tensors).toEqual([]);
    await b.close();
  });
});

describe('multi-file bundles', () => {
  it('refuses a shard size that is not a positive integer', async () => {
    for (const bad of [0, -1, 0.5, Number.NaN]) {
      await expect(ShardedKdtrWriter.create(path('x.kdtr.json'), { maxShardBytes: bad })).rejects.toThrow(/maxShardBytes must be a positive integer/);
    }
  });

  it('rolls shards by size and reads them as one bundle', async () => {
    const index = join(dir, `sharded-${counter++}.kdtr.json`);
    const w = await ShardedKdtrWriter.create(index, { maxShardBytes: 5000, metadata: { config: { layers: 2 } } });
    for (const s of SAMPLES) await w.add({ name: s.name, dtype: s.dtype, shape: s.shape }, s.bytes);
    await expect(w.add({ name: SAMPLES[0].name, dtype: 'U8', shape: [1] }, new Uint8Array(1))).rejects.toThrow(DuplicateTensorError);
    const { shards } = await w.close();
    expect(shards.length).toBeGreaterThan(1);
    const b = await openBundle(index);
    expect(b.format).toBe('kdtr-index');
    expect(b.metadata).toEqual({ config: { layers: 2 } });
    expect(b.names).toEqual(SAMPLES.map((s) => s.name));
    for (const s of SAMPLES) expectSameBytes(await b.read(s.name, { verify: true }), s.bytes, s.name);
    expect((await b.verify()).ok).toBe(true);
    await b.close();
  });

  it('splits at nextShard() for per-rank shards', async () => {
    const index = join(dir, `ranks-${counter++}.kdtr.json`);
    const w = await ShardedKdtrWriter.create(index);
    await w.add({ name: 'rank0.w', dtype: 'F32', shape: [2] }, seededBytes(8, 1));
    await w.nextShard();
    await w.add({ name: 'rank1.w', dtype: 'F32', shape: [2] }, seededBytes(8, 2));
    const { shards } = await w.close();
    expect(shards.map((s) => s.tensors.map((t) => t.name))).toEqual([['rank0.w'], ['rank1.w']]);
  });

  it('rejects an index whose shard was replaced or whose map lies', async () => {
    const index = join(dir, `tamper-${counter++}.kdtr.json`);
    const w = await ShardedKdtrWriter.create(index, { maxShardBytes: 1 });
    await w.add({ name: 'a', dtype: 'U8', shape: [3] }, seededBytes(3, 1));
    await w.add({ name: 'b', dtype: 'U8', shape: [3] }, seededBytes(3, 2));
    const { shards } = await w.close();
    const json = JSON.parse(readFileSync(index, 'utf8'));
    const pristine = JSON.stringify(json);
    json.weight_map.a = 1;
    writeFileSync(index, JSON.stringify(json));
    await expect(openBundle(index)).rejects.toThrow(/weight_map does not place this tensor/);
    const other = JSON.parse(pristine);
    other.shards[0].header_crc32 = (other.shards[0].header_crc32 + 1) >>> 0;
    writeFileSync(index, JSON.stringify(other));
    await expect(openBundle(index)).rejects.toThrow(/shard differs from its index entry/);
    const escape = JSON.parse(pristine);
    escape.shards[0].file = '../etc/passwd';
    writeFileSync(index, JSON.stringify(escape));
    await expect(openBundle(index)).rejects.toThrow(InvalidFieldError);
    const missing = JSON.parse(pristine);
    missing.weight_map.ghost = 0;
    writeFileSync(index, JSON.stringify(missing));
    await expect(openBundle(index)).rejects.toThrow(/no shard holds/);
    writeFileSync(index, pristine);
    const handle = await open(shards[1].path, 'r+');
    await handle.write(Buffer.from([0xff]), 0, 1, 20);
    await handle.close();
    await expect(openBundle(index)).rejects.toThrow(FormatError);
  });
});
