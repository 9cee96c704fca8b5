/**
 * moe_gemm over bf16 experts as the checkpoint stores them (w [E, N, K], the routed experts of a
 * float bundle) against @kdtree/reference matmul: gather and weighted-sum modes, the siluMul
 * epilogue, batch invariance, bad arguments.
 */
import { bf16ArrayToF32, f32ArrayToBf16 } from '@kdtree/format';
import { matmulT } from '@kdtree/reference';
import { KdtreeBackend, type DeviceTensor, type Dtype } from '../backend.js';
import { asF32, roundX, upload } from './gemm-checks.js';
import { expectThrows, fail, randomF32, relError, sameBits, withTensors, type KernelCheck } from './harness.js';

const E = 6;
const TOPK = 2;
/** K a multiple of 8 but not of 256 (the lanes' last chunks are partial); N not a multiple of 8 (a partial block of columns). */
const N = 44;
const K = 264;

/**
 * Per row of y: the reference holds x rounded to its dtype and the exact bf16 weights, so what is
 * left is the f32 sum (K = 264 terms: under 1e-5 of the row's norm, ~1e-7 measured) and y's
 * rounding (bf16 keeps 8 significant bits: a relative 2^-8 per element at most).
 */
const ROW_TOLERANCE: Partial<Record<Dtype, number>> = { f32: 1e-5, bf16: 2 ** -8 + 1e-5 };

function expectRowsClose(what: string, out: Float32Array, ref: Float32Array, width: number, tolerance: number): number {
  let worst = 0;
  for (let r = 0; r < ref.length / width; r++) {
    const e = relError(out.subarray(r * width, (r + 1) * width), ref.subarray(r * width, (r + 1) * width));
    if (!(e <= tolerance)) fail(`${what}: row ${r} has relative error ${e.toExponential(2)} > ${tolerance}`);
    worst = Math.max(worst, e);
  }
  return worst;
}

/** E experts of `rows` x K in bf16: the device tensor and the f32 values it holds. */
function experts(b: KdtreeBackend, rows: number, seed: number): { w: DeviceTensor; wf: Float32Array } {
  const bits = f32ArrayToBf16(randomF32(E * rows * K, seed, 0.05));
  return { w: b.fromArray('bf16', [E, rows, K], bits), wf: bf16ArrayToF32(bits) };
}

/** Distinct experts per token, spread over all E. */
function routes(T: number): Int32Array {
  return Int32Array.from({ length: T * TOPK }, (_, i) => (Math.floor(i / TOPK) * 5 + (i % TOPK) * 3 + 1) % E);
}

function againstReference(xDtype: 'f32' | 'bf16', yDtype: 'f32' | 'bf16'): KernelCheck {
  return {
    name: `moe_gemm bf16 experts [${E}, ${N}, ${K}], x ${xDtype}, y ${yDtype}: gather and weighted-sum modes, top-${TOPK}, T 1/5/13 vs reference per row; a token's rows == the token alone`,
    run(b) {
      const tol = ROW_TOLERANCE[yDtype]!;
      let worst = 0;
      withTensors(b, (track) => {
        const { w, wf } = experts(b, N, 71);
        track(w);
        const expert = (e: number, row: Float32Array) => matmulT(row, 1, K, wf.subarray(e * N * K, (e + 1) * N * K), N);
        for (const T of [1, 5, 13]) {
          const ids = routes(T);
          const idsD = track(b.fromArray('i32', [T, TOPK], ids));
          const x = randomF32(T * K, 300 + T);
          const xr = roundX(x, xDtype);
          const yg = track(b.empty(yDtype, [T * TOPK, N]));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T, K], x)), w, ids: idsD, y: yg, mode: 'gather' });
          const gathered = asF32(yDtype, b.toArray(yg));
          const refG = new Float32Array(T * TOPK * N);
          for (let p = 0; p < T * TOPK; p++) refG.set(expert(ids[p], xr.subarray(Math.floor(p / TOPK) * K, (Math.floor(p / TOPK) + 1) * K)), p * N);
          worst = Math.max(worst, expectRowsClose(`gather T=${T}`, gathered, refG, N, tol));
          if (T === 13) {
            // token 11 alone: its rows, bit for bit
            const one = track(b.empty(yDtype, [TOPK, N]));
            b.native.moeGemm({ x: track(upload(b, xDtype, [1, K], x.subarray(11 * K, 12 * K))), w, ids: track(b.fromArray('i32', [1, TOPK], ids.subarray(11 * TOPK, 12 * TOPK))), y: one, mode: 'gather' });
            const rows = b.toArray(yg);
            if (!sameBits(b.toArray(one), rows.subarray(11 * TOPK * N, 12 * TOPK * N))) fail('gather: token 11 alone differs from its rows in the 13-token call');
          }
          // sum: y[t] = sum_j weights[t, j] * (x[t * topk + j] . W[ids[t, j]]^T)
          const weights = Float32Array.from({ length: T * TOPK }, (_, i) => 0.25 + 0.125 * (i % 5));
          const xp = randomF32(T * TOPK * K, 400 + T);
          const xpr = roundX(xp, xDtype);
          const ys = track(b.empty(yDtype, [T, N]));
          const weightsD = track(b.fromArray('f32', [T, TOPK], weights));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T * TOPK, K], xp)), w, ids: idsD, weights: weightsD, y: ys, mode: 'sum' });
          const refS = new Float32Array(T * N);
          for (let p = 0; p < T * TOPK; p++) {
            const y = expert(ids[p], xpr.subarray(p * K, (p + 1) * K));
            for (let i = 0; i < N; i++) refS[Math.floor(p / TOPK) * N + i] += weights[p] * y[i];
          }
          const summed = b.toArray(ys);
          worst = Math.max(worst, expectRowsClose(`sum T=${T}`, asF32(yDtype, summed), refS, N, tol));
          if (T === 13) {
            const one = track(b.empty(yDtype, [1, N]));
            b.native.moeGemm({ x: track(upload(b, xDtype, [TOPK, K], xp.subarray(11 * TOPK * K, 12 * TOPK * K))), w, ids: track(b.fromArray('i32', [1, TOPK], ids.subarray(11 * TOPK, 12 * TOPK))), weights: track(b.fromArray('f32', [1, TOPK], weights.subarray(11 * TOPK, 12 * TOPK))), y: one, mode: 'sum' });
            if (!sameBits(b.toArray(one), summed.subarray(11 * N, 12 * N))) fail('sum: token 11 alone differs from its row in the 13-token call');
          }
        }
      });
      return { detail: `worst row rel ${worst.toExponential(1)} (tolerance ${tol})` };
    },
  };
}

/** On cuda: the kernel's sums against the C++ twin of the same binary, which sums in the warp's order. */
const twinCheck: KernelCheck = {
  name: 'moe_gemm bf16 experts: gather and sum on cuda == the C++ twin bit for bit (T 7, x bf16 and f32)',
  run(b) {
    if (b.kind !== 'cuda') return { detail: 'the cpu backend is the twin: compared on cuda only' };
    const twin = new KdtreeBackend({ ...b.loaded, native: b.loaded.module.createBackend('cpu') });
    const T = 7;
    const ids = routes(T);
    const weights = Float32Array.from({ length: T * TOPK }, (_, i) => 0.5 + 0.25 * (i % 3));
    const run = (on: KdtreeBackend, xDtype: 'f32' | 'bf16', bits: Uint16Array, x: Float32Array, xp: Float32Array) =>
      withTensors(on, (track) => {
        const w = track(on.fromArray('bf16', [E, N, K], bits));
        const idsD = track(on.fromArray('i32', [T, TOPK], ids));
        const yg = track(on.empty('f32', [T * TOPK, N]));
        on.native.moeGemm({ x: track(upload(on, xDtype, [T, K], x)), w, ids: idsD, y: yg, mode: 'gather' });
        const ys = track(on.empty('f32', [T, N]));
        on.native.moeGemm({ x: track(upload(on, xDtype, [T * TOPK, K], xp)), w, ids: idsD, weights: track(on.fromArray('f32', [T, TOPK], weights)), y: ys, mode: 'sum' });
        return [on.toArray(yg), on.toArray(ys)];
      });
    const bits = f32ArrayToBf16(randomF32(E * N * K, 75, 0.05));
    for (const xDtype of ['bf16', 'f32'] as const) {
      const x = randomF32(T * K, 600);
      const xp = randomF32(T * TOPK * K, 601);
      const [cuda, cpu] = [run(b, xDtype, bits, x, xp), run(twin, xDtype, bits, x, xp)];
      for (const [i, mode] of ['gather', 'sum'].entries()) if (!sameBits(cuda[i], cpu[i])) fail(`x ${xDtype}, ${mode}: the cuda sums differ from the C++ twin's`);
    }
    return { detail: 'gather and sum, x bf16 and f32: identical bits' };
  },
};

const I = 20;

const epilogueCheck: KernelCheck = {
  name: `moe_gemm bf16 experts with the siluMul epilogue: [gate; up] rows [${E}, ${2 * I}, ${K}] in checkpoint order, y bf16 and f32, T 1/9 == plain gather + siluMul bit for bit, vs reference`,
  run(b) {
    let worst = 0;
    withTensors(b, (track) => {
      const { w, wf } = experts(b, 2 * I, 73);
      track(w);
      for (const yDtype of ['bf16', 'f32'] as const) {
        for (const T of [1, 9]) {
          const ids = track(b.fromArray('i32', [T, TOPK], routes(T)));
          const x = track(upload(b, 'bf16', [T, K], randomF32(T * K, 500 + T)));
          const fused = track(b.empty(yDtype, [T * TOPK, I]));
          b.native.moeGemm({ x, w, ids, y: fused, mode: 'gather', epilogue: 'siluMul' });
          const plain = track(b.empty(yDtype, [T * TOPK, 2 * I]));
          b.native.moeGemm({ x, w, ids, y: plain, mode: 'gather' });
          const act = track(b.empty(yDtype, [T * TOPK, I]));
          b.native.siluMul({ x: plain, out: act });
          const got = b.toArray(fused);
          if (!sameBits(got, b.toArray(act))) fail(`y ${yDtype}, T=${T}: the fused epilogue differs from gather + siluMul`);
          // reference: silu(gate) * up of the exact products
          const xr = roundX(asF32('bf16', b.toArray(x)), 'bf16');
          const routed = routes(T);
          const ref = new Float32Array(T * TOPK * I);
          for (let p = 0; p < T * TOPK; p++) {
            const e = routed[p];
            const gu = matmulT(xr.subarray(Math.floor(p / TOPK) * K, (Math.floor(p / TOPK) + 1) * K), 1, K, wf.subarray(e * 2 * I * K, (e + 1) * 2 * I * K), 2 * I);
            for (let j = 0; j < I; j++) ref[p * I + j] = (gu[j] / (1 + Math.exp(-gu[j]))) * gu[I + j];
          }
          // gate and up are rounded to y's dtype before the product, and the product once more: three
          // roundings of 2^-8 in bf16 (the f32 sums and expf add ~1e-7)
          worst = Math.max(worst, expectRowsClose(`y ${yDtype}, T=${T}`, asF32(yDtype, got), ref, I, yDtype === 'bf16' ? 3 * 2 ** -8 : 1e-5));
        }
      }
    });
    return { detail: `worst row rel ${worst.toExponential(1)}` };
  },
};

const misuse: KernelCheck = {
  name: 'moe_gemm bf16 experts reject w with qw/sc, f32 or mis-shaped w, K not a multiple of 8, misaligned x, minWarpSteps, and routing shapes, naming every shape',
  run(b) {
    withTensors(b, (track) => {
      const w = track(b.zeros('bf16', [E, 16, 64]));
      const x = track(b.zeros('bf16', [2, 64]));
      const ids = track(b.zeros('i32', [2, TOPK]));
      const y = track(b.zeros('f32', [4, 16]));
      b.native.moeGemm({ x, w, ids, y });
      const packed = { qw: track(b.zeros('i32', [E, 1, 1, 256])), sc: track(b.zeros('bf16', [E, 1, 1, 64])) };
      expectThrows('w and qw', () => b.native.moeGemm({ x, w, ...packed, ids, y } as never), /moe_gemm\(x: bf16 \[2, 64\], w: bf16 \[6, 16, 64\], ids: i32 \[2, 2\], y: f32 \[4, 16\]\): w \(bf16 experts as stored\) replaces qw and sc/);
      expectThrows('f32 w', () => b.native.moeGemm({ x, w: track(b.zeros('f32', [E, 16, 64])), ids, y }), /w must be bf16, got f32/);
      expectThrows('w of another K', () => b.native.moeGemm({ x, w: track(b.zeros('bf16', [E, 16, 72])), ids, y }), /w must be \[E, N, K\] = \[6, 16, 64\] \(N from y, K from x\)/);
      expectThrows('w for the epilogue', () => b.native.moeGemm({ x, w, ids, y: track(b.zeros('f32', [4, 16])), epilogue: 'siluMul' }), /w must be \[E, N, K\] = \[6, 32, 64\] \(N from y: 2I gate then up rows for y's I columns, K from x\)/);
      expectThrows('K', () => b.native.moeGemm({ x: track(b.zeros('bf16', [2, 12])), w: track(b.zeros('bf16', [E, 16, 12])), ids, y }), /K = 12 must be a positive multiple of 8/);
      expectThrows('alignment', () => b.native.moeGemm({ x: { ...x, shape: [1, 64], offset: 8 }, w, ids: track(b.zeros('i32', [1, TOPK])), y: track(b.zeros('f32', [2, 16])) }), /x must start 16-byte aligned/);
      expectThrows('minWarpSteps', () => b.native.moeGemm({ x, w, ids, y, minWarpSteps: 4 }), /minWarpSteps applies to packed W4A16 experts/);
      expectThrows('gather rows', () => b.native.moeGemm({ x, w, ids, y: track(b.zeros('f32', [2, 16])) }), /gather mode: y must be \[T\*topk, N\] = \[4, N\]/);
      expectThrows('sum weights', () => b.native.moeGemm({ x: track(b.zeros('bf16', [4, 64])), w, ids, y: track(b.zeros('f32', [2, 16])), mode: 'sum' }), /sum mode needs weights, f32 \[T, topk\] = \[2, 2\]/);
      expectThrows('x dtype', () => b.native.moeGemm({ x: track(b.zeros('f16', [2, 64])), w, ids, y }), /x must be f32 or bf16, got f16/);
      if (b.kind === 'cpu') expectThrows('ids', () => b.native.moeGemm({ x, w, ids: track(b.fromArray('i32', [2, TOPK], Int32Array.of(0, 6, 1, 2))), y }), /ids\[0, 1\] = 6 is not an expert in \[0, 6\)/);
    });
  },
};

export const MOE_BF16_CHECKS: KernelCheck[] = [againstReference('bf16', 'f32'), againstReference('f32', 'f32'), againstReference('bf16', 'bf16'), twinCheck, epilogueCheck, misuse];
