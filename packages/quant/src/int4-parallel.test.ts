import { describe, expect, it } from 'vitest';
import { NonFiniteWeightError } from './errors.js';
import { quantizeInt4 } from './int4.js';
import { quantizeInt4Parallel } from './int4-parallel.js';

function weights(n: number): Float32Array {
  const w = new Float32Array(n);
  let x = 99;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    w[i] = (x / 2 ** 32 - 0.5) * 0.2;
  }
  return w;
}

describe('quantizeInt4Parallel', () => {
  it('produces the same bytes and error statistics as the single-thread quantizer', async () => {
    const [rows, cols] = [1031, 1024]; // > 1M weights: the threaded path; rows not divisible by threads
    const w = weights(rows * cols);
    for (const scaleDtype of ['BF16', 'F32'] as const) {
      const s1 = { maxAbsError: 0, sumAbsError: 0, count: 0 };
      const s2 = { maxAbsError: 0, sumAbsError: 0, count: 0 };
      const a = quantizeInt4(w, rows, cols, { scaleDtype, groupSize: 64 }, s1);
      const b = await quantizeInt4Parallel(w, rows, cols, { scaleDtype, groupSize: 64, threads: 3 }, s2);
      expect(Buffer.from(b.packed.buffer).equals(Buffer.from(a.packed.buffer))).toBe(true);
      expect(Buffer.from(b.scales.buffer).equals(Buffer.from(a.scales.buffer))).toBe(true);
      expect(s2.count).toBe(s1.count);
      expect(s2.maxAbsError).toBe(s1.maxAbsError);
      expect(s2.sumAbsError).toBeCloseTo(s1.sumAbsError, 6);
    }
  });

  it('reports a non-finite weight from a worker with the tensor name', async () => {
    const w = weights(1024 * 1024);
    w[1000 * 1024 + 7] = Number.POSITIVE_INFINITY;
    await expect(quantizeInt4Parallel(w, 1024, 1024, { name: 'experts.3.w', threads: 2 })).rejects.toThrow(NonFiniteWeightError);
    await expect(quantizeInt4Parallel(w, 1024, 1024, { name: 'experts.3.w', threads: 2 })).rejects.toThrow(/experts\.3\.w.*weight \[1000, 7\] is Infinity/);
  });
});
