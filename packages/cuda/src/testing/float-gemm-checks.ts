/** gemm (16-bit float weights, no packing) against @kdtree/reference matmul; batch invariance; bad arguments. */
import { bf16ArrayToF32, f16ArrayToF32, f32ArrayToBf16, f32ArrayToF16 } from '@kdtree/format';
import type { DeviceTensor, Dtype, KdtreeBackend } from '../backend.js';
import type { GemmForm } from '../native-types.js';
import { asF32, expectGemm, upload } from './gemm-checks.js';
import { expectThrows, fail, randomF32, sameBits, withForcedForms, withTensors, type KernelCheck } from './harness.js';

type WeightDtype = 'bf16' | 'f16';
/** A cuda kernel form that setForcedForms forces (the split form is the rule's fallback). */
type ForcedForm = Exclude<GemmForm, 'split'>;

/** Random weights [n, k] in `dtype`: the device tensor and the f32 values it holds. */
function weights(b: KdtreeBackend, dtype: WeightDtype, n: number, k: number, seed: number): { w: DeviceTensor; wf: Float32Array } {
  const v = randomF32(n * k, seed, 0.05);
  const bits = dtype === 'bf16' ? f32ArrayToBf16(v) : f32ArrayToF16(v);
  return { w: b.fromArray(dtype, [n, k], bits), wf: dtype === 'bf16' ? bf16ArrayToF32(bits) : f16ArrayToF32(bits) };
}

/**
 * Shapes: N not a multiple of 16 (a partial last tile); K a multiple of 8 but not of 32 (a partial
 * last chunk); N 37 x K 2056 has 3 tiles of 65 chunks, which on an H200 cuts K into 13 ranges, two
 * blocks per tile (the cross-block sum); N 600 x K 1000 has 38 tiles of 32 chunks, 8 ranges in one
 * block (the shared-memory sum).
 */
const SHAPES = [
  { n: 37, k: 2056 },
  { n: 600, k: 1000 },
  { n: 24, k: 8 },
];
const MS = [1, 3, 17, 118];

function againstReference(xDtype: Dtype, wDtype: WeightDtype, yDtype: Dtype): KernelCheck {
  return {
    name: `gemm w ${wDtype}, x ${xDtype}, y ${yDtype}: M 1/3/17/118 x N 37/600/24 x K 2056/1000/8 vs reference`,
    run(b) {
      const details: string[] = [];
      for (const [si, { n, k }] of SHAPES.entries()) {
        withTensors(b, (track) => {
          const { w, wf } = weights(b, wDtype, n, k, 40 + si);
          track(w);
          for (const m of MS) {
            const x = randomF32(m * k, 500 + 7 * m + si);
            const y = track(b.empty(yDtype, [m, n]));
            b.native.gemm({ x: track(upload(b, xDtype, [m, k], x)), w, y });
            details.push(expectGemm(`M=${m} N=${n} K=${k}`, asF32(yDtype, b.toArray(y)), x, xDtype, yDtype, m, k, wf, n));
          }
        });
      }
      return { detail: details.join('; ') };
    },
  };
}

/**
 * Rows 0, 5 and M - 1 of M = 17 and 118 == the row alone, bit for bit: on cuda the split form
 * (warps over one tile's K ranges) in 32- and 64-token tiles against one token. With `form` the
 * M-row calls are forced to it (KDTREE_GEMM_FORM; the rows form walks every range of a tile in one
 * warp; the tiled form does so from a shared-memory ring of 64 weight rows and the token tile's x;
 * tiled-split takes a block per range and sums the ranges across blocks; the wgmma form, on sm_90a,
 * multiplies 128 weight rows by 128 tokens of staged x on the warpgroup MMA), while the row alone
 * keeps the split form: all must sum the same ranges in the same order.
 */
function invarianceCheck(xDtype: Dtype, wDtype: WeightDtype, form?: ForcedForm): KernelCheck {
  return {
    name: `gemm w ${wDtype}, x ${xDtype}: a row of M = 17 and 118 == the row alone, bit for bit${form ? ` (M-row calls in the ${form} form on cuda)` : ''}, at N 37 x K 2056 and N 600 x K 1000`,
    run(b) {
      for (const [si, { n, k }] of SHAPES.slice(0, 2).entries()) {
        withTensors(b, (track) => {
          const { w } = weights(b, wDtype, n, k, 60 + si);
          track(w);
          const call = (x: Float32Array, m: number) => {
            const y = track(b.empty('f32', [m, n]));
            b.native.gemm({ x: track(upload(b, xDtype, [m, k], x)), w, y });
            return b.toArray(y) as Float32Array;
          };
          for (const m of [17, 118]) {
            const x = randomF32(m * k, 700 + m + si);
            const all = form ? withForcedForms(b, { gemm: form }, () => call(x, m)) : call(x, m);
            for (const r of [0, 5, m - 1]) {
              if (!sameBits(call(x.subarray(r * k, (r + 1) * k), 1), all.subarray(r * n, (r + 1) * n))) fail(`N=${n} K=${k} M=${m}: row ${r} differs from the row alone`);
            }
          }
        });
      }
    },
  };
}

/**
 * Graphs, on a created stream: each capture is one gemm call in a form that uses the device
 * differently: the split form with a K split across blocks (work space and counters that the last
 * block zeroes for the next launch), the rows form, the tiled form (dynamic shared memory), its
 * block-per-range variant (work space again) and the wgmma form (x staged into work space by a
 * kernel of its own). Replayed 3 times with new x uploaded before each, a graph must give a direct
 * call's bits.
 */
const GRAPH_CASES: { n: number; k: number; m: number; form?: ForcedForm }[] = [
  { ...SHAPES[0], m: 3 },
  { ...SHAPES[1], m: 40, form: 'rows' },
  { ...SHAPES[1], m: 40, form: 'tiled' },
  { ...SHAPES[0], m: 40, form: 'tiled-split' },
  { ...SHAPES[0], m: 40, form: 'wgmma' },
];

const graphReplay: KernelCheck = {
  name: `gemm in a graph: ${GRAPH_CASES.map((c) => `${c.form ?? 'split'} form (N ${c.n} x K ${c.k}, M ${c.m})`).join(', ')} captured once, launched 3 times with new x == direct calls, bit for bit`,
  run(b) {
    withTensors(b, (track) => {
      const cases = GRAPH_CASES.map(({ n, k, m, form }, i) => {
        const { w } = weights(b, 'bf16', n, k, 80 + i);
        return { n, k, m, form, w: track(w), x: track(b.empty('bf16', [m, k])), yGraph: track(b.empty('f32', [m, n])), yDirect: track(b.empty('f32', [m, n])) };
      });
      const call = (c: (typeof cases)[number], y: DeviceTensor, stream?: number) => {
        const run = () => b.native.gemm({ x: c.x, w: c.w, y, stream });
        return c.form ? withForcedForms(b, { gemm: c.form }, run) : run();
      };
      const stream = b.native.createStream();
      try {
        const graphs = cases.map((c) => b.capture(stream, () => call(c, c.yGraph, stream)));
        try {
          for (let launch = 0; launch < 3; launch++) {
            for (const [i, c] of cases.entries()) b.native.upload(c.x.buffer, f32ArrayToBf16(randomF32(c.m * c.k, 900 + 10 * launch + i)));
            for (const g of graphs) b.native.launchGraph(g, stream);
            b.synchronize(stream);
            for (const c of cases) call(c, c.yDirect);
            for (const c of cases) {
              if (!sameBits(b.toArray(c.yGraph), b.toArray(c.yDirect))) fail(`${c.form ?? 'split'} form, N=${c.n} K=${c.k} M=${c.m}: launch ${launch + 1} of the graph differs from a direct call`);
            }
          }
        } finally {
          for (const g of graphs) b.native.freeGraph(g);
        }
      } finally {
        b.native.destroyStream(stream);
      }
    });
  },
};

const argumentErrors: KernelCheck = {
  name: 'gemm rejects bad shapes, dtypes and alignment with every shape in the message',
  run(b) {
    withTensors(b, (track) => {
      const x = track(b.zeros('bf16', [3, 64]));
      const w = track(b.zeros('bf16', [20, 64]));
      const y = track(b.zeros('f32', [3, 20]));
      b.native.gemm({ x, w, y });
      expectThrows('K mismatch', () => b.native.gemm({ x, w: track(b.zeros('bf16', [20, 72])), y }), /gemm\(x: bf16 \[3, 64\], w: bf16 \[20, 72\], y: f32 \[3, 20\]\): w must be \[N, K\] with K = 64 \(x's columns\), got K = 72/);
      expectThrows('K not a multiple of 8', () => b.native.gemm({ x: track(b.zeros('bf16', [3, 60])), w: track(b.zeros('bf16', [20, 60])), y }), /K = 60 must be a positive multiple of 8/);
      expectThrows('y shape', () => b.native.gemm({ x, w, y: track(b.zeros('f32', [3, 21])) }), /y must be \[M, N\] = \[3, 20\]/);
      expectThrows('f16 weights, bf16 x', () => b.native.gemm({ x, w: track(b.zeros('f16', [20, 64])), y }), /x must be f16, got bf16/);
      expectThrows('bf16 weights, f16 x', () => b.native.gemm({ x: track(b.zeros('f16', [3, 64])), w, y }), /x must be bf16 or f32, got f16/);
      expectThrows('f32 weights', () => b.native.gemm({ x, w: track(b.zeros('f32', [20, 64])), y }), /w must be bf16 or f16, got f32/);
      expectThrows('i32 y', () => b.native.gemm({ x, w, y: track(b.zeros('i32', [3, 20])) }), /y must be f32 or bf16 or f16, got i32/);
      const wide = track(b.zeros('bf16', [21, 64]));
      expectThrows('misaligned w', () => b.native.gemm({ x, w: { ...wide, shape: [20, 64], offset: 8 }, y }), /w must start 16-byte aligned/);
      expectThrows('buffer too small', () => b.native.gemm({ x, w: { ...w, shape: [40, 64] }, y: track(b.zeros('f32', [3, 40])) }), /w needs 5120 bytes but its buffer holds 2560/);
      // no rows: nothing to do, nothing written
      b.native.gemm({ x: track(b.zeros('bf16', [0, 64])), w, y: track(b.zeros('f32', [0, 20])) });
    });
  },
};

export const FLOAT_GEMM_CHECKS: KernelCheck[] = [
  againstReference('bf16', 'bf16', 'f32'),
  againstReference('bf16', 'bf16', 'bf16'),
  againstReference('f32', 'bf16', 'f32'),
  againstReference('f16', 'f16', 'f16'),
  invarianceCheck('bf16', 'bf16'),
  invarianceCheck('bf16', 'bf16', 'rows'),
  invarianceCheck('f32', 'bf16', 'rows'),
  invarianceCheck('f16', 'f16', 'rows'),
  invarianceCheck('bf16', 'bf16', 'tiled'),
  invarianceCheck('f16', 'f16', 'tiled'),
  invarianceCheck('bf16', 'bf16', 'tiled-split'),
  invarianceCheck('f16', 'f16', 'tiled-split'),
  invarianceCheck('bf16', 'bf16', 'wgmma'),
  invarianceCheck('f16', 'f16', 'wgmma'),
  graphReplay,
  argumentErrors,
];
