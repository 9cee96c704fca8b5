/** gqa_attention (a DFlash drafter's non-causal block attention) against @kdtree/reference dflashAttention. */
import { bf16ArrayToF32, f32ArrayToBf16 } from '@kdtree/format';
import { dflashAttention } from '@kdtree/reference';
import type { DeviceTensor, KdtreeBackend } from '../backend.js';
import { expectClose, expectThrows, randomF32, withTensors, type KernelCheck } from './harness.js';

interface Shape {
  T: number;
  hq: number;
  hkv: number;
  D: number;
  /** Cache rows, and how many of them are context. */
  S: number;
  ctx: number;
}

/**
 * Odd sizes: head dims that are not multiples of 32 (the CUDA kernel's lanes hold dims i, i + 32,
 * ...) or of 8, Kimi's 128 and the 256 limit; head ratios 1, 2, 3 and 8; an empty context, a full
 * cache, and contexts that do not fill it (rows past the context hold noise that must not be read).
 */
const SHAPES: Shape[] = [
  { T: 1, hq: 1, hkv: 1, D: 1, S: 1, ctx: 0 },
  { T: 3, hq: 6, hkv: 2, D: 7, S: 11, ctx: 5 },
  { T: 5, hq: 3, hkv: 3, D: 33, S: 9, ctx: 9 },
  { T: 8, hq: 8, hkv: 1, D: 128, S: 37, ctx: 23 },
  { T: 4, hq: 4, hkv: 2, D: 256, S: 17, ctx: 17 },
  { T: 2, hq: 6, hkv: 2, D: 96, S: 70, ctx: 69 },
];

const SCALE = 0.23;

function cacheTensor(b: KdtreeBackend, dtype: 'f32' | 'bf16', shape: number[], values: Float32Array): DeviceTensor {
  return dtype === 'bf16' ? b.fromArray('bf16', shape, f32ArrayToBf16(values)) : b.fromArray('f32', shape, values);
}

const reference: KernelCheck = {
  name: 'gqa_attention: non-causal block over cached context + block keys vs reference dflashAttention (head dims 1, 7, 33, 96, 128, 256; head ratios 1, 3, 8; f32 and bf16 cache and out)',
  run(b) {
    const notes: string[] = [];
    SHAPES.forEach((s, n) => {
      for (const cache of ['f32', 'bf16'] as const) {
        for (const outDtype of ['f32', 'bf16'] as const) {
          withTensors(b, (track) => {
            const seed = 100 * n + (cache === 'bf16' ? 10 : 0) + (outDtype === 'bf16' ? 1 : 0);
            const q = randomF32(s.T * s.hq * s.D, seed);
            const kc = randomF32(s.S * s.hkv * s.D, seed + 1);
            const vc = randomF32(s.S * s.hkv * s.D, seed + 2);
            const k = randomF32(s.T * s.hkv * s.D, seed + 3);
            const v = randomF32(s.T * s.hkv * s.D, seed + 4);
            const out = track(b.empty(outDtype, [s.T, s.hq, s.D]));
            b.native.gqaAttention({
              q: track(b.fromArray('f32', [s.T, s.hq, s.D], q)),
              kCache: track(cacheTensor(b, cache, [s.S, s.hkv, s.D], kc)),
              vCache: track(cacheTensor(b, cache, [s.S, s.hkv, s.D], vc)),
              k: track(b.fromArray('f32', [s.T, s.hkv, s.D], k)),
              v: track(b.fromArray('f32', [s.T, s.hkv, s.D], v)),
              out,
              contextLength: s.ctx,
              scale: SCALE,
            });
            const held = (x: Float32Array) => (cache === 'bf16' ? bf16ArrayToF32(f32ArrayToBf16(x)) : x);
            let ref = dflashAttention({ q, tokens: s.T, heads: s.hq, kvHeads: s.hkv, headDim: s.D, scale: SCALE, kCtx: held(kc), vCtx: held(vc), contextLength: s.ctx, kBlock: k, vBlock: v });
            const got = outDtype === 'bf16' ? bf16ArrayToF32(b.toArray(out) as Uint16Array) : (b.toArray(out) as Float32Array);
            // a bf16 out is compared with the reference rounded the same way
            if (outDtype === 'bf16') ref = bf16ArrayToF32(f32ArrayToBf16(ref));
            notes.push(expectClose(`T ${s.T} Hq ${s.hq} Hkv ${s.hkv} D ${s.D} ctx ${s.ctx}/${s.S} ${cache} cache ${outDtype} out`, got, ref, outDtype === 'bf16' ? 8e-3 : 2e-5, s.D));
          });
        }
      }
    });
    return { detail: notes.slice(0, 3).join('; ') };
  },
};

const onDevice: KernelCheck = {
  name: 'gqa_attention: contextLengthOnDevice reads the length when the kernel runs (one capture replayed at lengths 0, 5, 9 equals direct calls at those lengths) and clamps it to the bound',
  run(b) {
    const s = { T: 3, hq: 6, hkv: 2, D: 40, S: 12 };
    const bound = 9;
    withTensors(b, (track) => {
      const inputs = {
        q: track(b.fromArray('f32', [s.T, s.hq, s.D], randomF32(s.T * s.hq * s.D, 1))),
        kCache: track(b.fromArray('f32', [s.S, s.hkv, s.D], randomF32(s.S * s.hkv * s.D, 2))),
        vCache: track(b.fromArray('f32', [s.S, s.hkv, s.D], randomF32(s.S * s.hkv * s.D, 3))),
        k: track(b.fromArray('f32', [s.T, s.hkv, s.D], randomF32(s.T * s.hkv * s.D, 4))),
        v: track(b.fromArray('f32', [s.T, s.hkv, s.D], randomF32(s.T * s.hkv * s.D, 5))),
        scale: SCALE,
      };
      const length = track(b.zeros('i32', [1]));
      const out = track(b.empty('f32', [s.T, s.hq, s.D]));
      const direct = track(b.empty('f32', [s.T, s.hq, s.D]));
      const stream = b.native.createStream();
      try {
        const graph = b.capture(stream, () => b.native.gqaAttention({ ...inputs, out, contextLength: bound, contextLengthOnDevice: length, stream }));
        try {
          // 12 is past the bound: the kernel reads 9 rows, not the cache's 12
          for (const [value, expected] of [[0, 0], [5, 5], [9, 9], [12, 9], [-3, 0]] as const) {
            b.native.upload(length.buffer, Int32Array.of(value));
            b.native.launchGraph(graph, 0);
            b.native.gqaAttention({ ...inputs, out: direct, contextLength: expected });
            const got = b.toArray(out) as Float32Array;
            const want = b.toArray(direct) as Float32Array;
            const diff = got.findIndex((x, i) => !Object.is(x, want[i]));
            if (diff >= 0) throw new Error(`device length ${value} (read as ${expected}): out[${diff}] = ${got[diff]}, a direct call at ${expected} gives ${want[diff]}`);
          }
        } finally {
          b.native.freeGraph(graph);
        }
      } finally {
        b.native.destroyStream(stream);
      }
      expectThrows('bound past the cache', () => b.native.gqaAttention({ ...inputs, out, contextLength: 13, contextLengthOnDevice: length }), /contextLength \(the bound of contextLengthOnDevice\) 13 is outside the cache's \[0, 12\] rows/);
      expectThrows('device scalar shape', () => b.native.gqaAttention({ ...inputs, out, contextLength: 3, contextLengthOnDevice: track(b.zeros('i32', [2])) }), /contextLengthOnDevice must be \[1\]/);
    });
    return { detail: 'lengths 0, 5, 9, 12 -> 9, -3 -> 0 bit-identical to direct calls' };
  },
};

const badShapes: KernelCheck = {
  name: 'gqa_attention: bad shapes are rejected, naming the tensor (head ratio, head dim, k/v and cache shapes, contextLength past the cache, dtypes, scale)',
  run(b) {
    withTensors(b, (track) => {
      const f32 = (shape: number[]) => track(b.zeros('f32', shape));
      const good = () => ({ q: f32([2, 4, 8]), kCache: f32([5, 2, 8]), vCache: f32([5, 2, 8]), k: f32([2, 2, 8]), v: f32([2, 2, 8]), out: f32([2, 4, 8]), contextLength: 3, scale: 0.5 });
      b.native.gqaAttention(good());
      expectThrows('head ratio', () => b.native.gqaAttention({ ...good(), q: f32([2, 3, 8]), out: f32([2, 3, 8]) }), /q's 3 heads must be a multiple of kCache's 2 KV heads/);
      expectThrows('head dim', () => b.native.gqaAttention({ ...good(), kCache: f32([5, 2, 6]), vCache: f32([5, 2, 6]) }), /kCache must be \[S, Hkv, D\] with D = 8/);
      const wide = () => f32([1, 1, 257]);
      expectThrows('head dim limit', () => b.native.gqaAttention({ q: wide(), kCache: wide(), vCache: wide(), k: wide(), v: wide(), out: wide(), contextLength: 0, scale: 1 }), /head dims 1\.\.256/);
      expectThrows('vCache', () => b.native.gqaAttention({ ...good(), vCache: f32([4, 2, 8]) }), /vCache must be like kCache: \[5, 2, 8\]/);
      expectThrows('k rows', () => b.native.gqaAttention({ ...good(), k: f32([3, 2, 8]) }), /k must be \[T, Hkv, D\] = \[2, 2, 8\]/);
      expectThrows('v', () => b.native.gqaAttention({ ...good(), v: f32([2, 1, 8]) }), /v must be like k/);
      expectThrows('out', () => b.native.gqaAttention({ ...good(), out: f32([2, 4, 7]) }), /out must be like q: \[2, 4, 8\]/);
      expectThrows('contextLength', () => b.native.gqaAttention({ ...good(), contextLength: 6 }), /contextLength 6 is outside the cache's \[0, 5\] rows/);
      expectThrows('q dtype', () => b.native.gqaAttention({ ...good(), q: track(b.zeros('bf16', [2, 4, 8])) }), /q must be f32, got bf16/);
      expectThrows('mixed cache dtypes', () => b.native.gqaAttention({ ...good(), vCache: track(b.zeros('bf16', [5, 2, 8])) }), /vCache must have kCache's dtype \(f32\)/);
      expectThrows('scale', () => b.native.gqaAttention({ ...good(), scale: 0 }), /scale must be positive/);
      expectThrows('rank', () => b.native.gqaAttention({ ...good(), k: f32([2, 16]) }), /k must have 3 dimensions/);
    });
  },
};

export const GQA_ATTENTION_CHECKS: KernelCheck[] = [reference, onDevice, badShapes];
