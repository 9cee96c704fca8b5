/** W4A16 GEMM and MoE GEMM against @kdtree/quant dequantization + @kdtree/reference matmul. */
import { bf16ArrayToF32, f16ArrayToF32, f32ArrayToBf16, f32ArrayToF16 } from '@kdtree/format';
import { dequantizeInt4, quantizeInt4, type Int4Matrix } from '@kdtree/quant';
import { matmulT } from '@kdtree/reference';
import type { DeviceTensor, Dtype, KdtreeBackend } from '../backend.js';
import { expectClose, expectThrows, fail, randomF32, sameBits, withTensors, type KernelCheck } from './harness.js';

/** x as the kernel sees it: rounded to bf16/f16 when that is its dtype. */
function roundX(x: Float32Array, dtype: Dtype): Float32Array {
  if (dtype === 'bf16') return bf16ArrayToF32(f32ArrayToBf16(x));
  if (dtype === 'f16') return f16ArrayToF32(f32ArrayToF16(x));
  return x;
}

function upload(b: KdtreeBackend, dtype: Dtype, shape: number[], x: Float32Array): DeviceTensor {
  if (dtype === 'bf16') return b.fromArray(dtype, shape, f32ArrayToBf16(x));
  if (dtype === 'f16') return b.fromArray(dtype, shape, f32ArrayToF16(x));
  return b.fromArray('f32', shape, x);
}

function asF32(dtype: Dtype, data: ArrayLike<number>): Float32Array {
  if (dtype === 'bf16') return bf16ArrayToF32(data as Uint16Array);
  if (dtype === 'f16') return f16ArrayToF32(data as Uint16Array);
  return data as Float32Array;
}

export function int4(n: number, k: number, group: number, scaleDtype: 'BF16' | 'F32', seed: number): Int4Matrix {
  return quantizeInt4(randomF32(n * k, seed, 0.05), n, k, { groupSize: group, scaleDtype });
}

export function uploadInt4(b: KdtreeBackend, m: Int4Matrix, experts = 1): { qw: DeviceTensor; sc: DeviceTensor } {
  const shapeQ = experts === 1 ? [m.rows, m.cols / 8] : [experts, m.rows / experts, m.cols / 8];
  const shapeS = experts === 1 ? [m.rows, m.cols / m.groupSize] : [experts, m.rows / experts, m.cols / m.groupSize];
  return { qw: b.fromArray('i32', shapeQ, m.packed), sc: b.fromArray(m.scaleDtype === 'BF16' ? 'bf16' : 'f32', shapeS, m.scales) };
}

const TOLERANCE: Record<Dtype, number> = { f32: 1e-5, bf16: 1e-2, f16: 1e-2, i32: 0, u8: 0, f64: 0 };
const SHAPES = [
  { n: 200, k: 224, group: 32 },
  { n: 72, k: 192, group: 64 },
  { n: 40, k: 384, group: 128 },
];
const MS = [1, 3, 17, 118];

function gemmCheck(xDtype: Dtype, scaleDtype: 'BF16' | 'F32', yDtype: Dtype): KernelCheck {
  return {
    name: `w4a16_gemm x ${xDtype}, scales ${scaleDtype.toLowerCase()}, y ${yDtype}: M 1/3/17/118 x 3 shapes vs reference`,
    run(b) {
      let worst = 0;
      for (const [si, { n, k, group }] of SHAPES.entries()) {
        const w = int4(n, k, group, scaleDtype, 10 + si);
        const wf = dequantizeInt4(w);
        withTensors(b, (track) => {
          const { qw, sc } = uploadInt4(b, w);
          track(qw);
          track(sc);
          for (const m of MS) {
            const x = randomF32(m * k, 100 + m + si);
            const xd = track(upload(b, xDtype, [m, k], x));
            const y = track(b.empty(yDtype, [m, n]));
            b.native.w4a16Gemm({ x: xd, qw, sc, y, group });
            const out = asF32(yDtype, b.toArray(y));
            const ref = matmulT(roundX(x, xDtype), m, k, wf, n);
            const tol = Math.max(TOLERANCE[xDtype], TOLERANCE[yDtype]);
            expectClose(`M=${m} N=${n} K=${k} G=${group}`, out, ref, tol);
            let num = 0;
            let den = 0;
            for (let i = 0; i < ref.length; i++) {
              num += (out[i] - ref[i]) ** 2;
              den += ref[i] ** 2;
            }
            worst = Math.max(worst, Math.sqrt(num / den));
          }
        });
      }
      return { detail: `worst rel ${worst.toExponential(1)} (tolerance ${Math.max(TOLERANCE[xDtype], TOLERANCE[yDtype])})` };
    },
  };
}

/** Row m of an M-row call must equal, bit for bit, the same row computed alone. */
function gemmInvarianceCheck(xDtype: Dtype): KernelCheck {
  return {
    name: `w4a16_gemm x ${xDtype}: batch invariance (row of M=17 and M=118 == the row alone, bit for bit)`,
    run(b) {
      const { n, k, group } = { n: 136, k: 256, group: 32 };
      const w = int4(n, k, group, 'BF16', 77);
      withTensors(b, (track) => {
        const { qw, sc } = uploadInt4(b, w);
        track(qw);
        track(sc);
        for (const m of [17, 118]) {
          const x = randomF32(m * k, 300 + m);
          const xd = track(upload(b, xDtype, [m, k], x));
          const y = track(b.empty('f32', [m, n]));
          b.native.w4a16Gemm({ x: xd, qw, sc, y, group });
          const all = b.toArray(y) as Float32Array;
          for (const r of [0, 5, m - 1]) {
            const x1 = track(upload(b, xDtype, [1, k], x.subarray(r * k, (r + 1) * k)));
            const y1 = track(b.empty('f32', [1, n]));
            b.native.w4a16Gemm({ x: x1, qw, sc, y: y1, group });
            if (!sameBits(b.toArray(y1), all.subarray(r * n, (r + 1) * n))) fail(`row ${r} of M=${m} differs from the row computed alone`);
          }
        }
      });
    },
  };
}

function moeCheck(xDtype: Dtype): KernelCheck {
  return {
    name: `moe_gemm x ${xDtype}: gather and weighted-sum modes, 6 experts, top-2, T 1/5 vs reference`,
    run(b) {
      const E = 6;
      const n = 64;
      const k = 96;
      const topk = 2;
      const w = int4(E * n, k, 32, 'BF16', 55);
      const wf = dequantizeInt4(w);
      return withTensors(b, (track) => {
        const { qw, sc } = uploadInt4(b, w, E);
        track(qw);
        track(sc);
        let detail = '';
        for (const T of [1, 5]) {
          const ids = Int32Array.from({ length: T * topk }, (_, i) => (i * 5 + Math.floor(i / topk)) % E);
          for (let t = 0; t < T; t++) if (ids[t * topk] === ids[t * topk + 1]) ids[t * topk + 1] = (ids[t * topk + 1] + 1) % E;
          const weights = Float32Array.from({ length: T * topk }, (_, i) => 0.3 + 0.1 * i);
          const x = randomF32(T * k, 900 + T);
          const xr = roundX(x, xDtype);
          const expert = (e: number, row: Float32Array) => matmulT(row, 1, k, wf.subarray(e * n * k, (e + 1) * n * k), n);
          // gather: y[t * topk + j] = x[t] . W[ids[t, j]]^T
          const yg = track(b.empty('f32', [T * topk, n]));
          const idsD = track(b.fromArray('i32', [T, topk], ids));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T, k], x)), qw, sc, ids: idsD, y: yg, mode: 'gather' });
          const refG = new Float32Array(T * topk * n);
          for (let p = 0; p < T * topk; p++) refG.set(expert(ids[p], xr.subarray(Math.floor(p / topk) * k, (Math.floor(p / topk) + 1) * k)), p * n);
          detail = expectClose(`gather T=${T}`, b.toArray(yg) as Float32Array, refG, TOLERANCE[xDtype]);
          // sum: y[t] = sum_j w[t, j] * (x[t * topk + j] . W[ids[t, j]]^T)
          const xp = randomF32(T * topk * k, 950 + T);
          const xpr = roundX(xp, xDtype);
          const ys = track(b.empty('f32', [T, n]));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T * topk, k], xp)), qw, sc, ids: idsD, weights: track(b.fromArray('f32', [T, topk], weights)), y: ys, mode: 'sum' });
          const refS = new Float32Array(T * n);
          for (let t = 0; t < T; t++) {
            for (let j = 0; j < topk; j++) {
              const p = t * topk + j;
              const y = expert(ids[p], xpr.subarray(p * k, (p + 1) * k));
              for (let i = 0; i < n; i++) refS[t * n + i] += weights[p] * y[i];
            }
          }
          detail += `; ${expectClose(`sum T=${T}`, b.toArray(ys) as Float32Array, refS, TOLERANCE[xDtype])}`;
        }
        return { detail };
      });
    },
  };
}

const shapeErrors: KernelCheck = {
  name: 'w4a16_gemm and moe_gemm reject bad shapes, dtypes and groups with every shape in the message',
  run(b) {
    withTensors(b, (track) => {
      const x = track(b.zeros('bf16', [3, 64]));
      const qw = track(b.zeros('i32', [16, 8]));
      const sc = track(b.zeros('bf16', [16, 2]));
      const y = track(b.zeros('f32', [3, 16]));
      b.native.w4a16Gemm({ x, qw, sc, y, group: 32 });
      expectThrows('K mismatch', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [3, 96])), qw, sc, y, group: 32 }), /x: bf16 \[3, 96\].*qw: i32 \[16, 8\].*qw must be \[N, K\/8\] = \[16, 12\]/);
      expectThrows('group', () => b.native.w4a16Gemm({ x, qw, sc, y, group: 48 }), /group size 48 is not 32, 64 or 128/);
      expectThrows('scales', () => b.native.w4a16Gemm({ x, qw, sc: track(b.zeros('bf16', [16, 3])), y, group: 32 }), /sc must be \[N, K\/G\] = \[16, 2\]/);
      expectThrows('y shape', () => b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('f32', [2, 16])), group: 32 }), /y must be \[M, N\] = \[3, 16\]/);
      expectThrows('dtype', () => b.native.w4a16Gemm({ x: track(b.zeros('i32', [3, 64])), qw, sc, y, group: 32 }), /x must be f32 or bf16 or f16, got i32/);
      expectThrows('buffer too small', () => b.native.w4a16Gemm({ x: { ...x, shape: [300, 64] }, qw, sc, y, group: 32 }), /x needs 38400 bytes but its buffer holds 384/);
      expectThrows('rank', () => b.native.w4a16Gemm({ x: { ...x, shape: [192] }, qw, sc, y, group: 32 }), /x must have 2 dimensions, got 1/);
      expectThrows('not a tensor', () => b.native.w4a16Gemm({ x: { buffer: {} as never, dtype: 'bf16', shape: [3, 64] }, qw, sc, y, group: 32 }), /x\.buffer must be a DeviceBuffer/);
      expectThrows('missing', () => b.native.w4a16Gemm({ x, qw, sc } as never), /y is required/);
      const ids = track(b.zeros('i32', [3, 2]));
      const eqw = track(b.zeros('i32', [4, 16, 8]));
      const esc = track(b.zeros('bf16', [4, 16, 2]));
      expectThrows('moe gather y', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y, mode: 'gather' }), /gather mode: y must be \[T\*topk, N\] = \[6, 16\]/);
      expectThrows('moe mode', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y, mode: 'scatter' as never }), /mode must be 'gather' or 'sum'/);
      expectThrows('moe weights', () => b.native.moeGemm({ x: track(b.zeros('bf16', [6, 64])), qw: eqw, sc: esc, ids, y, mode: 'sum' }), /weights/);
    });
  },
};

export const GEMM_CHECKS: KernelCheck[] = [
  gemmCheck('f32', 'BF16', 'f32'),
  gemmCheck('f32', 'F32', 'f32'),
  gemmCheck('bf16', 'BF16', 'f32'),
  gemmCheck('bf16', 'BF16', 'bf16'),
  gemmCheck('f16', 'F32', 'f16'),
  gemmInvarianceCheck('f32'),
  gemmInvarianceCheck('bf16'),
  moeCheck('f32'),
  moeCheck('bf16'),
  shapeErrors,
];
