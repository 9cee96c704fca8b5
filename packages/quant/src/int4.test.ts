import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { bf16ToF32 } from '@kdtree/format';
import { GroupShapeError, NonFiniteWeightError } from './errors.js';
import {
  dequantizeInt4,
  F32_EPS,
  fromGptqQweight,
  groupScale,
  packInt4,
  quantizeInt4,
  roundHalfEven,
  RULES,
  scalesToF32,
  toGptqQweight,
  unpackInt4,
  ZERO_GROUP_SCALE,
  type ScaleDtype,
  type ScaleRule,
} from './int4.js';

function randomWeights(n: number, seed: number, spread = 1): Float32Array {
  const out = new Float32Array(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    const u = x / 2 ** 32;
    out[i] = (u - 0.5) * 2 * spread * (i % 7 === 0 ? 3 : 1);
  }
  return out;
}

describe('packing', () => {
  it('packs q = -8..-1 into 0x76543210 (element 0 in the low nibble)', () => {
    const packed = packInt4(Int8Array.of(-8, -7, -6, -5, -4, -3, -2, -1), 1, 8);
    expect(packed[0] >>> 0).toBe(0x76543210);
    const bytes = new Uint8Array(packed.buffer);
    expect(Array.from(bytes)).toEqual([0x10, 0x32, 0x54, 0x76]); // two codes per byte, low nibble first
    expect(Array.from(unpackInt4(packed, 1, 8))).toEqual([-8, -7, -6, -5, -4, -3, -2, -1]);
  });

  it('pack/unpack round-trips any codes', () => {
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 5 }), fc.integer({ min: 1, max: 6 }), fc.infiniteStream(fc.integer({ min: -8, max: 7 })), (rows, words, stream) => {
        const cols = words * 8;
        const codes = Int8Array.from(stream.take(rows * cols));
        expect(Array.from(unpackInt4(packInt4(codes, rows, cols), rows, cols))).toEqual(Array.from(codes));
      }),
    );
  });

  it('refuses codes outside [-8, 7] and K not a multiple of 8', () => {
    expect(() => packInt4(Int8Array.of(8, 0, 0, 0, 0, 0, 0, 0), 1, 8)).toThrow(/outside \[-8, 7\]/);
    expect(() => packInt4(new Int8Array(12), 1, 12)).toThrow(GroupShapeError);
  });

  it('the GPTQ qweight view is the transpose of weight_packed', () => {
    const packed = Int32Array.from({ length: 3 * 4 }, (_, i) => i * 0x01010101);
    const q = toGptqQweight(packed, 3, 32);
    expect(q[1 * 3 + 2]).toBe(packed[2 * 4 + 1]);
    expect(Array.from(fromGptqQweight(q, 3, 32))).toEqual(Array.from(packed));
  });
});

describe('scales', () => {
  it('uses fl32(absmax / 7.5) cast to bf16, and absmax / 7 for absmax7', () => {
    expect(groupScale(7.5, 'minmax', 'F32').value).toBe(1);
    expect(groupScale(1, 'minmax', 'F32').value).toBe(Math.fround(1 / 7.5));
    const s = groupScale(1, 'minmax', 'BF16');
    expect(s.value).toBe(bf16ToF32(s.stored));
    expect(s.value).toBe(137 / 1024); // bf16 nearest to 0.13333334: 136/1024 and 137/1024 bracket it
    expect(groupScale(7, 'absmax7', 'BF16').value).toBe(1);
  });
  it('gives a zero group the storage dtype epsilon and clamps tiny scales to f32 eps', () => {
    expect(groupScale(0, 'minmax', 'BF16').value).toBe(ZERO_GROUP_SCALE.BF16);
    expect(groupScale(0, 'minmax', 'F32').value).toBe(ZERO_GROUP_SCALE.F32);
    expect(groupScale(1e-30, 'minmax', 'F32').value).toBe(F32_EPS);
  });
  it('rounds half to even like torch.round', () => {
    expect([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, 7.5, -7.5].map(roundHalfEven)).toEqual([0, 2, 2, -0, -2, -2, 2, 8, -8]);
  });
});

/** Independent check of one group: each code is the nearest allowed grid point (ties to even). */
function checkGroupCodes(w: Float32Array, codes: Int8Array, s: number, rule: ScaleRule) {
  const { qmin, qmax } = RULES[rule];
  for (let i = 0; i < w.length; i++) {
    const x = Math.fround(w[i] / s);
    const ideal = Math.min(qmax, Math.max(qmin, x));
    const q = codes[i];
    const d = Math.abs(q - ideal);
    expect(d).toBeLessThanOrEqual(0.5);
    if (d === 0.5) expect(q % 2 === 0 || ideal === qmin || ideal === qmax).toBe(true);
  }
}

describe('quantize / dequantize', () => {
  const shapes: [number, number][] = [[1, 32], [3, 64], [17, 96], [5, 224], [2, 128], [1, 256]];
  for (const rule of ['minmax', 'absmax7'] as ScaleRule[]) {
    for (const scaleDtype of ['BF16', 'F32'] as ScaleDtype[]) {
      for (const groupSize of [32, 64, 128]) {
        it(`${rule} ${scaleDtype} g${groupSize}: nearest codes, |w - deq| <= scale / 2 inside the clamp range`, () => {
          for (const [rows, cols] of shapes) {
            if (cols % groupSize) continue;
            const w = randomWeights(rows * cols, rows * 1000 + cols + groupSize, 0.05);
            const m = quantizeInt4(w, rows, cols, { groupSize, rule, scaleDtype });
            expect(m.packed.length).toBe((rows * cols) / 8);
            expect(m.scales.length).toBe((rows * cols) / groupSize);
            const codes = unpackInt4(m.packed, rows, cols);
            const scales = scalesToF32(m.scales);
            const deq = dequantizeInt4(m);
            const { qmin, qmax } = RULES[rule];
            for (let r = 0; r < rows; r++) {
              for (let g = 0; g < cols / groupSize; g++) {
                const s = scales[r * (cols / groupSize) + g];
                const at = r * cols + g * groupSize;
                checkGroupCodes(w.subarray(at, at + groupSize), codes.subarray(at, at + groupSize), s, rule);
                for (let i = at; i < at + groupSize; i++) {
                  const x = w[i] / s;
                  if (x >= qmin && x <= qmax) expect(Math.abs(w[i] - deq[i])).toBeLessThanOrEqual((s / 2) * (1 + 2 ** -20));
                  expect(deq[i]).toBe(Math.fround(codes[i] * s));
                }
              }
            }
          }
        });
      }
    }
  }

  it('quantizes an all-zero group to code 0 with the epsilon scale', () => {
    const w = new Float32Array(64);
    w.fill(0.3, 32);
    const m = quantizeInt4(w, 1, 64, { scaleDtype: 'BF16' });
    expect(bf16ToF32(m.scales[0] as number)).toBe(2 ** -7);
    expect(Array.from(unpackInt4(m.packed, 1, 64).subarray(0, 32))).toEqual(new Array(32).fill(0));
    expect(Array.from(dequantizeInt4(m).subarray(0, 32))).toEqual(new Array(32).fill(0));
  });

  it('handles extreme magnitudes: near f32 max, subnormals, a single outlier', () => {
    const w = new Float32Array(96);
    w[0] = 3.0e38;
    w[1] = -1e38;
    w[32] = 1e-40; // subnormal: scale clamps to f32 eps, code 0
    w[64] = -1000;
    for (let i = 65; i < 96; i++) w[i] = 0.001;
    const m = quantizeInt4(w, 1, 96, { scaleDtype: 'F32' });
    const codes = unpackInt4(m.packed, 1, 96);
    expect(codes[0]).toBe(7); // +absmax / (absmax / 7.5) = 7.5 -> 8 -> clamped to 7
    expect(codes[64]).toBe(-8); // -absmax -> -7.5 -> ties to even -8
    expect(m.scales[1]).toBe(F32_EPS);
    expect(Number.isFinite(dequantizeInt4(m)[0])).toBe(true);
  });

  it('rejects NaN and Inf naming the element', () => {
    const w = new Float32Array(64);
    w[40] = NaN;
    expect(() => quantizeInt4(w, 2, 32, { name: 'layers.0.w' })).toThrow(NonFiniteWeightError);
    expect(() => quantizeInt4(w, 2, 32, { name: 'layers.0.w' })).toThrow(/layers\.0\.w.*weight \[1, 8\] is NaN/);
    w[40] = -Infinity;
    expect(() => quantizeInt4(w, 2, 32)).toThrow(/-Infinity/);
  });

  it('rejects shapes that do not divide into groups, with the numbers', () => {
    expect(() => quantizeInt4(new Float32Array(36), 1, 36, { name: 'x' })).toThrow(/K = 36 \(shape \[1, 36\]\) is not a multiple of 8/);
    expect(() => quantizeInt4(new Float32Array(48), 1, 48, { groupSize: 32 })).toThrow(/K = 48 .* group size 32/);
    expect(() => quantizeInt4(new Float32Array(64), 1, 64, { groupSize: 16 })).toThrow(/group size 16 is not supported/);
    expect(() => quantizeInt4(new Float32Array(10), 1, 64)).toThrow(/has 10 values/);
  });
});
