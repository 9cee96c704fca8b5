import { describe, expect, it } from 'vitest';
import { bf16ArrayToF32, bf16ToF32, f16ArrayToF32, f16ToF32, f32ArrayToBf16, f32ArrayToF16, f32ToBf16, f32ToF16 } from './half.js';

describe('bf16', () => {
  it('converts known values', () => {
    expect(f32ToBf16(1)).toBe(0x3f80);
    expect(f32ToBf16(-2)).toBe(0xc000);
    expect(f32ToBf16(0)).toBe(0);
    expect(f32ToBf16(-0)).toBe(0x8000);
    expect(f32ToBf16(Infinity)).toBe(0x7f80);
    expect(bf16ToF32(0x3f80)).toBe(1);
    expect(bf16ToF32(0x4049)).toBeCloseTo(3.140625, 10);
  });
  it('rounds to nearest even on ties', () => {
    // 1 + 2^-8 is exactly between bf16 1.0 (mantissa even) and 1 + 2^-7: ties go to even.
    expect(f32ToBf16(1 + 2 ** -8)).toBe(0x3f80);
    // 1 + 3 * 2^-8 is between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up to even.
    expect(f32ToBf16(1 + 3 * 2 ** -8)).toBe(0x3f82);
    expect(f32ToBf16(1 + 2 ** -8 + 2 ** -20)).toBe(0x3f81);
  });
  it('keeps NaN a NaN (never rounds it to Inf)', () => {
    const nan = new Float32Array(new Uint32Array([0x7f800001]).buffer)[0];
    expect(Number.isNaN(bf16ToF32(f32ToBf16(nan)))).toBe(true);
  });
  it('round-trips every bf16 bit pattern', () => {
    const bits = new Uint16Array(65536).map((_, i) => i);
    const back = f32ArrayToBf16(bf16ArrayToF32(bits));
    for (let i = 0; i < 65536; i++) {
      const isNaN = (i & 0x7f80) === 0x7f80 && (i & 0x7f) !== 0;
      if (isNaN) expect(Number.isNaN(bf16ToF32(back[i]))).toBe(true);
      else expect(back[i]).toBe(i);
    }
  });
});

describe('f16', () => {
  it('converts known values, subnormals and overflow', () => {
    expect(f32ToF16(1)).toBe(0x3c00);
    expect(f32ToF16(65504)).toBe(0x7bff);
    expect(f32ToF16(65519)).toBe(0x7bff);
    expect(f32ToF16(65520)).toBe(0x7c00);
    expect(f32ToF16(2 ** -24)).toBe(0x0001);
    expect(f32ToF16(2 ** -25)).toBe(0); // tie between 0 and the smallest subnormal: even is 0
    expect(f32ToF16(3 * 2 ** -25)).toBe(0x0002); // tie between 1 and 2 ulps: even is 2
    expect(f32ToF16(-(2 ** -14))).toBe(0x8400);
    expect(f16ToF32(0x0001)).toBe(2 ** -24);
    expect(f16ToF32(0xfc00)).toBe(-Infinity);
  });
  it('round-trips every f16 bit pattern', () => {
    const bits = new Uint16Array(65536).map((_, i) => i);
    const back = f32ArrayToF16(f16ArrayToF32(bits));
    for (let i = 0; i < 65536; i++) {
      const isNaN = (i & 0x7c00) === 0x7c00 && (i & 0x3ff) !== 0;
      if (isNaN) expect(Number.isNaN(f16ToF32(back[i]))).toBe(true);
      else expect(back[i]).toBe(i);
    }
  });
  it('rounds f32 values between halves to the nearest, ties to even', () => {
    // 1 + 2^-11 lies exactly between 1 and 1 + 2^-10.
    expect(f32ToF16(1 + 2 ** -11)).toBe(0x3c00);
    expect(f32ToF16(1 + 3 * 2 ** -11)).toBe(0x3c02);
    expect(f32ToF16(1 + 2 ** -11 + 2 ** -20)).toBe(0x3c01);
  });
});
