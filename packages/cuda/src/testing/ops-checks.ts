/** The small ops against @kdtree/reference. */
import { f32ArrayToBf16, bf16ArrayToF32 } from '@kdtree/format';
import { KdtreeBackend } from '../backend.js';
import { applyRope, parseModelConfig, rmsNorm, route, ropeTables, silu } from '@kdtree/reference';
import { expectClose, expectEqual, expectThrows, fail, randomF32, rng, sameBits, withTensors, type KernelCheck } from './harness.js';

const rmsNormCheck: KernelCheck = {
  name: 'rms_norm (f32 and bf16 weights, f32 and bf16 out and both at once, H 200 / 203 / 7168 / 9000 / 9002) vs reference; a row\'s bits the same alone, in a batch, off 16-byte alignment, and (on cuda) on the cpu twin',
  run(b) {
    return withTensors(b, (track) => {
      const rows = 5;
      let detail = '';
      const twin = new KdtreeBackend({ ...b.loaded, native: b.loaded.module.createBackend('cpu') });
      for (const dim of [200, 203, 7168, 9000, 9002]) {
        const x = randomF32(rows * dim, 1);
        const w = bf16ArrayToF32(f32ArrayToBf16(randomF32(dim, 2)));
        const out = track(b.empty('f32', [rows, dim]));
        b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: track(b.fromArray('bf16', [dim], f32ArrayToBf16(w))), out, eps: 1e-5 });
        const d1 = expectClose(`H ${dim} bf16 weight`, b.toArray(out) as Float32Array, rmsNorm(x, rows, dim, w, 1e-5), 1e-6, dim);
        const wF32 = track(b.fromArray('f32', [dim], w));
        b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: wF32, out, eps: 1e-6 });
        const batch = b.toArray(out) as Float32Array;
        const d2 = expectClose(`H ${dim} f32 weight`, batch, rmsNorm(x, rows, dim, w, 1e-6), 1e-6, dim);
        // row 3 alone, from a buffer one float off 16-byte alignment (no float4 loads)
        const shifted = new Float32Array(dim + 1);
        shifted.set(x.subarray(3 * dim, 4 * dim), 1);
        const one = track(b.empty('f32', [1, dim]));
        b.native.rmsNorm({ x: { ...track(b.fromArray('f32', [dim + 1], shifted)), shape: [1, dim], offset: 4 }, weight: wF32, out: one, eps: 1e-6 });
        if (!sameBits(b.toArray(one), batch.subarray(3 * dim, 4 * dim))) fail(`H ${dim}: row 3 alone and unaligned differs from row 3 of the batch`);
        // a bf16 out (a GEMM's input) holds the f32 out rounded to nearest even, bit for bit: the
        // float4 path and, for row 3 off alignment, the scalar one
        const want = f32ArrayToBf16(batch);
        const outBf16 = track(b.empty('bf16', [rows, dim]));
        b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: wF32, out: outBf16, eps: 1e-6 });
        if (!sameBits(b.toArray(outBf16), want)) fail(`H ${dim}: the bf16 out differs from the f32 out rounded to nearest even`);
        const oneBf16 = track(b.empty('bf16', [1, dim]));
        b.native.rmsNorm({ x: { ...track(b.fromArray('f32', [dim + 1], shifted)), shape: [1, dim], offset: 4 }, weight: wF32, out: oneBf16, eps: 1e-6 });
        if (!sameBits(b.toArray(oneBf16), want.subarray(3 * dim, 4 * dim))) fail(`H ${dim}: row 3 alone and unaligned, bf16 out, differs from the f32 out rounded`);
        // both from one pass: an f32 out and its bf16 copy (outBf16)
        const both = track(b.empty('f32', [rows, dim]));
        const copy = track(b.empty('bf16', [rows, dim]));
        b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: wF32, out: both, outBf16: copy, eps: 1e-6 });
        if (!sameBits(b.toArray(both), batch) || !sameBits(b.toArray(copy), want)) fail(`H ${dim}: out with outBf16 differs from the two calls apart`);
        if (dim === 200) {
          expectThrows('outBf16 beside a bf16 out', () => b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: wF32, out: outBf16, outBf16: copy, eps: 1e-6 }), /outBf16 is the bf16 copy of an f32 out/);
          expectThrows('outBf16 of f32', () => b.native.rmsNorm({ x: track(b.fromArray('f32', [rows, dim], x)), weight: wF32, out: both, outBf16: both, eps: 1e-6 }), /outBf16 must be bf16, got f32/);
        }
        // the cpu twin sums in the same order: the same bits across backends (on the cpu backend it
        // would be compared with itself, so only the cuda backend runs this part)
        if (b.kind === 'cuda') {
          withTensors(twin, (keep) => {
            const twinOut = keep(twin.empty('f32', [rows, dim]));
            twin.native.rmsNorm({ x: keep(twin.fromArray('f32', [rows, dim], x)), weight: keep(twin.fromArray('f32', [dim], w)), out: twinOut, eps: 1e-6 });
            if (!sameBits(twin.toArray(twinOut), batch)) fail(`H ${dim}: the cpu twin's bits differ from the cuda backend's`);
          });
        }
        detail += `${detail ? '; ' : ''}${d1}; ${d2}`;
      }
      return { detail: `${detail}${b.kind === 'cuda' ? '; the cpu twin has the same bits' : ''}` };
    });
  },
};

const fusedResidualNorm: KernelCheck = {
  name: 'rms_norm with a residual (H 7168 / 9002, 3 rows): out and sum have the bits of add then rms_norm, also with sum written over x or over residual; a residual without sum (or sum without one) and a misshapen residual are rejected',
  run(b) {
    return withTensors(b, (track) => {
      const rows = 3;
      for (const dim of [7168, 9002]) {
        const x = randomF32(rows * dim, 60);
        const res = randomF32(rows * dim, 61, 3);
        const weight = track(b.fromArray('bf16', [dim], f32ArrayToBf16(randomF32(dim, 62))));
        // unfused: add, then the norm of the sum
        const added = track(b.empty('f32', [rows, dim]));
        b.native.add({ a: track(b.fromArray('f32', [rows, dim], x)), b: track(b.fromArray('f32', [rows, dim], res)), out: added });
        const normed = track(b.empty('f32', [rows, dim]));
        b.native.rmsNorm({ x: added, weight, out: normed, eps: 1e-5 });
        const [wantSum, wantOut] = [b.toArray(added), b.toArray(normed)];
        for (const into of ['sum', 'x', 'residual'] as const) {
          const xd = track(b.fromArray('f32', [rows, dim], x));
          const rd = track(b.fromArray('f32', [rows, dim], res));
          const sum = into === 'x' ? xd : into === 'residual' ? rd : track(b.empty('f32', [rows, dim]));
          const out = track(b.empty('f32', [rows, dim]));
          b.native.rmsNorm({ x: xd, residual: rd, sum, weight, out, eps: 1e-5 });
          if (!sameBits(b.toArray(sum), wantSum)) fail(`H ${dim}, sum into ${into}: sum differs from add's`);
          if (!sameBits(b.toArray(out), wantOut)) fail(`H ${dim}, sum into ${into}: out differs from add then rms_norm`);
        }
      }
      const t = track(b.zeros('f32', [2, 8]));
      const w = track(b.zeros('f32', [8]));
      expectThrows('residual without sum', () => b.native.rmsNorm({ x: t, residual: t, weight: w, out: t, eps: 1e-5 }), /residual and sum go together/);
      expectThrows('sum without residual', () => b.native.rmsNorm({ x: t, sum: t, weight: w, out: t, eps: 1e-5 }), /residual and sum go together/);
      expectThrows('misshapen residual', () => b.native.rmsNorm({ x: t, residual: { ...t, shape: [1, 8] }, sum: t, weight: w, out: t, eps: 1e-5 }), /rms_norm\(.*residual: f32 \[1, 8\].*\): residual and sum must be like x/);
      return { detail: 'fused == add + rms_norm bit for bit at H 7168 and 9002, in place on x and on residual' };
    });
  },
};

const ropeCheck: KernelCheck = {
  name: 'rope: YaRN tables of a Kimi K2 config, interleaved and not, long positions, vs reference',
  run(b) {
    return withTensors(b, (track) => {
      const config = parseModelConfig({
        model_type: 'kimi_k2', qk_rope_head_dim: 64, max_position_embeddings: 262144, rope_theta: 50000,
        rope_scaling: { type: 'yarn', factor: 64, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1, original_max_position_embeddings: 4096 },
      });
      const tables = ropeTables(config);
      const T = 4;
      const heads = 3;
      const hd = 80; // rotate dims [16, 80) of each head, as q_pe follows the 16 nope dims here
      const positions = Int32Array.of(0, 7, 4095, 200000);
      const details: string[] = [];
      for (const interleave of [true, false]) {
        const x = randomF32(T * heads * hd, 3);
        const xd = track(b.fromArray('f32', [T, heads, hd], x));
        b.native.rope({ x: xd, positions: track(b.fromArray('i32', [T], positions)), invFreq: track(b.fromArray('f64', [32], tables.invFreq)), offset: 16, attentionFactor: tables.attentionFactor, interleave });
        const ref = x.slice();
        for (let t = 0; t < T; t++) for (let h = 0; h < heads; h++) applyRope(ref, (t * heads + h) * hd + 16, positions[t], tables, interleave);
        details.push(expectClose(`interleave ${interleave}`, b.toArray(xd) as Float32Array, ref, 1e-6, hd));
      }
      return { detail: details.join('; ') };
    });
  },
};

/** Columns [from, from + width) of each of the T rows of a [T, W] array. */
function columns(x: Float32Array, t: number, w: number, from: number, width: number): Float32Array {
  const out = new Float32Array(t * width);
  for (let i = 0; i < t; i++) out.set(x.subarray(i * w + from, i * w + from + width), i * width);
  return out;
}

const mlaInputsQuery: KernelCheck = {
  name: 'mla_inputs / mla_query: the bits of the unfused rms_norm, rope and kv_write (f32 and bf16 cache and q_a out, with and without q_a, interleaved and not, odd sizes, off 16-byte alignment); bad shapes rejected',
  run(b) {
    return withTensors(b, (track) => {
      const S = 8;
      const slotsOf = Int32Array.of(5, 0, 2);
      const T = slotsOf.length;
      const positions = track(b.fromArray('i32', [T], Int32Array.of(3, 70000, 11)));
      const slots = track(b.fromArray('i32', [T], slotsOf));
      let cases = 0;
      // [Q, R, rope, W]: odd sizes with padding between the parts, Kimi K2's, and no q_a (W holds q_proj's output first)
      for (const [Q, R, dr, W] of [[12, 20, 6, 43], [1536, 512, 64, 2112], [0, 20, 6, 60]] as const) {
        const invFreq = track(b.fromArray('f64', [dr / 2], Float64Array.from({ length: dr / 2 }, (_, i) => 1 / 10000 ** ((2 * i) / dr))));
        for (const cache of ['f32', 'bf16'] as const) {
          for (const interleave of [true, false]) {
            for (const unaligned of [false, true]) {
              const x = randomF32(T * W, Q + R + W);
              const xd = unaligned ? { ...track(b.fromArray('f32', [T * W + 1], Float32Array.from([0, ...x]))), shape: [T, W], offset: 4 } : track(b.fromArray('f32', [T, W], x));
              const qNorm = track(b.fromArray('bf16', [Math.max(Q, 1)], f32ArrayToBf16(randomF32(Math.max(Q, 1), 5))));
              const kvNorm = track(b.fromArray('f32', [R], randomF32(R, 6)));
              const qOut = cache === 'bf16' ? 'bf16' : 'f32';
              const fused = { c: track(b.zeros(cache, [S, R])), kpe: track(b.zeros(cache, [S, dr])), q: track(b.zeros(qOut, [T, Math.max(Q, 1)])) };
              const rope = { positions, invFreq, attentionFactor: 1.25, interleave };
              b.native.mlaInputs({ x: xd, ...(Q > 0 ? { qANorm: qNorm, qAOut: fused.q } : {}), kvANorm: kvNorm, cacheC: fused.c, cacheKpe: fused.kpe, slots, eps: 1e-6, ...rope });
              const want = { c: track(b.zeros(cache, [S, R])), kpe: track(b.zeros(cache, [S, dr])), q: track(b.zeros(qOut, [T, Math.max(Q, 1)])) };
              if (Q > 0) b.native.rmsNorm({ x: track(b.fromArray('f32', [T, Q], columns(x, T, W, 0, Q))), weight: qNorm, out: want.q, eps: 1e-6 });
              const c = track(b.empty('f32', [T, R]));
              b.native.rmsNorm({ x: track(b.fromArray('f32', [T, R], columns(x, T, W, W - R - dr, R))), weight: kvNorm, out: c, eps: 1e-6 });
              const kpe = track(b.fromArray('f32', [T, 1, dr], columns(x, T, W, W - dr, dr)));
              b.native.rope({ x: kpe, ...rope });
              b.native.kvWrite({ c, kpe: { ...kpe, shape: [T, dr] }, cacheC: want.c, cacheKpe: want.kpe, slots });
              const what = `Q ${Q} R ${R} rope ${dr} W ${W}, ${cache} cache, interleave ${interleave}${unaligned ? ', unaligned' : ''}`;
              if (!sameBits(b.toArray(fused.c), b.toArray(want.c))) fail(`${what}: the latent rows differ from rms_norm + kv_write`);
              if (!sameBits(b.toArray(fused.kpe), b.toArray(want.kpe))) fail(`${what}: the rope keys differ from rope + kv_write`);
              if (Q > 0 && !sameBits(b.toArray(fused.q), b.toArray(want.q))) fail(`${what}: the normed q_a differs from rms_norm`);
              cases++;
            }
          }
        }
        // mla_query over the first columns of an x of this width: H heads of [nope | rope]
        const H = 2, dn = Math.floor((W - 2 * dr - 3) / 2);
        for (const interleave of [true, false]) {
          const x = randomF32(T * W, dn + W);
          const qNope = track(b.zeros('f32', [T, H, dn]));
          const qPe = track(b.zeros('f32', [T, H, dr]));
          const rope = { positions, invFreq, attentionFactor: 0.75, interleave };
          b.native.mlaQuery({ x: track(b.fromArray('f32', [T, W], x)), qNope, qPe, ...rope });
          const pe = track(b.fromArray('f32', [T, H, dr], columns(x, T, W, H * dn, H * dr)));
          b.native.rope({ x: pe, ...rope });
          const what = `mla_query H ${H} nope ${dn} rope ${dr} W ${W}, interleave ${interleave}`;
          if (!sameBits(b.toArray(qNope), columns(x, T, W, 0, H * dn))) fail(`${what}: q_nope differs from x's nope columns`);
          if (!sameBits(b.toArray(qPe), b.toArray(pe))) fail(`${what}: q_pe differs from rope of x's rope columns`);
          cases++;
        }
      }
      const x = track(b.zeros('f32', [T, 40]));
      const invFreq = track(b.zeros('f64', [3]));
      const ok = { x, kvANorm: track(b.zeros('f32', [20])), cacheC: track(b.zeros('f32', [S, 20])), cacheKpe: track(b.zeros('f32', [S, 6])), slots, positions, invFreq, eps: 1e-6 };
      expectThrows('narrow x', () => b.native.mlaInputs({ ...ok, qANorm: track(b.zeros('f32', [16])), qAOut: track(b.zeros('f32', [T, 16])) }), /x must hold \[q_a \(16\) \.\.\. \| c \(20\) \| k_pe \(6\)\] in its 40 columns: at least 42/);
      expectThrows('q_a norm alone', () => b.native.mlaInputs({ ...ok, qANorm: track(b.zeros('f32', [8])) }), /qANorm and qAOut go together/);
      expectThrows('mixed cache dtypes', () => b.native.mlaInputs({ ...ok, cacheKpe: track(b.zeros('bf16', [S, 6])) }), /cacheKpe must be f32, got bf16/);
      expectThrows('short invFreq', () => b.native.mlaInputs({ ...ok, invFreq: track(b.zeros('f64', [2])) }), /invFreq must be \[rope \/ 2\] = \[3\]/);
      expectThrows('slots', () => b.native.mlaInputs({ ...ok, slots: track(b.zeros('i32', [2])) }), /slots must have one entry per row of x \(3\)/);
      expectThrows('query width', () => b.native.mlaQuery({ x, qNope: track(b.zeros('f32', [T, 4, 8])), qPe: track(b.zeros('f32', [T, 4, 6])), positions, invFreq }), /x must hold \[nope of 4 heads \(32\) \| their rope parts \(24\)\] in its 40 columns/);
      expectThrows('query heads', () => b.native.mlaQuery({ x, qNope: track(b.zeros('f32', [T, 2, 8])), qPe: track(b.zeros('f32', [T, 3, 6])), positions, invFreq }), /qNope must be \[T, H, nope\] and qPe \[T, H, rope\]/);
      return { detail: `${cases} cases bit-identical to the unfused ops` };
    });
  },
};

const elementwise: KernelCheck = {
  name: 'silu_mul, add and embedding (bf16 table) vs reference',
  run(b) {
    withTensors(b, (track) => {
      const T = 3;
      const I = 50;
      const x = randomF32(T * 2 * I, 4);
      const out = track(b.empty('f32', [T, I]));
      b.native.siluMul({ x: track(b.fromArray('f32', [T, 2 * I], x)), out });
      const ref = new Float32Array(T * I);
      for (let t = 0; t < T; t++) for (let j = 0; j < I; j++) ref[t * I + j] = silu(x[t * 2 * I + j]) * x[t * 2 * I + I + j];
      expectClose('silu_mul', b.toArray(out) as Float32Array, ref, 1e-6, I);
      const a = randomF32(100, 5);
      const c = randomF32(100, 6);
      const sum = track(b.empty('f32', [100]));
      b.native.add({ a: track(b.fromArray('f32', [100], a)), b: track(b.fromArray('f32', [100], c)), out: sum });
      expectEqual('add', b.toArray(sum) as Float32Array, Float32Array.from(a, (v, i) => Math.fround(v + c[i])));
      const table = f32ArrayToBf16(randomF32(10 * 16, 7));
      const e = track(b.empty('f32', [3, 16]));
      b.native.embedding({ table: track(b.fromArray('bf16', [10, 16], table)), ids: track(b.fromArray('i32', [3], Int32Array.of(9, 0, 4))), out: e });
      const want = new Float32Array(48);
      [9, 0, 4].forEach((id, i) => want.set(bf16ArrayToF32(table.subarray(id * 16, id * 16 + 16)), i * 16));
      expectEqual('embedding', b.toArray(e) as Float32Array, want);
      expectThrows('silu shape', () => b.native.siluMul({ x: track(b.zeros('f32', [3, 7])), out }), /x must be \[T, 2I\] and out \[T, I\]/);
    });
  },
};

const router: KernelCheck = {
  name: 'router: sigmoid, correction bias, group-limited top-k, normalization, scaling vs reference (Kimi K2 384 experts top-8, DeepSeek-V3 8 groups, exact ties to the lower index)',
  run(b) {
    return withTensors(b, (track) => {
      const cases = [
        { E: 64, k: 8, nGroup: 1, topkGroup: 1, norm: true, scaling: 2.827 },
        { E: 32, k: 4, nGroup: 8, topkGroup: 3, norm: true, scaling: 2.5 },
        { E: 16, k: 3, nGroup: 4, topkGroup: 2, norm: false, scaling: 1.5 },
        { E: 384, k: 8, nGroup: 1, topkGroup: 1, norm: true, scaling: 2.827 },
        { E: 256, k: 8, nGroup: 8, topkGroup: 4, norm: true, scaling: 2.5 },
        // logits of three values and no bias: ties between experts and between groups everywhere
        { E: 96, k: 6, nGroup: 4, topkGroup: 2, norm: true, scaling: 1, ties: true },
      ];
      for (const [ci, c] of cases.entries()) {
        const T = 7;
        const logits = 'ties' in c ? randomF32(T * c.E, 10 + ci).map((v) => Math.sign(Math.round(v))) : randomF32(T * c.E, 10 + ci, 2);
        const r = rng(20 + ci);
        const bias = Float32Array.from({ length: c.E }, () => ('ties' in c ? 0 : 0.2 * (r.uniform() - 0.3)));
        const ids = track(b.empty('i32', [T, c.k]));
        const weights = track(b.empty('f32', [T, c.k]));
        b.native.router({ logits: track(b.fromArray('f32', [T, c.E], logits)), bias: track(b.fromArray('f32', [c.E], bias)), ids, weights, topk: c.k, nGroup: c.nGroup, topkGroup: c.topkGroup, normTopkProb: c.norm, scaling: c.scaling });
        const gotIds = b.toArray(ids) as Int32Array;
        const gotW = b.toArray(weights) as Float32Array;
        const config = parseModelConfig({ model_type: 'kimi_k2', n_routed_experts: c.E, num_experts_per_tok: c.k, n_group: c.nGroup, topk_group: c.topkGroup, norm_topk_prob: c.norm, routed_scaling_factor: c.scaling });
        for (let t = 0; t < T; t++) {
          const want = route(config, logits.subarray(t * c.E, (t + 1) * c.E), bias);
          expectEqual(`case ${ci} token ${t} experts`, Array.from(gotIds.subarray(t * c.k, (t + 1) * c.k)), want.experts);
          expectClose(`case ${ci} token ${t} weights`, gotW.subarray(t * c.k, (t + 1) * c.k), want.weights, 1e-6, c.k);
        }
      }
      return { detail: `${cases.length} configurations x 7 tokens: same experts, weights within 1e-6` };
    });
  },
};

const argmaxTopk: KernelCheck = {
  name: 'argmax and top-k: largest first, ties to the lower index (argmax also across the segments of 9003- to 163840-wide rows), k up to 512 of 5000',
  run(b) {
    withTensors(b, (track) => {
      const rows = 3;
      const V = 5000;
      const x = randomF32(rows * V, 30);
      x[2] = 50;
      x[77] = 50; // a tie in row 0: index 2 wins
      for (let i = 0; i < 40; i++) x[V + 1000 + i] = 7; // 40-way tie in row 1
      const xd = track(b.fromArray('f32', [rows, V], x));
      // argmax also on rows cut into many segments: an odd width (no float4 loads), the Kimi K2
      // vocabulary, and the maximum tied across segments (at 4095 and 4096: the lower wins)
      const wide = (n: number, V2: number, seed: number, tie: [number, number]) => {
        const y = randomF32(n * V2, seed);
        for (let r = 0; r < n; r++) y[r * V2 + tie[0] + r] = y[r * V2 + tie[1] - r] = 100;
        return { rows: n, V: V2, x: y };
      };
      for (const c of [{ rows, V, x }, wide(2, 9003, 31, [4095, 8200]), wide(1, 163840, 32, [150001, 160000]), wide(2, 65536, 33, [4095, 4096])]) {
        const out = track(b.empty('i32', [c.rows]));
        b.native.argmax({ x: c.rows === rows && c.V === V ? xd : track(b.fromArray('f32', [c.rows, c.V], c.x)), out });
        const am = b.toArray(out) as Int32Array;
        for (let r = 0; r < c.rows; r++) {
          let best = 0;
          for (let i = 1; i < c.V; i++) if (c.x[r * c.V + i] > c.x[r * c.V + best]) best = i;
          if (am[r] !== best) fail(`argmax of [${c.rows}, ${c.V}] row ${r}: ${am[r]}, expected ${best}`);
        }
      }
      for (const k of [1, 7, 64, 512]) {
        const values = track(b.empty('f32', [rows, k]));
        const ids = track(b.empty('i32', [rows, k]));
        b.native.topk({ x: xd, values, ids, k });
        const gotIds = b.toArray(ids) as Int32Array;
        for (let r = 0; r < rows; r++) {
          const order = Array.from({ length: V }, (_, i) => i).sort((p, q) => x[r * V + q] - x[r * V + p] || p - q).slice(0, k);
          expectEqual(`top-${k} row ${r}`, Array.from(gotIds.subarray(r * k, (r + 1) * k)), order);
        }
      }
      expectThrows('k > V', () => b.native.topk({ x: xd, values: track(b.zeros('f32', [rows, 6000])), ids: track(b.zeros('i32', [rows, 6000])), k: 6000 }), /k = 6000 must be in \[1, 5000\]/);
    });
  },
};

/**
 * Top-k over a Kimi K2 vocabulary row (163840 logits: on cuda, 20 segments of 8192 reduced to
 * candidates, then the candidates): few distinct values, so the k-th value is tied across segment
 * boundaries, and equal maxima straddle one; ties must still go to the lowest indices.
 */
const vocabTopk: KernelCheck = {
  name: 'top-k over a 163840-logit row (segmented on cuda; up to 512 candidates sorted in one block, more by a second radix select): many ties across segments, k up to 1024',
  run(b) {
    withTensors(b, (track) => {
      const [rows, V] = [2, 163840];
      const x = randomF32(rows * V, 41).map((v) => Math.round(v * 8) / 4);
      for (const i of [8191, 8192, 16383, 16384, 163839]) x[i] = 20; // row 0: the maximum, at segment edges
      const xd = track(b.fromArray('f32', [rows, V], x));
      const orders = Array.from({ length: rows }, (_, r) =>
        Int32Array.from({ length: V }, (_, i) => i).sort((p, q) => x[r * V + q] - x[r * V + p] || p - q),
      );
      for (const k of [1, 5, 25, 64, 300, 1024]) {
        const values = track(b.empty('f32', [rows, k]));
        const ids = track(b.empty('i32', [rows, k]));
        b.native.topk({ x: xd, values, ids, k });
        const gotIds = b.toArray(ids) as Int32Array;
        const gotValues = b.toArray(values) as Float32Array;
        for (let r = 0; r < rows; r++) {
          const want = Array.from(orders[r].subarray(0, k));
          expectEqual(`top-${k} row ${r} ids`, Array.from(gotIds.subarray(r * k, (r + 1) * k)), want);
          expectEqual(`top-${k} row ${r} values`, Array.from(gotValues.subarray(r * k, (r + 1) * k)), want.map((i) => x[r * V + i]));
        }
      }
    });
  },
};

export const OPS_CHECKS: KernelCheck[] = [rmsNormCheck, fusedResidualNorm, ropeCheck, mlaInputsQuery, elementwise, router, argmaxTopk, vocabTopk];
