/**
 * The W4A16 SiLU epilogue: gate_up weights packed with interleaveGateUp, y = silu(gate) * up. Its
 * bits must equal the plain GEMM on the same packed weights followed by silu_mul (on either
 * backend), and its values the reference.
 */
import { dequantizeInt4, type Int4Matrix } from '@kdtree/quant';
import type { DeviceTensor, Dtype, KdtreeBackend } from '../backend.js';
import { asF32, int4, packReference, referenceGemm, upload, uploadCheckpoint } from './gemm-checks.js';
import { expectThrows, fail, randomF32, sameBits, withForcedForms, withTensors, type KernelCheck } from './harness.js';
import { expectWithin, gemmBound, siluMulAllowed } from './tolerance.js';

export type Track = <U extends { buffer: { freed: boolean } }>(t: U) => U;

/** The checkpoint row of packed row `row` of a gate_up matrix with `inter` rows each, or -1 (padding). */
function gateUpSourceRow(row: number, inter: number): number {
  const j = Math.floor(row / 16) * 8 + (row % 8);
  if (j >= inter) return -1;
  return row % 16 < 8 ? j : inter + j;
}

/** Columns of a plain GEMM's output on gate_up-packed weights: every row of every tile. */
const interleavedWidth = (inter: number) => Math.ceil(inter / 8) * 16;

/** gate_up matrix `m` ([gate; up], 2I rows) with its rows in packed order, padding rows zero (code 8, scale 0). */
function interleavedRows(m: Int4Matrix): Int4Matrix {
  const inter = m.rows / 2;
  const rows = interleavedWidth(inter);
  const wq = m.cols / 8;
  const ws = m.cols / m.groupSize;
  const packed = new Int32Array(rows * wq).fill(0x88888888 | 0);
  const scales = m.scaleDtype === 'BF16' ? new Uint16Array(rows * ws) : new Float32Array(rows * ws);
  for (let r = 0; r < rows; r++) {
    const src = gateUpSourceRow(r, inter);
    if (src < 0) continue;
    packed.set(m.packed.subarray(src * wq, (src + 1) * wq), r * wq);
    scales.set(m.scales.subarray(src * ws, (src + 1) * ws), r * ws);
  }
  return { ...m, rows, packed, scales };
}

/** `m` ([E x] 2I rows) uploaded and packed with interleaveGateUp, tracked. */
export function packGateUp(b: KdtreeBackend, track: Track, m: Int4Matrix, experts = 1): { qw: DeviceTensor; sc: DeviceTensor } {
  const cp = uploadCheckpoint(b, m, experts);
  track(cp.qw);
  track(cp.sc);
  const packed = b.packW4A16(cp.qw, cp.sc, m.groupSize, undefined, { interleaveGateUp: true });
  return { qw: track(packed.qw), sc: track(packed.sc) };
}

/**
 * silu_mul of a plain GEMM's output on gate_up-packed weights (`plain`: [rows, interleavedWidth]
 * of `dtype`): its gate and up columns gathered into [rows, 2I] as they are, then the silu_mul op.
 */
function siluOfPlain(b: KdtreeBackend, track: Track, plain: DeviceTensor, rows: number, inter: number, dtype: Dtype): ArrayBufferView {
  const raw = b.toArray(plain) as Uint16Array | Float32Array;
  const width = interleavedWidth(inter);
  const gateUp = dtype === 'f32' ? new Float32Array(rows * 2 * inter) : new Uint16Array(rows * 2 * inter);
  for (let r = 0; r < rows; r++) {
    for (let j = 0; j < inter; j++) {
      const col = 16 * Math.floor(j / 8) + (j % 8);
      gateUp[r * 2 * inter + j] = raw[r * width + col];
      gateUp[r * 2 * inter + inter + j] = raw[r * width + col + 8];
    }
  }
  const out = track(b.empty(dtype, [rows, inter]));
  b.native.siluMul({ x: track(b.fromArray(dtype, [rows, 2 * inter], gateUp)), out });
  return b.toArray(out);
}

/**
 * out [rows, I] = silu(gate) * up against the reference rows [rows, 2I] ([gate | up], with their
 * magnitudes sum_k |x_k w_k|), each element within the bound of tolerance.ts's siluMulAllowed.
 */
function expectSiluMul(what: string, out: ArrayLike<number>, gateUp: { ref: Float32Array; magnitude: Float32Array }, inter: number, xDtype: Dtype, yDtype: Dtype, k: number): string {
  const { ref: gu, magnitude: mag } = gateUp;
  const rows = gu.length / (2 * inter);
  const ref = new Float32Array(rows * inter);
  for (let r = 0; r < rows; r++) {
    for (let j = 0; j < inter; j++) {
      const g = gu[r * 2 * inter + j];
      ref[r * inter + j] = (g / (1 + Math.exp(-g))) * gu[r * 2 * inter + inter + j];
    }
  }
  const bound = gemmBound(xDtype, yDtype, k);
  return expectWithin(what, out, ref, inter, (i) => {
    const r = Math.floor(i / inter);
    const g = r * 2 * inter + (i % inter);
    return siluMulAllowed(bound, gu[g], gu[g + inter], mag[g], mag[g + inter]);
  });
}

const packCheck: KernelCheck = {
  name: 'w4a16_pack interleaveGateUp: bit-exact with the plain layout of the rows in tile order (8 gate rows, then the same 8 up rows; I 12/100/8, a partial last tile, experts, bf16 and f32 scales)',
  run(b) {
    const cases = [
      { inter: 12, k: 64, group: 32, scales: 'BF16' as const, experts: 1 },
      { inter: 100, k: 224, group: 32, scales: 'F32' as const, experts: 1 },
      { inter: 8, k: 384, group: 128, scales: 'BF16' as const, experts: 1 },
      { inter: 20, k: 96, group: 32, scales: 'BF16' as const, experts: 3 },
    ];
    for (const [ci, c] of cases.entries()) {
      const w = int4(c.experts * 2 * c.inter, c.k, c.group, c.scales, 90 + ci);
      withTensors(b, (track) => {
        const packed = packGateUp(b, track, w, c.experts);
        const qw = b.toArray(packed.qw) as Int32Array;
        const sc = b.toArray(packed.sc) as Uint16Array | Float32Array;
        const wq = c.k / 8;
        const ws = c.k / c.group;
        const rows = 2 * c.inter;
        for (let e = 0; e < c.experts; e++) {
          const one: Int4Matrix = { ...w, rows, packed: w.packed.subarray(e * rows * wq, (e + 1) * rows * wq), scales: w.scales.subarray(e * rows * ws, (e + 1) * rows * ws) };
          const ref = packReference(interleavedRows(one));
          if (!sameBits(qw.subarray(e * ref.qw.length, (e + 1) * ref.qw.length), ref.qw)) fail(`I=${c.inter} K=${c.k} expert ${e}: packed codes differ from the interleaved rows' layout`);
          if (!sameBits(sc.subarray(e * ref.sc.length, (e + 1) * ref.sc.length), ref.sc)) fail(`I=${c.inter} K=${c.k} expert ${e}: packed scales differ`);
        }
      });
    }
    return { detail: `${cases.length} cases` };
  },
};

interface DenseCase {
  inter: number;
  k: number;
  group: number;
  scales: 'BF16' | 'F32';
  ms: number[];
  xDtype: Dtype;
  yDtype: 'f32' | 'bf16';
}

/**
 * Each case at each M: the epilogue's y [M, I] == silu_mul of the plain GEMM on the same weights, bit
 * for bit; close to the reference; and its last row == that row alone. `forced` wraps the M-row
 * calls (a kernel choice forced by an environment variable; the row alone keeps the default).
 */
function denseCases(b: KdtreeBackend, cases: DenseCase[], seed: number, forced: <T>(call: () => T) => T = (call) => call()): string {
  const details: string[] = [];
  for (const [ci, c] of cases.entries()) {
    const w = int4(2 * c.inter, c.k, c.group, c.scales, seed + ci);
    const wf = dequantizeInt4(w);
    withTensors(b, (track) => {
      const { qw, sc } = packGateUp(b, track, w);
      const fused = (x: Float32Array, m: number) => {
        const y = track(b.empty(c.yDtype, [m, c.inter]));
        b.native.w4a16Gemm({ x: track(upload(b, c.xDtype, [m, c.k], x)), qw, sc, y, group: c.group, epilogue: 'siluMul' });
        return y;
      };
      for (const m of c.ms) {
        const what = `I=${c.inter} K=${c.k} G=${c.group} M=${m} x ${c.xDtype} y ${c.yDtype}`;
        const x = randomF32(m * c.k, seed * 7 + m + ci);
        const y = forced(() => fused(x, m));
        const plain = track(b.empty(c.yDtype, [m, interleavedWidth(c.inter)]));
        forced(() => b.native.w4a16Gemm({ x: track(upload(b, c.xDtype, [m, c.k], x)), qw, sc, y: plain, group: c.group }));
        const got = b.toArray(y);
        if (!sameBits(got, siluOfPlain(b, track, plain, m, c.inter, c.yDtype))) fail(`${what}: the epilogue differs from the plain GEMM + silu_mul`);
        details.push(expectSiluMul(what, asF32(c.yDtype, got), referenceGemm(x, c.xDtype, m, c.k, wf, 2 * c.inter), c.inter, c.xDtype, c.yDtype, c.k));
        if (m > 1) {
          const alone = b.toArray(fused(x.subarray((m - 1) * c.k, m * c.k), 1));
          const row = got as Uint16Array | Float32Array;
          if (!sameBits(alone, row.subarray((m - 1) * c.inter, m * c.inter))) fail(`${what}: row ${m - 1} differs from the row alone`);
        }
      }
    });
  }
  return details.join('; ');
}

const denseCheck: KernelCheck = {
  name: 'w4a16_gemm siluMul epilogue: I 100 x K 224 at M 1/3/17/118 (x and y bf16, y f32), I 36 x K 192 (group 64, f32 x and scales), I 7248 x K 896 at M 1/3/17 (tiles split across blocks on cuda), I 8500 x K 640 at M 40 (the warpgroup kernel on sm_90a) == plain GEMM + silu_mul bit for bit, vs reference, rows == the row alone',
  run: (b) => ({
    detail: denseCases(
      b,
      [
        { inter: 100, k: 224, group: 32, scales: 'BF16', ms: [1, 3, 17, 118], xDtype: 'bf16', yDtype: 'bf16' },
        { inter: 100, k: 224, group: 32, scales: 'BF16', ms: [3, 17], xDtype: 'bf16', yDtype: 'f32' },
        { inter: 36, k: 192, group: 64, scales: 'F32', ms: [1, 17], xDtype: 'f32', yDtype: 'f32' },
        { inter: 7248, k: 896, group: 32, scales: 'BF16', ms: [1, 3, 17], xDtype: 'bf16', yDtype: 'bf16' },
        { inter: 8500, k: 640, group: 32, scales: 'BF16', ms: [40], xDtype: 'bf16', yDtype: 'bf16' },
      ],
      120,
    ),
  }),
};

/** The prefill kernel's stores (forced: shapes this small take it only when asked). */
const prefillCheck: KernelCheck = {
  name: 'w4a16_gemm siluMul epilogue: I 1000 x K 640 at M 260 (the prefill kernel on sm_90a, forced) == plain GEMM + silu_mul bit for bit, vs reference',
  run: (b) => ({ detail: denseCases(b, [{ inter: 1000, k: 640, group: 32, scales: 'BF16', ms: [260], xDtype: 'bf16', yDtype: 'bf16' }], 130, (call) => withForcedForms(b, { w4a16Prefill: 'always' }, call)) }),
};

const moeCheck: KernelCheck = {
  name: 'moe_gemm gather with the siluMul epilogue: 6 experts of I 40 x K 256, top-2, T 1/5/30 (routed in the GEMM, and sorted on cuda) == plain gather + silu_mul bit for bit, vs reference; a token\'s rows == the token alone',
  run(b) {
    const E = 6;
    const inter = 40;
    const k = 256;
    const topk = 2;
    const w = int4(E * 2 * inter, k, 32, 'BF16', 140);
    const wf = dequantizeInt4(w);
    return withTensors(b, (track) => {
      const { qw, sc } = packGateUp(b, track, w, E);
      let detail = '';
      for (const T of [1, 5, 30]) {
        const ids = Int32Array.from({ length: T * topk }, (_, i) => (3 * Math.floor(i / topk) + 5 * (i % topk)) % E);
        const x = randomF32(T * k, 141 + T);
        const gather = (tokens: number, first: number, epilogue: 'siluMul' | 'none', width: number) => {
          const y = track(b.empty('bf16', [tokens * topk, width]));
          const idsD = track(b.fromArray('i32', [tokens, topk], ids.subarray(first * topk, (first + tokens) * topk)));
          b.native.moeGemm({ x: track(upload(b, 'bf16', [tokens, k], x.subarray(first * k, (first + tokens) * k))), qw, sc, ids: idsD, y, mode: 'gather', epilogue });
          return y;
        };
        const got = b.toArray(gather(T, 0, 'siluMul', inter)) as Uint16Array;
        const plain = gather(T, 0, 'none', interleavedWidth(inter));
        if (!sameBits(got, siluOfPlain(b, track, plain, T * topk, inter, 'bf16'))) fail(`T=${T}: the epilogue differs from the plain gather + silu_mul`);
        const gateUp = { ref: new Float32Array(T * topk * 2 * inter), magnitude: new Float32Array(T * topk * 2 * inter) };
        for (let p = 0; p < T * topk; p++) {
          const t = Math.floor(p / topk);
          const rows = referenceGemm(x.subarray(t * k, (t + 1) * k), 'bf16', 1, k, wf.subarray(ids[p] * 2 * inter * k, (ids[p] + 1) * 2 * inter * k), 2 * inter);
          gateUp.ref.set(rows.ref, p * 2 * inter);
          gateUp.magnitude.set(rows.magnitude, p * 2 * inter);
        }
        detail = expectSiluMul(`T=${T}`, asF32('bf16', got), gateUp, inter, 'bf16', 'bf16', k);
        const alone = b.toArray(gather(1, T - 1, 'siluMul', inter));
        if (!sameBits(alone, got.subarray((T - 1) * topk * inter, T * topk * inter))) fail(`T=${T}: token ${T - 1} alone differs from its rows`);
      }
      return { detail };
    });
  },
};

const errorsCheck: KernelCheck = {
  name: 'the siluMul epilogue and interleaveGateUp reject what they cannot do, naming the shapes',
  run(b) {
    withTensors(b, (track) => {
      const x = track(b.zeros('bf16', [3, 64]));
      const qw = track(b.zeros('i32', [1, 1, 256]));
      const sc = track(b.zeros('bf16', [1, 1, 64]));
      b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('bf16', [3, 8])), group: 32, epilogue: 'siluMul' });
      expectThrows('epilogue width', () => b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('bf16', [3, 16])), group: 32, epilogue: 'siluMul' }), /y: bf16 \[3, 16\].*qw must be the packed layout .* = \[2, 1, 256\] for N = 32/);
      expectThrows('epilogue name', () => b.native.w4a16Gemm({ x, qw, sc, y: track(b.zeros('bf16', [3, 8])), group: 32, epilogue: 'gelu' as never }), /w4a16_gemm: epilogue must be 'none' or 'siluMul', got 'gelu'/);
      const ids = track(b.zeros('i32', [3, 2]));
      const eqw = track(b.zeros('i32', [4, 1, 1, 256]));
      const esc = track(b.zeros('bf16', [4, 1, 1, 64]));
      const weights = track(b.zeros('f32', [3, 2]));
      expectThrows('epilogue in sum mode', () => b.native.moeGemm({ x: track(b.zeros('bf16', [6, 64])), qw: eqw, sc: esc, ids, weights, y: track(b.zeros('bf16', [3, 8])), mode: 'sum', epilogue: 'siluMul' }), /siluMul epilogue needs gather mode/);
      const cq = track(b.zeros('i32', [15, 8]));
      const cs = track(b.zeros('bf16', [15, 2]));
      expectThrows('odd gate_up rows', () => b.native.w4a16Pack({ qw: cq, sc: cs, qwPacked: qw, scPacked: sc, group: 32, interleaveGateUp: true }), /qw: i32 \[15, 8\].*interleaveGateUp: qw must hold gate rows then as many up rows \(an even N\), got N = 15/);
    });
  },
};

export const EPILOGUE_CHECKS: KernelCheck[] = [packCheck, denseCheck, prefillCheck, moeCheck, errorsCheck];
