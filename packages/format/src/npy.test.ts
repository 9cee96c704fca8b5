import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { BadMagicError, InvalidFieldError, ShapeSizeMismatchError, UnknownDtypeError } from './errors.js';
import { encodeNpy, parseNpy, readNpy, writeNpy } from './npy.js';
import { expectSameBytes, seededBytes, tempDir } from './test-support/tmp.js';

const dir = tempDir();
const fixtures = join(import.meta.dirname, '..', 'fixtures', 'npy');

describe('.npy', () => {
  it('round-trips every supported dtype', async () => {
    for (const [dtype, size] of [['F32', 4], ['F64', 8], ['F16', 2], ['I64', 8], ['I32', 4], ['U8', 1], ['BOOL', 1]] as const) {
      const data = seededBytes(6 * size, 7);
      const file = join(dir, `${dtype}.npy`);
      await writeNpy(file, { dtype, shape: [2, 3], data });
      const back = await readNpy(file);
      expect(back.dtype).toBe(dtype);
      expect(back.shape).toEqual([2, 3]);
      expectSameBytes(back.data, data);
    }
  });

  it('writes headers aligned to 64 bytes, 1-D shapes with a trailing comma', () => {
    const bytes = encodeNpy({ dtype: 'I32', shape: [5], data: new Uint8Array(20) });
    const headerLength = bytes[8] | (bytes[9] << 8);
    expect((10 + headerLength) % 64).toBe(0);
    expect(Buffer.from(bytes.subarray(10, 10 + headerLength)).toString('latin1')).toMatch(/^\{'descr': '<i4', 'fortran_order': False, 'shape': \(5,\), \} *\n$/);
  });

  it('reads files written by numpy (fixtures from tools/fixtures/gen_npy_fixtures.py)', async () => {
    const f32 = await readNpy(join(fixtures, 'arange_f32_3x4.npy'));
    expect(f32.dtype).toBe('F32');
    expect(f32.shape).toEqual([3, 4]);
    expect(Array.from(new Float32Array(f32.data.slice().buffer))).toEqual(Array.from({ length: 12 }, (_, i) => i * 0.5));
    const i64 = await readNpy(join(fixtures, 'tokens_i64.npy'));
    expect(i64.shape).toEqual([5]);
    expect(Array.from(new BigInt64Array(i64.data.slice().buffer), Number)).toEqual([1, 2, 3, 163839, -1]);
    const scalar = await readNpy(join(fixtures, 'scalar_f64.npy'));
    expect(scalar.shape).toEqual([]);
    expect(new Float64Array(scalar.data.slice().buffer)[0]).toBe(Math.PI);
    const v2 = await readNpy(join(fixtures, 'version2_u8.npy'));
    expect(v2.shape).toEqual([2, 2]);
    await expect(readNpy(join(fixtures, 'fortran_f32.npy'))).rejects.toThrow(InvalidFieldError);
    await expect(readNpy(join(fixtures, 'big_endian_f32.npy'))).rejects.toThrow(UnknownDtypeError);
  });

  it('rejects foreign and inconsistent files', () => {
    expect(() => parseNpy(new Uint8Array(20))).toThrow(BadMagicError);
    const good = encodeNpy({ dtype: 'F32', shape: [2], data: new Uint8Array(8) });
    expect(() => parseNpy(good.subarray(0, good.length - 1))).toThrow(ShapeSizeMismatchError);
    expect(() => encodeNpy({ dtype: 'BF16', shape: [1], data: new Uint8Array(2) })).toThrow(UnknownDtypeError);
  });
});
