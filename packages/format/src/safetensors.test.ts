import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { HeaderTooLargeError, InvalidFieldError, NotAFileError, OutOfRangeError, OverlapError, ShapeSizeMismatchError, TruncatedFileError, UnknownDtypeError } from './errors.js';
import { openTensors } from './open.js';
import { findModelConfig, openSafetensors, writeSafetensors } from './safetensors.js';
import { expectSameBytes, seededBytes, tempDir } from './test-support/tmp.js';

const dir = tempDir();

/** A safetensors file assembled by hand from the published layout, independent of our writer. */
function handmade(header: Record<string, unknown>, data: Uint8Array, pad = 0): Buffer {
  const json = Buffer.from(JSON.stringify(header) + ' '.repeat(pad));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(json.length));
  return Buffer.concat([len, json, data]);
}

describe('safetensors reader', () => {
  it('reads a hand-assembled file', async () => {
    const data = seededBytes(8 + 6, 1);
    const file = join(dir, 'hand.safetensors');
    writeFileSync(file, handmade({ __metadata__: { format: 'pt' }, b: { dtype: 'BF16', shape: [3], data_offsets: [8, 14] }, a: { dtype: 'F32', shape: [2], data_offsets: [0, 8] } }, data, 3));
    const st = await openSafetensors(file);
    expect(st.metadata).toEqual({ format: 'pt' });
    expect(st.names).toEqual(['a', 'b']); // file order, not header order
    expectSameBytes(await st.read('a'), data.subarray(0, 8));
    expectSameBytes(await st.read('b'), data.subarray(8, 14));
    expect((await st.verify()).checked).toBe(0);
    await st.close();
  });

  it('rejects malformed headers with typed errors', async () => {
    const cases: [Record<string, unknown>, number, new (...a: never[]) => Error][] = [
      [{ a: { dtype: 'F32', shape: [2], data_offsets: [0, 8] } }, 9, OutOfRangeError],
      [{ a: { dtype: 'F32', shape: [3], data_offsets: [0, 8] } }, 8, ShapeSizeMismatchError],
      [{ a: { dtype: 'Q4', shape: [2], data_offsets: [0, 8] } }, 8, UnknownDtypeError],
      [{ a: { dtype: 'F32', shape: [2], data_offsets: [0, 8] }, b: { dtype: 'F32', shape: [1], data_offsets: [4, 8] } }, 8, OverlapError],
      [{ a: { dtype: 'F32', shape: [1], data_offsets: [4, 8] } }, 8, OverlapError],
      [{ a: { dtype: 'F32', shape: [2], data_offsets: [0, 16] } }, 8, ShapeSizeMismatchError],
      [{ a: { dtype: 'F32', shape: [2], data_offsets: [8, 0] } }, 8, InvalidFieldError],
      [{ a: { dtype: 'F32', shape: [-2], data_offsets: [0, 8] } }, 8, InvalidFieldError],
      [{ __metadata__: { n: 1 } }, 0, InvalidFieldError],
    ];
    for (const [i, [header, dataLength, errorClass]] of cases.entries()) {
      const file = join(dir, `bad-${i}.safetensors`);
      writeFileSync(file, handmade(header, new Uint8Array(dataLength)));
      await expect(openSafetensors(file), `case ${i}`).rejects.toThrow(errorClass);
    }
    const huge = Buffer.alloc(16);
    huge.writeBigUInt64LE(2n ** 60n);
    writeFileSync(join(dir, 'huge.safetensors'), huge);
    await expect(openSafetensors(join(dir, 'huge.safetensors'))).rejects.toThrow(HeaderTooLargeError);
    const short = Buffer.alloc(16);
    short.writeBigUInt64LE(100n);
    writeFileSync(join(dir, 'short.safetensors'), short);
    await expect(openSafetensors(join(dir, 'short.safetensors'))).rejects.toThrow(TruncatedFileError);
  });

  it('reads a sharded checkpoint directory through its index', async () => {
    const model = join(dir, 'hf-model');
    mkdirSync(model);
    const a = seededBytes(16, 2);
    const b = seededBytes(4, 3);
    writeFileSync(join(model, 'model-00001-of-00002.safetensors'), handmade({ 'x.weight': { dtype: 'F32', shape: [2, 2], data_offsets: [0, 16] } }, a));
    writeFileSync(join(model, 'model-00002-of-00002.safetensors'), handmade({ 'y.bias': { dtype: 'I8', shape: [4], data_offsets: [0, 4] } }, b));
    writeFileSync(join(model, 'model.safetensors.index.json'), JSON.stringify({ metadata: { total_size: 20 }, weight_map: { 'y.bias': 'model-00002-of-00002.safetensors', 'x.weight': 'model-00001-of-00002.safetensors' } }));
    const st = await openTensors(model);
    expect(st.format).toBe('safetensors-index');
    expect(st.names).toEqual(['x.weight', 'y.bias']);
    expectSameBytes(await st.read('y.bias'), b);
    await st.close();
    writeFileSync(join(model, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { 'x.weight': 'model-00002-of-00002.safetensors', 'y.bias': 'model-00002-of-00002.safetensors' } }));
    await expect(openSafetensors(model)).rejects.toThrow(/weight_map names a tensor its file does not hold/);
    // An empty weight_map beside two valid shards is not a checkpoint of 0 tensors.
    writeFileSync(join(model, 'model.safetensors.index.json'), JSON.stringify({ metadata: {}, weight_map: {} }));
    await expect(openTensors(model)).rejects.toThrow(InvalidFieldError);
    await expect(openTensors(model)).rejects.toThrow(/model\.safetensors\.index\.json: field 'weight_map': weight_map names no tensor/);
    // A model's config.json given where its weights were meant names the directory to pass.
    writeFileSync(join(model, 'config.json'), JSON.stringify({ architectures: ['DeepseekV3ForCausalLM'], hidden_size: 8 }));
    await expect(openTensors(join(model, 'config.json'))).rejects.toThrow(/config\.json: this is a model's config\.json, not its weights; pass the directory that holds it \(.*hf-model\)/);
  });

  it('finds the config of a checkpoint, and refuses one that is not a file', async () => {
    const model = join(dir, 'cfg-model');
    mkdirSync(model);
    const file = join(model, 'm.safetensors');
    await writeSafetensors(file, [{ name: 'x', dtype: 'U8', shape: [1], data: new Uint8Array(1) }]);
    expect(await findModelConfig(file)).toBeUndefined();
    writeFileSync(join(model, 'config.json'), '{}');
    expect(await findModelConfig(model)).toBe(join(model, 'config.json'));
    expect(await findModelConfig(file)).toBe(join(model, 'config.json'));
    // What `kdtree export -o m.safetensors` writes beside the file comes first.
    writeFileSync(join(model, 'm.config.json'), '{}');
    expect(await findModelConfig(file)).toBe(join(model, 'm.config.json'));
    const other = join(dir, 'cfg-dir');
    mkdirSync(join(other, 'config.json'), { recursive: true });
    await expect(findModelConfig(other)).rejects.toThrow(NotAFileError);
    await expect(findModelConfig(other)).rejects.toThrow(`${join(other, 'config.json')}: model config is a directory, not a regular file`);
  });
});

describe('safetensors writer', () => {
  it('writes the layout of the reference library: compact header padded to 8 bytes', async () => {
    const file = join(dir, 'ours.safetensors');
    const w = seededBytes(24, 4);
    await writeSafetensors(file, [{ name: 'w', dtype: 'F16', shape: [3, 4], data: w }], { metadata: { format: 'pt' } });
    const bytes = readFileSync(file);
    const n = Number(bytes.readBigUInt64LE(0));
    expect(n % 8).toBe(0);
    const text = bytes.subarray(8, 8 + n).toString('utf8');
    expect(text.trimEnd()).toBe('{"__metadata__":{"format":"pt"},"w":{"dtype":"F16","shape":[3,4],"data_offsets":[0,24]}}');
    expectSameBytes(bytes.subarray(8 + n), w);
    const st = await openSafetensors(file);
    expectSameBytes(await st.read('w'), w);
    await st.close();
  });

  it('refuses data of the wrong length and leaves no file behind', async () => {
    const file = join(dir, 'wrong.safetensors');
    await expect(writeSafetensors(file, [{ name: 'w', dtype: 'F32', shape: [2], data: new Uint8Array(7) }])).rejects.toThrow(/differs from shape/);
    expect(() => readFileSync(file)).toThrow();
  });
});
