/** W4A16 GEMM and MoE GEMM against @kdtree/quant dequantization + @kdtree/reference matmul. */
import { bf16ArrayToF32, f16ArrayToF32, f32ArrayToBf16, f32ArrayToF16 } from '@kdtree/format';
import { dequantizeInt4, quantizeInt4, type Int4Matrix } from '@kdtree/quant';
import { matmulT } from '@kdtree/reference';
import type { DeviceTensor, Dtype, KdtreeBackend } from '../backend.js';
import { packedW4A16Shapes } from '../w4a16-layout.js';
import { expectThrows, fail, randomF32, sameBits, withForcedForms, withTensors, type KernelCheck } from './harness.js';
import { expectGemmClose, gemmBound } from './tolerance.js';

/** x as the kernel sees it: rounded to bf16/f16 when that is its dtype. */
export function roundX(x: Float32Array, dtype: Dtype): Float32Array {
  if (dtype === 'bf16') return bf16ArrayToF32(f32ArrayToBf16(x));
  if (dtype === 'f16') return f16ArrayToF32(f32ArrayToF16(x));
  return x;
}

export function upload(b: KdtreeBackend, dtype: Dtype, shape: number[], x: Float32Array): DeviceTensor {
  if (dtype === 'bf16') return b.fromArray(dtype, shape, f32ArrayToBf16(x));
  if (dtype === 'f16') return b.fromArray(dtype, shape, f32ArrayToF16(x));
  return b.fromArray('f32', shape, x);
}

/**
 * The reference y [m, n] = x W^T over x rounded to `xDtype` (what the kernel reads), and each
 * element's magnitude sum_k |x_k w_k|, which scales its accumulation error (tolerance.ts).
 */
export function referenceGemm(x: Float32Array, xDtype: Dtype, m: number, k: number, w: Float32Array, n: number): { ref: Float32Array; magnitude: Float32Array } {
  const xr = roundX(x, xDtype);
  return { ref: matmulT(xr, m, k, w, n), magnitude: matmulT(xr.map(Math.abs), m, k, w.map(Math.abs), n) };
}

/** A GEMM's y [m, n] (as f32) against referenceGemm, each element within its bound. */
export function expectGemm(what: string, out: ArrayLike<number>, x: Float32Array, xDtype: Dtype, yDtype: Dtype, m: number, k: number, w: Float32Array, n: number): string {
  const { ref, magnitude } = referenceGemm(x, xDtype, m, k, w, n);
  return expectGemmClose(what, out, ref, magnitude, n, gemmBound(xDtype, yDtype, k));
}

export function asF32(dtype: Dtype, data: ArrayLike<number>): Float32Array {
  if (dtype === 'bf16') return bf16ArrayToF32(data as Uint16Array);
  if (dtype === 'f16') return f16ArrayToF32(data as Uint16Array);
  return data as Float32Array;
}

export function int4(n: number, k: number, group: number, scaleDtype: 'BF16' | 'F32', seed: number): Int4Matrix {
  return quantizeInt4(randomF32(n * k, seed, 0.05), n, k, { groupSize: group, scaleDtype });
}

/** Checkpoint-layout tensors of `m` (rows split into `experts` equal matrices when > 1). */
export function uploadCheckpoint(b: KdtreeBackend, m: Int4Matrix, experts = 1): { qw: DeviceTensor; sc: DeviceTensor } {
  const shapeQ = experts === 1 ? [m.rows, m.cols / 8] : [experts, m.rows / experts, m.cols / 8];
  const shapeS = experts === 1 ? [m.rows, m.cols / m.groupSize] : [experts, m.rows / experts, m.cols / m.groupSize];
  return { qw: b.fromArray('i32', shapeQ, m.packed), sc: b.fromArray(m.scaleDtype === 'BF16' ? 'bf16' : 'f32', shapeS, m.scales) };
}

/** `m` uploaded and packed into the layout the GEMM kernels read. */
export function uploadInt4(b: KdtreeBackend, m: Int4Matrix, experts = 1): { qw: DeviceTensor; sc: DeviceTensor } {
  const checkpoint = uploadCheckpoint(b, m, experts);
  try {
    return b.packW4A16(checkpoint.qw, checkpoint.sc, m.groupSize);
  } finally {
    b.free(checkpoint.qw, checkpoint.sc);
  }
}

/** uploadInt4 inside withTensors: both packed tensors freed with the others. */
export function trackedInt4(b: KdtreeBackend, track: <U extends DeviceTensor>(t: U) => U, m: Int4Matrix, experts = 1): { qw: DeviceTensor; sc: DeviceTensor } {
  const { qw, sc } = uploadInt4(b, m, experts);
  return { qw: track(qw), sc: track(sc) };
}

/**
 * The packed layout written out from its definition (w4a16_layout.h), independently of the native
 * code: word (h, lane, b) of (tile, step) holds row 16 tile + lane/4 + 8h, k = 128 step + 32 b +
 * off(p) in nibble p, off(p) = 8 (lane%4) + 4 (p&3 >> 1) + 2 (p&1) + (p >> 2); scale slot (r, h, q)
 * of (tile, block) holds row 16 tile + r + 8 h, group 4 block + q. Padding: code 8, scale 0.
 */
export function packReference(m: Int4Matrix): { qw: Int32Array; sc: Uint16Array | Float32Array } {
  const { rows: n, cols: k, groupSize: group } = m;
  const tiles = Math.ceil(n / 16);
  const steps = Math.ceil(k / 128);
  const blocks = Math.ceil((steps * (128 / group)) / 4);
  const code = (r: number, c: number) => (r < n && c < k ? (m.packed[r * (k / 8) + (c >> 3)] >>> (4 * (c & 7))) & 15 : 8);
  const qw = new Int32Array(tiles * steps * 256);
  for (let tile = 0; tile < tiles; tile++) {
    for (let step = 0; step < steps; step++) {
      for (let h = 0; h < 2; h++) {
        for (let lane = 0; lane < 32; lane++) {
          for (let b = 0; b < 4; b++) {
            let v = 0;
            for (let p = 0; p < 8; p++) {
              const off = 8 * (lane % 4) + 4 * ((p & 3) >> 1) + 2 * (p & 1) + (p >> 2);
              v |= code(tile * 16 + (lane >> 2) + 8 * h, step * 128 + 32 * b + off) << (4 * p);
            }
            qw[(tile * steps + step) * 256 + (h * 32 + lane) * 4 + b] = v;
          }
        }
      }
    }
  }
  const groups = k / group;
  const sc = m.scaleDtype === 'BF16' ? new Uint16Array(tiles * blocks * 64) : new Float32Array(tiles * blocks * 64);
  for (let tile = 0; tile < tiles; tile++) {
    for (let blk = 0; blk < blocks; blk++) {
      for (let pair = 0; pair < 8; pair++) {
        for (let h = 0; h < 2; h++) {
          for (let q = 0; q < 4; q++) {
            const r = tile * 16 + pair + 8 * h;
            const g = 4 * blk + q;
            sc[(tile * blocks + blk) * 64 + pair * 8 + h * 4 + q] = r < n && g < groups ? m.scales[r * groups + g] : 0;
          }
        }
      }
    }
  }
  return { qw, sc };
}

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
      const details: string[] = [];
      for (const [si, { n, k, group }] of SHAPES.entries()) {
        const w = int4(n, k, group, scaleDtype, 10 + si);
        const wf = dequantizeInt4(w);
        withTensors(b, (track) => {
          const { qw, sc } = trackedInt4(b, track, w);
          for (const m of MS) {
            const x = randomF32(m * k, 100 + m + si);
            const xd = track(upload(b, xDtype, [m, k], x));
            const y = track(b.empty(yDtype, [m, n]));
            b.native.w4a16Gemm({ x: xd, qw, sc, y, group });
            details.push(expectGemm(`M=${m} N=${n} K=${k} G=${group}`, asF32(yDtype, b.toArray(y)), x, xDtype, yDtype, m, k, wf, n));
          }
        });
      }
      return { detail: details.join('; ') };
    },
  };
}

/**
 * Batch invariance: each of `rows` of an M-row W4A16 result `all` ([M, n] f32, from x [M, k]) must
 * equal, bit for bit, that row computed alone (the 1-token kernel).
 */
function expectRowsAlone(
  b: KdtreeBackend,
  track: <U extends { buffer: { freed: boolean } }>(t: U) => U,
  op: { x: Float32Array; xDtype: Dtype; k: number; n: number; qw: DeviceTensor; sc: DeviceTensor; group: number },
  all: Float32Array,
  rows: number[],
  what: string,
): void {
  const { x, xDtype, k, n, qw, sc, group } = op;
  for (const r of rows) {
    const y1 = track(b.empty('f32', [1, n]));
    b.native.w4a16Gemm({ x: track(upload(b, xDtype, [1, k], x.subarray(r * k, (r + 1) * k))), qw, sc, y: y1, group });
    if (!sameBits(b.toArray(y1), all.subarray(r * n, (r + 1) * n))) fail(`${what}: row ${r} differs from the row computed alone`);
  }
}

/**
 * Row m of an M-row call must equal, bit for bit, the same row computed alone. On cuda M = 2 and 4
 * run the even-column form (token u in MMA column 2 u, like the row alone in column 0), M = 5 the
 * 8-token tiles, M = 17 and 118 larger tiles.
 */
function gemmInvarianceCheck(xDtype: Dtype): KernelCheck {
  return {
    name: `w4a16_gemm x ${xDtype}: batch invariance (rows of M=2/4/5/17/118 == the row alone, bit for bit)`,
    run(b) {
      const { n, k, group } = { n: 136, k: 256, group: 32 };
      const w = int4(n, k, group, 'BF16', 77);
      withTensors(b, (track) => {
        const { qw, sc } = trackedInt4(b, track, w);
        for (const m of [2, 4, 5, 17, 118]) {
          const x = randomF32(m * k, 300 + m);
          const xd = track(upload(b, xDtype, [m, k], x));
          const y = track(b.empty('f32', [m, n]));
          b.native.w4a16Gemm({ x: xd, qw, sc, y, group });
          const rows = [...new Set([0, 1, 5, m - 1])].filter((r) => r < m);
          expectRowsAlone(b, track, { x, xDtype, k, n, qw, sc, group }, b.toArray(y) as Float32Array, rows, `M=${m}`);
        }
      });
    },
  };
}

/** k = 96: 16-bit x is staged (a K tail); k = 128: read in place, through row slots past one row per expert. */
function moeCheck(xDtype: Dtype, k: number): KernelCheck {
  return {
    name: `moe_gemm x ${xDtype}, K ${k}: gather and weighted-sum modes, 6 experts, top-2, T 1/5/13/21/30 (an expert with 13-30 rows: several token tiles; up to 32 pairs routed inside the GEMM on cuda, more by the sort kernel; at T 30 tiles of 16 rows, x read in place for bf16 with K 128) vs reference; a token's rows == the token alone`,
    run(b) {
      const E = 6;
      const n = 64;
      const topk = 2;
      const w = int4(E * n, k, 32, 'BF16', 55);
      const wf = dequantizeInt4(w);
      return withTensors(b, (track) => {
        const { qw, sc } = trackedInt4(b, track, w, E);
        let detail = '';
        for (const T of [1, 5, 13, 21, 30]) {
          // T >= 13: every token routes to expert 0 first, so it has more rows than a token tile
          const ids = Int32Array.from({ length: T * topk }, (_, i) => (T >= 13 ? (i % topk === 0 ? 0 : 1 + (Math.floor(i / topk) % (E - 1))) : (i * 5 + Math.floor(i / topk)) % E));
          for (let t = 0; t < T; t++) if (ids[t * topk] === ids[t * topk + 1]) ids[t * topk + 1] = (ids[t * topk + 1] + 1) % E;
          const weights = Float32Array.from({ length: T * topk }, (_, i) => 0.3 + 0.1 * i);
          const x = randomF32(T * k, 900 + T);
          const expert = (e: number, row: Float32Array) => referenceGemm(row, xDtype, 1, k, wf.subarray(e * n * k, (e + 1) * n * k), n);
          const bound = gemmBound(xDtype, 'f32', k);
          // gather: y[t * topk + j] = x[t] . W[ids[t, j]]^T
          const yg = track(b.empty('f32', [T * topk, n]));
          const idsD = track(b.fromArray('i32', [T, topk], ids));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T, k], x)), qw, sc, ids: idsD, y: yg, mode: 'gather' });
          const refG = new Float32Array(T * topk * n);
          const magG = new Float32Array(T * topk * n);
          for (let p = 0; p < T * topk; p++) {
            const t = Math.floor(p / topk);
            const { ref, magnitude } = expert(ids[p], x.subarray(t * k, (t + 1) * k));
            refG.set(ref, p * n);
            magG.set(magnitude, p * n);
          }
          const gathered = b.toArray(yg) as Float32Array;
          detail = expectGemmClose(`gather T=${T}`, gathered, refG, magG, n, bound);
          if (T >= 13) {
            // token 11 alone: its two rows, bit for bit (rows do not depend on the tiles around them,
            // nor on whether the kernel or the sort routed them)
            const one = track(b.empty('f32', [topk, n]));
            b.native.moeGemm({ x: track(upload(b, xDtype, [1, k], x.subarray(11 * k, 12 * k))), qw, sc, ids: track(b.fromArray('i32', [1, topk], ids.subarray(11 * topk, 12 * topk))), y: one, mode: 'gather' });
            if (!sameBits(b.toArray(one), gathered.subarray(11 * topk * n, 12 * topk * n))) fail(`token 11 alone differs from its rows in the ${T}-token call`);
          }
          // sum: y[t] = sum_j w[t, j] * (x[t * topk + j] . W[ids[t, j]]^T); each weighted term keeps
          // its accumulation bound, and weighting and summing round once per term (|w y| u32, inside
          // the accumulation bound's margin when added to the magnitude)
          const xp = randomF32(T * topk * k, 950 + T);
          const ys = track(b.empty('f32', [T, n]));
          b.native.moeGemm({ x: track(upload(b, xDtype, [T * topk, k], xp)), qw, sc, ids: idsD, weights: track(b.fromArray('f32', [T, topk], weights)), y: ys, mode: 'sum' });
          const refS = new Float32Array(T * n);
          const magS = new Float32Array(T * n);
          for (let t = 0; t < T; t++) {
            for (let j = 0; j < topk; j++) {
              const p = t * topk + j;
              const { ref, magnitude } = expert(ids[p], xp.subarray(p * k, (p + 1) * k));
              for (let i = 0; i < n; i++) {
                refS[t * n + i] += weights[p] * ref[i];
                magS[t * n + i] += weights[p] * (magnitude[i] + Math.abs(ref[i]));
              }
            }
          }
          detail += `; ${expectGemmClose(`sum T=${T}`, b.toArray(ys) as Float32Array, refS, magS, n, bound)}`;
        }
        {
          // one token routed twice to one expert: on cuda each pair is a one-row tile of its own
          const x = randomF32(k, 990);
          const yd = track(b.empty('f32', [topk, n]));
          b.native.moeGemm({ x: track(upload(b, xDtype, [1, k], x)), qw, sc, ids: track(b.fromArray('i32', [1, topk], new Int32Array(topk).fill(3))), y: yd, mode: 'gather' });
          const rows = b.toArray(yd) as Float32Array;
          detail += `; ${expectGemm('gather T=1, one expert twice (row 0)', rows.subarray(0, n), x, xDtype, 'f32', 1, k, wf.subarray(3 * n * k, 4 * n * k), n)}`;
          if (!sameBits(rows.subarray(0, n), rows.subarray(n, 2 * n))) fail('the two rows of one token and one expert differ');
        }
        return { detail };
      });
    },
  };
}

/**
 * moe_gemm in gather mode, bf16 x, over E experts of N x K with the given routing: every row vs the
 * reference, and the rows of token `alone` == that token in a call of its own, bit for bit.
 */
function moeGatherCheck(name: string, o: { E: number; n: number; k: number; T: number; topk: number; seed: number; expertOf: (t: number, j: number) => number; alone: number; minWarpSteps?: number }): KernelCheck {
  return {
    name,
    run(b) {
      const { E, n, k, T, topk, alone } = o;
      const w = int4(E * n, k, 32, 'BF16', o.seed);
      const wf = dequantizeInt4(w);
      return withTensors(b, (track) => {
        const { qw, sc } = trackedInt4(b, track, w, E);
        const ids = Int32Array.from({ length: T * topk }, (_, i) => o.expertOf(Math.floor(i / topk), i % topk));
        const x = randomF32(T * k, o.seed * 10);
        const gather = (tokens: number, first: number) => {
          const y = track(b.empty('f32', [tokens * topk, n]));
          const xs = track(upload(b, 'bf16', [tokens, k], x.subarray(first * k, (first + tokens) * k)));
          const idsD = track(b.fromArray('i32', [tokens, topk], ids.subarray(first * topk, (first + tokens) * topk)));
          b.native.moeGemm({ x: xs, qw, sc, ids: idsD, y, mode: 'gather', minWarpSteps: o.minWarpSteps });
          return b.toArray(y) as Float32Array;
        };
        const rows = gather(T, 0);
        const ref = new Float32Array(T * topk * n);
        const mag = new Float32Array(T * topk * n);
        for (let p = 0; p < T * topk; p++) {
          const t = Math.floor(p / topk);
          const one = referenceGemm(x.subarray(t * k, (t + 1) * k), 'bf16', 1, k, wf.subarray(ids[p] * n * k, (ids[p] + 1) * n * k), n);
          ref.set(one.ref, p * n);
          mag.set(one.magnitude, p * n);
        }
        const detail = expectGemmClose(`gather T=${T}`, rows, ref, mag, n, gemmBound('bf16', 'f32', k));
        if (!sameBits(gather(1, alone), rows.subarray(alone * topk * n, (alone + 1) * topk * n))) fail(`token ${alone} alone differs from its rows in the ${T}-token call`);
        return { detail };
      });
    },
  };
}

/**
 * Enough token tiles for several launches: 400 (token, expert) pairs over 40 experts, 10 rows
 * each, in 16-row tiles with x staged (K = 96): 65 tile slots (40 used), launched 16 at a time on
 * cuda. Token 199's experts, 33 and 38, have tiles 33 and 38 (tiles are in expert order): the
 * third launch.
 */
const moeManyTilesCheck = () =>
  moeGatherCheck('moe_gemm x bf16, K 96: 200 tokens, top-2 over 40 experts (65 token tile slots, launched in chunks) vs reference; the rows of a token in the third chunk == the token alone', {
    E: 40,
    n: 32,
    k: 96,
    T: 200,
    topk: 2,
    seed: 57,
    expertOf: (t, j) => (7 * t + 5 * j) % 40,
    alone: 199,
  });

/**
 * Longer warp ranges (minWarpSteps 16: 2 blocks per expert instead of 64 on cuda): a 13-token
 * call and its token 11 alone agree bit for bit when both ask for them, and match the reference.
 */
const moeLongRangesCheck = () =>
  moeGatherCheck("moe_gemm x bf16, N 1024 x K 512, 6 experts, top-2, minWarpSteps 16: T 1 and 13 vs reference; a token's rows == the token alone", {
    E: 6,
    n: 1024,
    k: 512,
    T: 13,
    topk: 2,
    seed: 58,
    expertOf: (t, j) => (t + 3 * j) % 6,
    alone: 11,
    minWarpSteps: 16,
  });

/**
 * A verify-like step with short warp ranges: 60 (token, expert) pairs over 12 experts of 272 x 1280
 * (17 tiles of 10 steps) in 8-row tiles with x read in place. On cuda the split gives each warp 2
 * steps (16-step blocks, so tiles cross block boundaries and ranges cross tiles), and each warp of
 * the launch streams 4 of those ranges back to back (PiecesPerWarp); token 29 alone takes the
 * one-token decode path with one range per warp, and its rows must agree bit for bit.
 */
const moePiecesCheck = () =>
  moeGatherCheck('moe_gemm x bf16, N 272 x K 1280, 12 experts, top-2: 30 tokens (short ranges, 4 per warp on cuda) vs reference; a token\'s rows == the token alone', {
    E: 12,
    n: 272,
    k: 1280,
    T: 30,
    topk: 2,
    seed: 59,
    expertOf: (t, j) => (5 * t + 7 * j) % 12,
    alone: 29,
  });

/**
 * A verify-like step with at most 2 rows expected per expert: 80 (token, expert) pairs over 48
 * experts of 272 x 1280. On cuda the sort cuts tiles of up to 4 rows, run in the even-column form
 * (token u of a tile in MMA column 2 u) with short ranges streamed 4 per warp; expert 47 gets 6
 * rows, so two tiles (4 + 2). Token 5 (one of expert 47's rows) alone takes the decode path, and
 * its rows must agree bit for bit.
 */
const moeEvenColumnsCheck = () =>
  moeGatherCheck("moe_gemm x bf16, N 272 x K 1280, 48 experts, top-2: 40 tokens (tiles of up to 4 rows on cuda, an expert with 6) vs reference; a token's rows == the token alone", {
    E: 48,
    n: 272,
    k: 1280,
    T: 40,
    topk: 2,
    seed: 60,
    expertOf: (t, j) => (j === 0 ? t % 20 : t < 6 ? 47 : 20 + ((3 * t) % 27)),
    alone: 5,
  });

/** The same tiles routed inside the GEMM (<= 32 pairs, a decode batch): an expert of 6 rows takes two. */
const moeRoutedEvenColumnsCheck = () =>
  moeGatherCheck("moe_gemm x bf16, N 272 x K 1280, 16 experts, top-2: 15 tokens routed in the GEMM (tiles of up to 4 rows on cuda, an expert with 6) vs reference; a token's rows == the token alone", {
    E: 16,
    n: 272,
    k: 1280,
    T: 15,
    topk: 2,
    seed: 61,
    expertOf: (t, j) => (j === 0 ? (t < 6 ? 15 : t % 15) : (t + 7) % 15),
    alone: 4,
  });

function packCheck(scaleDtype: 'BF16' | 'F32'): KernelCheck {
  return {
    name: `w4a16_pack, scales ${scaleDtype.toLowerCase()}: bit-exact with the layout written out in JS (odd N, K tails, groups 32/64/128, experts)`,
    run(b) {
      const cases = [...SHAPES, { n: 17, k: 32, group: 32 }, { n: 16, k: 128, group: 128 }];
      for (const [ci, { n, k, group }] of cases.entries()) {
        const w = int4(n, k, group, scaleDtype, 40 + ci);
        const ref = packReference(w);
        withTensors(b, (track) => {
          const packed = uploadInt4(b, w);
          track(packed.qw);
          track(packed.sc);
          const shapes = packedW4A16Shapes(n, k, group);
          if (packed.qw.shape.join() !== shapes.qw.join() || packed.sc.shape.join() !== shapes.sc.join()) fail(`N=${n} K=${k}: packed shapes ${packed.qw.shape} / ${packed.sc.shape}`);
          if (!sameBits(b.toArray(packed.qw), ref.qw)) fail(`N=${n} K=${k} G=${group}: packed codes differ from the layout definition`);
          if (!sameBits(b.toArray(packed.sc), ref.sc)) fail(`N=${n} K=${k} G=${group}: packed scales differ from the layout definition`);
        });
      }
      // experts: each matrix packed on its own, one after the other
      const E = 3;
      const w = int4(E * 40, 96, 32, scaleDtype, 49);
      withTensors(b, (track) => {
        const packed = uploadInt4(b, w, E);
        track(packed.qw);
        track(packed.sc);
        const qw = b.toArray(packed.qw) as Int32Array;
        const sc = b.toArray(packed.sc);
        for (let e = 0; e < E; e++) {
          const one: Int4Matrix = { ...w, rows: 40, packed: w.packed.subarray(e * 40 * 12, (e + 1) * 40 * 12), scales: w.scales.subarray(e * 40 * 3, (e + 1) * 40 * 3) };
          const ref = packReference(one);
          if (!sameBits(qw.subarray(e * ref.qw.length, (e + 1) * ref.qw.length), ref.qw)) fail(`expert ${e}: packed codes differ`);
          if (!sameBits((sc as Uint16Array).subarray(e * ref.sc.length, (e + 1) * ref.sc.length), ref.sc)) fail(`expert ${e}: packed scales differ`);
        }
      });
      return { detail: `${cases.length} shapes + 3 experts` };
    },
  };
}

/**
 * A shape large enough that the device's stream-K ranges end inside tiles: on cuda, warps of a
 * block share tiles (summed in shared memory) and tiles cross block boundaries (finished by an
 * exchange between the two blocks). N = 14496 (906 tiles), K = 896 (7 steps of 128). Row 5 of the
 * M = 17 call (16-token tiles, x staged) and every row of the M = 3 call (the even-column form,
 * its parks and exchanges in columns 0, 2 and 4) must also equal the row alone bit for bit.
 */
const streamKCheck: KernelCheck = {
  name: 'w4a16_gemm bf16: N 14496 x K 896 at M 1/3/17 vs reference, and batch-invariant (on cuda: ranges that end inside tiles and blocks)',
  run(b) {
    const { n, k, group } = { n: 14496, k: 896, group: 32 };
    const w = int4(n, k, group, 'BF16', 61);
    const wf = dequantizeInt4(w);
    let detail = '';
    withTensors(b, (track) => {
      const { qw, sc } = trackedInt4(b, track, w);
      for (const m of [1, 3, 17]) {
        const x = randomF32(m * k, 500 + m);
        const y = track(b.empty('f32', [m, n]));
        b.native.w4a16Gemm({ x: track(upload(b, 'bf16', [m, k], x)), qw, sc, y, group });
        const all = b.toArray(y) as Float32Array;
        detail = expectGemm(`M=${m}`, all, x, 'bf16', 'f32', m, k, wf, n);
        if (m > 1) expectRowsAlone(b, track, { x, xDtype: 'bf16', k, n, qw, sc, group }, all, m === 17 ? [5] : [0, 1, 2], `M=${m}`);
      }
    });
    return { detail };
  },
};

interface Bf16Case {
  n: number;
  k: number;
  group: number;
  scales: 'BF16' | 'F32';
  ms: readonly number[];
}

/**
 * bf16 GEMMs of each case at each M vs the reference; rows 0, 5 and M - 1 must equal the row alone
 * bit for bit. `forced` wraps the M-row calls (a kernel forced by an environment variable, which
 * the rows alone, one token each, cannot take).
 */
function bf16CasesAgainstReference(b: KdtreeBackend, cases: readonly Bf16Case[], seed: number, forced: <T>(call: () => T) => T = (call) => call()): string {
  let detail = '';
  for (const { n, k, group, scales, ms } of cases) {
    const w = int4(n, k, group, scales, seed + group);
    const wf = dequantizeInt4(w);
    withTensors(b, (track) => {
      const { qw, sc } = trackedInt4(b, track, w);
      for (const m of ms) {
        const x = randomF32(m * k, 10 * seed + m + group);
        const y = track(b.empty('f32', [m, n]));
        const xd = track(upload(b, 'bf16', [m, k], x));
        forced(() => b.native.w4a16Gemm({ x: xd, qw, sc, y, group }));
        const all = b.toArray(y) as Float32Array;
        detail += `${detail ? '; ' : ''}N=${n} G=${group} ${expectGemm(`M=${m}`, all, x, 'bf16', 'f32', m, k, wf, n)}`;
        expectRowsAlone(b, track, { x, xDtype: 'bf16', k, n, qw, sc, group }, all, [0, 5, m - 1], `N=${n} G=${group} M=${m}`);
      }
    });
  }
  return detail;
}

/**
 * Two token groups (9-16 rows) of bf16 x on matrices of up to 8192 x 8192 with K whole steps: on
 * cuda the stream-K kernel reads the x rows in place (no staging launch). N = 4000 (250 tiles),
 * K = 1024 (8 steps) with group 32 and bf16 scales, N = 2000 x K 768 with group 128 and f32 scales.
 */
const inPlace16Check: KernelCheck = {
  name: 'w4a16_gemm bf16: N 4000 x K 1024 at M 9/16 (group 32, bf16 scales) and N 2000 x K 768 at M 12 (group 128, f32) vs reference and batch-invariant (on cuda: 16-token tiles with x read in place)',
  run: (b) => ({
    detail: bf16CasesAgainstReference(
      b,
      [
        { n: 4000, k: 1024, group: 32, scales: 'BF16', ms: [9, 16] },
        { n: 2000, k: 768, group: 128, scales: 'F32', ms: [12] },
      ],
      81,
    ),
  }),
};

/**
 * bf16 x on shapes that take the warpgroup kernel (w4a16_wgmma.cu) on an sm_90a device with up to
 * 132 SMs: >= 1.5 warpgroups (4 tiles x one 32-token tile each) per SM in a launch. N = 17000 is 1063
 * tiles, so the last warpgroup has 3; K = 640 is 5 steps, so the stream-K ranges it replays cut
 * tiles inside and across blocks; M = 17 and 40 take it (40: two token tiles, the second partial),
 * M = 9 and 16 the stream-K kernel's 16-token tiles. N = 4608 at M = 100 (72 warpgroups x 4 token
 * tiles, the last partial) takes it only because of its tokens; its K = 448 ends inside a step
 * (staged x zero past K). These launches have more than 2 warpgroups per SM (the kernel's form with
 * one A register set); N = 3200 at M = 140 (50 x 5 token tiles, the last partial; groups 32 and
 * 128) has fewer (the form that dequantizes a step ahead). Each group size is its own kernel
 * instance: 32 (bf16 scales), 64 (bf16) and 128 (f32).
 */
const wgmmaCheck: KernelCheck = {
  name: 'w4a16_gemm bf16: N 17000 x K 640 at M 9/16/17/40 (groups 32, bf16 scales, and 128, f32), N 4608 x K 448 at M 100 (group 64, a K tail) and N 3200 x K 640 at M 140 (groups 32 and 128), vs reference and batch-invariant (on sm_90a: the warpgroup kernel from 17 tokens, both of its forms)',
  run: (b) => ({
    detail: bf16CasesAgainstReference(
      b,
      [
        { n: 17000, k: 640, group: 32, scales: 'BF16', ms: [9, 16, 17, 40] },
        { n: 17000, k: 640, group: 128, scales: 'F32', ms: [9, 16, 17, 40] },
        { n: 4608, k: 448, group: 64, scales: 'BF16', ms: [100] },
        { n: 3200, k: 640, group: 32, scales: 'BF16', ms: [140] },
        { n: 3200, k: 640, group: 128, scales: 'F32', ms: [140] },
      ],
      71,
    ),
  }),
};

/**
 * bf16 x of prefill size, which on an sm_90a device takes the prefill kernel (w4a16_prefill.cu:
 * 128-token tiles, groups 32 and 64). N = 2000 (125 tiles: the last block of 4 tiles has 1) at
 * M = 260 (three token tiles, the last with 4 rows, so its second consumer stores nothing) and at
 * M = 100 (one partly filled tile: the rule takes the kernel for 97-128 tokens in one wave), group
 * 32 with bf16 scales; N = 1000 (63 tiles, the last with 8 rows) x K 448 (a K tail inside a step)
 * at M = 300, group 64 with f32 scales (a 3-stage ring); N = 520 x K 1152 at M = 257 (one row
 * past two token tiles), group 64 with bf16 scales (a 4-stage ring, like group 32); forced with
 * KDTREE_W4A16_PREFILL=always. Rows 0, 5 and M - 1 equal the row alone (the stream-K kernel's bits).
 */
const prefillCheck: KernelCheck = {
  name: 'w4a16_gemm bf16: N 2000 x K 640 at M 100 and 260 (group 32, bf16 scales), N 1000 x K 448 at M 300 (group 64, f32) and N 520 x K 1152 at M 257 (group 64, bf16) vs reference and batch-invariant (on sm_90a: the prefill kernel, forced)',
  // shapes this small take it only when forced (the rule wants >= 3/4 of a block per SM); a forced
  // call the kernel cannot run throws, so passing means these calls ran on it
  run: (b) => ({
    detail: bf16CasesAgainstReference(
      b,
      [
        { n: 2000, k: 640, group: 32, scales: 'BF16', ms: [100, 260] },
        { n: 1000, k: 448, group: 64, scales: 'F32', ms: [300] },
        { n: 520, k: 1152, group: 64, scales: 'BF16', ms: [257] },
      ],
      73,
      (call) => withForcedForms(b, { w4a16Prefill: 'always' }, call),
    ),
  }),
};

const shapeErrors: KernelCheck = {
  name: 'w4a16_pack, w4a16_gemm and moe_gemm reject bad shapes, dtypes, layouts and groups with every shape in the message',
  run(b) {
    withTensors(b, (track) => {
      const x = track(b.zeros('bf16', [3, 64]));
      const qw = track(b.zeros('i32', [1, 1, 256]));
      const sc = track(b.zeros('bf16', [1, 1, 64]));
      const y = track(b.zeros('f32', [3, 16]));
      b.native.w4a16Gemm({ x, qw, sc, y, group: 32 });
      expectThrows('K mismatch', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [3, 192])), qw, sc, y, group: 32 }), /x: bf16 \[3, 192\].*qw: i32 \[1, 1, 256\].*qw must be the packed layout \[N\/16, K\/128, 256\] = \[1, 2, 256\] for N = 16, K = 192/);
      expectThrows('N mismatch', () => b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('f32', [3, 40])), group: 32 }), /qw must be the packed layout .* = \[3, 1, 256\] for N = 40/);
      expectThrows('checkpoint layout', () => b.native.w4a16Gemm({ x, qw: track(b.zeros('i32', [16, 8])), sc, y, group: 32 }), /qw is in the checkpoint layout \[16, 8\]: pack it first \(w4a16Pack, or KdtreeBackend\.packW4A16\)/);
      expectThrows('group', () => b.native.w4a16Gemm({ x, qw, sc, y, group: 48 }), /group size 48 is not 32, 64 or 128/);
      expectThrows('scales', () => b.native.w4a16Gemm({ x, qw, sc: track(b.zeros('bf16', [1, 2, 64])), y, group: 32 }), /sc must be the packed layout \[N\/16, K\/\(4G\), 64\] = \[1, 1, 64\]/);
      expectThrows('y rows', () => b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('f32', [2, 16])), group: 32 }), /y must be \[M, N\] with M = 3/);
      expectThrows('dtype', () => b.native.w4a16Gemm({ x: track(b.zeros('i32', [3, 64])), qw, sc, y, group: 32 }), /x must be f32 or bf16 or f16, got i32/);
      expectThrows('buffer too small', () => b.native.w4a16Gemm({ x: { ...x, shape: [300, 64] }, qw, sc, y, group: 32 }), /x needs 38400 bytes but its buffer holds 384/);
      expectThrows('rank', () => b.native.w4a16Gemm({ x: { ...x, shape: [192] }, qw, sc, y, group: 32 }), /x must have 2 dimensions, got 1/);
      expectThrows('not a tensor', () => b.native.w4a16Gemm({ x: { buffer: {} as never, dtype: 'bf16', shape: [3, 64] }, qw, sc, y, group: 32 }), /x\.buffer must be a DeviceBuffer/);
      expectThrows('missing', () => b.native.w4a16Gemm({ x, qw, sc } as never), /y is required/);
      // pack
      const cq = track(b.zeros('i32', [16, 8]));
      const cs = track(b.zeros('bf16', [16, 2]));
      b.native.w4a16Pack({ qw: cq, sc: cs, qwPacked: qw, scPacked: sc, group: 32 });
      expectThrows('pack output shape', () => b.native.w4a16Pack({ qw: cq, sc: cs, qwPacked: track(b.zeros('i32', [1, 2, 256])), scPacked: sc, group: 32 }), /qwPacked must be the packed layout \[N\/16, K\/128, 256\] = \[1, 1, 256\] for N = 16, K = 64/);
      expectThrows('pack scale dtype', () => b.native.w4a16Pack({ qw: cq, sc: cs, qwPacked: qw, scPacked: track(b.zeros('f32', [1, 1, 64])), group: 32 }), /scPacked must be bf16, got f32/);
      expectThrows('pack scales', () => b.native.w4a16Pack({ qw: cq, sc: track(b.zeros('bf16', [16, 4])), qwPacked: qw, scPacked: sc, group: 32 }), /sc must be \[16, 2\] \(N, K\/G\)/);
      expectThrows('pack rank', () => b.native.w4a16Pack({ qw: track(b.zeros('i32', [128])), sc: cs, qwPacked: qw, scPacked: sc, group: 32 }), /qw must be \[N, K\/8\] or \[E, N, K\/8\], got 1 dimensions/);
      // MoE
      const ids = track(b.zeros('i32', [3, 2]));
      const eqw = track(b.zeros('i32', [4, 1, 1, 256]));
      const esc = track(b.zeros('bf16', [4, 1, 1, 64]));
      expectThrows('moe gather y', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y, mode: 'gather' }), /gather mode: y must be \[T\*topk, N\] = \[6, N\]/);
      expectThrows('moe experts', () => b.native.moeGemm({ x, qw: eqw, sc: track(b.zeros('bf16', [3, 1, 1, 64])), ids, y: track(b.zeros('f32', [6, 16])), mode: 'gather' }), /sc must be the packed layout \[E, N\/16, K\/\(4G\), 64\] = \[4, 1, 1, 64\]/);
      expectThrows('moe minWarpSteps < 0', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y: track(b.zeros('f32', [6, 16])), mode: 'gather', minWarpSteps: -1 }), /minWarpSteps must be an integer >= 0, got -1/);
      expectThrows('moe minWarpSteps too large', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y: track(b.zeros('f32', [6, 16])), mode: 'gather', minWarpSteps: 2 ** 21 }), /minWarpSteps must be in \[0, 1048576\], got 2097152/);
      expectThrows('moe mode', () => b.native.moeGemm({ x, qw: eqw, sc: esc, ids, y, mode: 'scatter' as never }), /mode must be 'gather' or 'sum'/);
      expectThrows('moe weights', () => b.native.moeGemm({ x: track(b.zeros('bf16', [6, 64])), qw: eqw, sc: esc, ids, y, mode: 'sum' }), /weights/);
    });
  },
};

const packedRecord: KernelCheck = {
  name: 'w4a16_gemm and moe_gemm hold x, y, the group and the epilogue to what w4a16Pack packed (a K 256 weight refuses an x of K 224, whose packed shapes are the same), naming every shape',
  run(b) {
    withTensors(b, (track) => {
      /** `experts` random matrices of n x k packed by packW4A16, every tensor tracked. */
      const pack = (n: number, k: number, group: number, seed: number, experts = 1) => {
        const cp = uploadCheckpoint(b, int4(n * experts, k, group, 'BF16', seed), experts);
        track(cp.qw);
        track(cp.sc);
        const p = b.packW4A16(cp.qw, cp.sc, group);
        track(p.qw);
        track(p.sc);
        return p;
      };
      // N 32 x K 256, G 32: K 224 and N 24 pack to the same shapes (2 steps of 128 k, 2 scale blocks, 2 tiles)
      const packed = pack(32, 256, 32, 11);
      const { qw, sc } = packed;
      if (packed.n !== 32 || packed.k !== 256 || packed.group !== 32 || packed.experts !== undefined || packed.interleaveGateUp) fail(`packW4A16 returned n ${packed.n}, k ${packed.k}, group ${packed.group}, experts ${packed.experts}`);
      const y = track(b.zeros('f32', [2, 32]));
      b.native.w4a16Gemm({ x: track(b.zeros('bf16', [2, 256])), qw, sc, y, group: 32 });
      const x224 = track(b.zeros('bf16', [2, 224]));
      expectThrows('x of another K', () => b.native.w4a16Gemm({ x: x224, qw, sc, y, group: 32 }), /w4a16_gemm\(x: bf16 \[2, 224\], qw: i32 \[2, 2, 256\], sc: bf16 \[2, 2, 64\], y: f32 \[2, 32\]\): qw was packed by w4a16Pack for N = 32, K = 256, G = 32, but x has K = 224/);
      expectThrows('y of another N', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [2, 256])), qw, sc, y: track(b.zeros('f32', [2, 24])), group: 32 }), /y: f32 \[2, 24\]\): qw was packed by w4a16Pack for N = 32, K = 256, G = 32, but y has N = 24/);
      expectThrows('siluMul on plain rows', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [2, 256])), qw, sc, y: track(b.zeros('f32', [2, 16])), group: 32, epilogue: 'siluMul' }), /qw was packed by w4a16Pack for N = 32, K = 256, G = 32 without interleaveGateUp: the siluMul epilogue needs gate_up rows/);
      // sc of another pack (K 224), with the right qw
      const other = pack(32, 224, 32, 12);
      expectThrows('sc of another pack', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [2, 256])), qw, sc: other.sc, y, group: 32 }), /sc was packed by w4a16Pack for N = 32, K = 224, G = 32, but x has K = 256/);
      // K 128: groups 32, 64 and 128 all pack to one scale block
      const g32 = pack(16, 128, 32, 13);
      expectThrows('another group', () => b.native.w4a16Gemm({ x: track(b.zeros('bf16', [1, 128])), qw: g32.qw, sc: g32.sc, y: track(b.zeros('f32', [1, 16])), group: 64 }), /qw was packed by w4a16Pack for N = 16, K = 128, G = 32, but the call says group 64/);
      // experts
      const experts = pack(32, 256, 32, 14, 3);
      if (experts.experts !== 3 || experts.n !== 32) fail(`packW4A16 of experts returned experts ${experts.experts}, n ${experts.n}`);
      const ids = track(b.zeros('i32', [2, 2]));
      b.native.moeGemm({ x: track(b.zeros('bf16', [2, 256])), qw: experts.qw, sc: experts.sc, ids, y: track(b.zeros('f32', [4, 32])), mode: 'gather' });
      expectThrows('moe x of another K', () => b.native.moeGemm({ x: x224, qw: experts.qw, sc: experts.sc, ids, y: track(b.zeros('f32', [4, 32])), mode: 'gather' }), /moe_gemm\(x: bf16 \[2, 224\], qw: i32 \[3, 2, 2, 256\].*\): qw was packed by w4a16Pack for N = 32, K = 256, G = 32, E = 3, but x has K = 224/);
      expectThrows('moe y of another N', () => b.native.moeGemm({ x: track(b.zeros('bf16', [4, 256])), qw: experts.qw, sc: experts.sc, ids, weights: track(b.zeros('f32', [2, 2])), y: track(b.zeros('f32', [2, 24])), mode: 'sum' }), /E = 3, but y has N = 24/);
      // what upload writes is not what w4a16Pack recorded: the record goes, and shapes alone are checked
      b.native.upload(qw.buffer, b.toArray(qw));
      b.native.upload(sc.buffer, b.toArray(sc));
      b.native.w4a16Gemm({ x: x224, qw, sc, y, group: 32 });
    });
    return { detail: 'every mismatch refused naming the packed shapes' };
  },
};

/**
 * setForcedForms (and KDTREE_GEMM_FORM / KDTREE_W4A16_PREFILL, read when a backend is created)
 * force a cuda kernel form; one that cannot run a call must throw rather than fall back, or a
 * check named for a form could pass on another, and lastForm() names the form a call ran. Unknown
 * values throw on every backend; the cpu twin has one form per op and reports 'cpu'.
 */
const forcedFormErrors: KernelCheck = {
  name: 'forced kernel forms that cannot run a call throw, naming the call (cuda); unknown values throw; lastForm() names the form that ran',
  run(b) {
    expectThrows('prefill value', () => b.native.setForcedForms({ w4a16Prefill: 'sometimes' as never }), /KDTREE_W4A16_PREFILL must be always or never, got 'sometimes'/);
    expectThrows('form value', () => b.native.setForcedForms({ gemm: 'fast' as never }), /KDTREE_GEMM_FORM must be split, rows, tiled, tiled-split or wgmma, got 'fast'/);
    withTensors(b, (track) => {
      const w = int4(64, 256, 32, 'BF16', 62);
      const { qw, sc } = trackedInt4(b, track, w);
      const x = (m: number) => track(upload(b, 'bf16', [m, 256], randomF32(m * 256, 63)));
      const gemm = (m: number, group = 32) => b.native.w4a16Gemm({ x: x(m), qw, sc, y: track(b.empty('f32', [m, 64])), group });
      const wf = track(b.fromArray('bf16', [64, 256], f32ArrayToBf16(randomF32(64 * 256, 65))));
      const dense = (m: number) => b.native.gemm({ x: x(m), w: wf, y: track(b.empty('f32', [m, 64])) });
      const expectForm = (what: string, form: string) => {
        const ran = b.native.lastForm();
        if (ran !== (b.kind === 'cuda' ? form : 'cpu')) fail(`${what}: lastForm() is ${ran}, expected ${b.kind === 'cuda' ? form : 'cpu'}`);
      };
      gemm(1);
      expectForm('w4a16Gemm, one token', 'one-token');
      dense(3);
      expectForm('gemm, 3 tokens', 'split');
      withForcedForms(b, { w4a16Prefill: 'never' }, () => gemm(40));
      if (b.kind !== 'cuda') return;
      withForcedForms(
        b,
        { w4a16Prefill: 'always' },
        () => {
          expectThrows('prefill, one token', () => gemm(1), /KDTREE_W4A16_PREFILL=always cannot run M = 1, N = 64, K = 256, group 32 on the prefill kernel: it takes 17 or more tokens/);
          if (b.native.lastForm() !== null) fail(`a refused call leaves lastForm() ${b.native.lastForm()}, expected null`);
          expectThrows('prefill, f32 x', () => b.native.w4a16Gemm({ x: track(upload(b, 'f32', [40, 256], randomF32(40 * 256, 64))), qw, sc, y: track(b.empty('f32', [40, 64])), group: 32 }), /cannot run M = 40.*it takes bf16 x/);
        },
        { expectForm: false },
      );
      withForcedForms(b, { gemm: 'tiled' }, () => expectThrows('tiled form, 3 tokens', () => dense(3), /KDTREE_GEMM_FORM=tiled cannot run M = 3, N = 64, K = 256: the tiled and wgmma forms take bf16 or f16 x of 17 or more tokens/), { expectForm: false });
      withForcedForms(b, { gemm: 'wgmma' }, () => expectThrows('wgmma form, 3 tokens', () => dense(3), /KDTREE_GEMM_FORM=wgmma cannot run M = 3/), { expectForm: false });
      withForcedForms(b, { gemm: 'split' }, () => dense(3));
    });
    return { detail: b.kind === 'cuda' ? 'each refused with its reason; lastForm() named each form' : 'unknown values refused; lastForm() is cpu (the cuda forms are not run)' };
  },
};

export const GEMM_CHECKS: KernelCheck[] = [
  gemmCheck('f32', 'BF16', 'f32'),
  gemmCheck('f32', 'F32', 'f32'),
  gemmCheck('bf16', 'BF16', 'f32'),
  gemmCheck('bf16', 'BF16', 'bf16'),
  gemmCheck('f16', 'F32', 'f16'),
  packCheck('BF16'),
  packCheck('F32'),
  streamKCheck,
  inPlace16Check,
  wgmmaCheck,
  prefillCheck,
  gemmInvarianceCheck('f32'),
  gemmInvarianceCheck('bf16'),
  moeCheck('f32', 96),
  moeCheck('bf16', 96),
  moeCheck('bf16', 128),
  moeManyTilesCheck(),
  moeLongRangesCheck(),
  moePiecesCheck(),
  moeEvenColumnsCheck(),
  moeRoutedEvenColumnsCheck(),
  shapeErrors,
  packedRecord,
  forcedFormErrors,
];
