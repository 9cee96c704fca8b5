/** MLA attention over the latent cache (with kv_write) against @kdtree/reference latentAttention. */
import { bf16ArrayToF32, f32ArrayToBf16 } from '@kdtree/format';
import { latentAttention } from '@kdtree/reference';
import type { DeviceTensor, KdtreeBackend } from '../backend.js';
import { expectClose, expectEqual, expectThrows, fail, randomF32, rng, sameBits, withTensors, type KernelCheck } from './harness.js';

const H = 3;
const NOPE = 16;
const ROPE = 8;
const V = 12;
const R = 32;
const S = 40;
const SCALE = 0.31;
/**
 * Rope widths the attention checks run with: 8, and 6, which is not a multiple of 4, so the CUDA
 * kernel's small tiles cannot copy whole chunks in 16-byte pieces and take the staged form.
 */
const ROPES = [ROPE, 6];
/** Shapes of the reference check: the above, and a rank that is not a multiple of 8 (the CUDA merge reads kv_b rows value by value). */
const SHAPES = [...ROPES.map((rope) => ({ rope, rank: R })), { rope: ROPE, rank: 36 }];

/** The [T, T] ancestor mask of a tree given by its parents (-1 for the root): row i sees i and its ancestors. */
function ancestorMask(parents: readonly number[]): Uint8Array {
  const T = parents.length;
  const mask = new Uint8Array(T * T);
  for (let i = 0; i < T; i++) for (let j = i; j >= 0; j = parents[j]) mask[i * T + j] = 1;
  return mask;
}

/** A 7-node tree: 0 root, 1 and 2 children of 0, 3 child of 1, 4 child of 3, 5 child of 2, 6 child of 0. */
const TREE7 = ancestorMask([-1, 0, 0, 1, 3, 2, 0]);

interface Setup {
  rope: number;
  rank: number;
  qNope: Float32Array;
  qPe: Float32Array;
  kvB: Float32Array;
  cacheC: Float32Array;
  cacheKpe: Float32Array;
}

function setup(seed: number, T: number, rope = ROPE, rank = R): Setup {
  return {
    rope,
    rank,
    qNope: randomF32(T * H * NOPE, seed),
    qPe: randomF32(T * H * rope, seed + 1),
    kvB: randomF32(H * (NOPE + V) * rank, seed + 2, 0.2),
    cacheC: randomF32(S * rank, seed + 3),
    cacheKpe: randomF32(S * rope, seed + 4),
  };
}

/** The reference's q layout: [T, H, nope + rope]. */
function joinQ(s: Setup, T: number): Float32Array {
  const q = new Float32Array(T * H * (NOPE + s.rope));
  for (let th = 0; th < T * H; th++) {
    q.set(s.qNope.subarray(th * NOPE, (th + 1) * NOPE), th * (NOPE + s.rope));
    q.set(s.qPe.subarray(th * s.rope, (th + 1) * s.rope), th * (NOPE + s.rope) + NOPE);
  }
  return q;
}

type CacheDtype = 'f32' | 'bf16';
const CACHES: CacheDtype[] = ['f32', 'bf16'];

/** A latent cache tensor of `values` in f32 or bf16 (rounded to nearest even). */
function cacheTensor(b: KdtreeBackend, dtype: CacheDtype, shape: number[], values: Float32Array): DeviceTensor {
  return dtype === 'bf16' ? b.fromArray('bf16', shape, f32ArrayToBf16(values)) : b.fromArray('f32', shape, values);
}

/** The values a bf16 cache holds: every value rounded to bf16 and back. */
function bf16Values(values: Float32Array): Float32Array {
  return bf16ArrayToF32(f32ArrayToBf16(values));
}

function run(b: KdtreeBackend, track: <U extends DeviceTensor>(t: U) => U, s: Setup, T: number, base: number, mask?: Uint8Array, cache: CacheDtype = 'f32'): Float32Array {
  const out = track(b.empty('f32', [T, H, V]));
  b.native.mlaAttention({
    qNope: track(b.fromArray('f32', [T, H, NOPE], s.qNope)),
    qPe: track(b.fromArray('f32', [T, H, s.rope], s.qPe)),
    kvB: track(b.fromArray('f32', [H * (NOPE + V), s.rank], s.kvB)),
    cacheC: track(cacheTensor(b, cache, [S, s.rank], s.cacheC)),
    cacheKpe: track(cacheTensor(b, cache, [S, s.rope], s.cacheKpe)),
    mask: mask ? track(b.fromArray('u8', [T, T], mask)) : undefined,
    out,
    base,
    scale: SCALE,
  });
  return b.toArray(out) as Float32Array;
}

function reference(s: Setup, T: number, base: number, attends?: (i: number, j: number) => boolean): Float32Array {
  return latentAttention({ q: joinQ(s, T), kvB: s.kvB, cacheC: s.cacheC, cacheKpe: s.cacheKpe, base, tokens: T, heads: H, nope: NOPE, rope: s.rope, v: V, rank: s.rank, scale: SCALE, attends });
}

/**
 * Decode, causal prefill and tree verify vs the reference, over a cache of `cache` dtype. A bf16
 * cache (half the bytes) holds bf16-rounded values, and the outputs must match the reference over
 * those values to the f32 tolerance: on cuda such a cache runs on tensor cores (exact bf16 keys, q
 * and p split into three bf16 planes) where its rows are whole 8-byte pieces, and on the CUDA-core
 * tiles otherwise (rope 6).
 */
function referenceCheck(cache: CacheDtype, name: string): KernelCheck {
  return {
    name,
    run(b) {
      return withTensors(b, (track) => {
        const details: string[] = [];
        const rounded = (s: Setup): Setup => (cache === 'bf16' ? { ...s, cacheC: bf16Values(s.cacheC), cacheKpe: bf16Values(s.cacheKpe) } : s);
        for (const { rope, rank } of SHAPES) {
          const at = `rope ${rope} rank ${rank}`;
          const s1 = rounded(setup(1, 1, rope, rank));
          details.push(expectClose(`${at} decode base 20`, run(b, track, s1, 1, 20, undefined, cache), reference(s1, 1, 20), 1e-5, V));
          const s7 = rounded(setup(2, 7, rope, rank));
          details.push(expectClose(`${at} prefill base 0`, run(b, track, s7, 7, 0, undefined, cache), reference(s7, 7, 0), 1e-5, V));
          details.push(expectClose(`${at} prefill base 9`, run(b, track, s7, 7, 9, undefined, cache), reference(s7, 7, 9), 1e-5, V));
          details.push(expectClose(`${at} tree base 11`, run(b, track, s7, 7, 11, TREE7, cache), reference(s7, 7, 11, (i, j) => TREE7[i * 7 + j] === 1), 1e-5, V));
        }
        return { detail: details.join('; ') };
      });
    },
  };
}

const decodePrefillTree = referenceCheck('f32', 'mla_attention: decode (T=1), causal prefill (T=7) and tree verify (ancestor mask) vs reference (rope 8 and 6, rank 32 and 36)');
const bf16Cache = referenceCheck('bf16', 'mla_attention with a bf16 cache vs reference over its values (decode, causal prefill, tree verify; rope 8 and 6, rank 32 and 36)');

/** A token's output depends only on the keys it sees: prefill row t == decode with t more committed. */
const invariance: KernelCheck = {
  name: 'mla_attention: batch invariance (row t of a causal prefill == decoding that token over the same keys, bit for bit; f32 and bf16 cache)',
  run(b) {
    for (const cache of CACHES) withTensors(b, (track) => {
      const s = setup(5, 6);
      const all = run(b, track, s, 6, 4, undefined, cache);
      for (const t of [0, 3, 5]) {
        const one: Setup = { ...s, qNope: s.qNope.subarray(t * H * NOPE, (t + 1) * H * NOPE), qPe: s.qPe.subarray(t * H * ROPE, (t + 1) * H * ROPE) };
        const single = run(b, track, one, 1, 4 + t, undefined, cache);
        if (!sameBits(single, all.subarray(t * H * V, (t + 1) * H * V))) fail(`${cache} cache, token ${t}: prefill row differs from its decode step`);
      }
    });
  },
};

/**
 * Long causal prefills: 703 tokens (2109 rows at 3 heads) and 130. On cuda the merge of a long call
 * takes blocks of several tokens of a head (each W_vb row read once for them; 4 at 703 tokens on
 * up to 132 SMs, the last block 3), and with a bf16 kv_b the q absorption runs on tensor cores in
 * blocks of 32 tokens (703) or 16 (130): paths that shorter calls do not reach. Against the
 * reference, and sampled rows (both ends of blocks) == decoding that token; f32 and bf16 caches and
 * kv_b.
 */
const longPrefill: KernelCheck = {
  name: 'mla_attention: 703- and 130-token causal prefills vs reference, sampled rows == decode bit for bit (f32 and bf16 cache and kv_b)',
  run(b) {
    return withTensors(b, (track) => {
      const slots = 720;
      const details: string[] = [];
      const cases: [number, CacheDtype, CacheDtype][] = [
        [703, 'f32', 'f32'],
        [703, 'bf16', 'f32'],
        [703, 'f32', 'bf16'],
        [703, 'bf16', 'bf16'],
        [130, 'f32', 'bf16'],
      ];
      for (const [T, cache, kvb] of cases) {
        const s0: Setup = { ...setup(81, T), cacheC: randomF32(slots * R, 84), cacheKpe: randomF32(slots * ROPE, 85) };
        const s: Setup = {
          ...s0,
          cacheC: cache === 'bf16' ? bf16Values(s0.cacheC) : s0.cacheC,
          cacheKpe: cache === 'bf16' ? bf16Values(s0.cacheKpe) : s0.cacheKpe,
          kvB: kvb === 'bf16' ? bf16Values(s0.kvB) : s0.kvB,
        };
        const kvB = track(kvb === 'bf16' ? b.fromArray('bf16', [H * (NOPE + V), R], f32ArrayToBf16(s.kvB)) : b.fromArray('f32', [H * (NOPE + V), R], s.kvB));
        const call = (tokens: number, base: number, qNope: Float32Array, qPe: Float32Array) => {
          const out = track(b.empty('f32', [tokens, H, V]));
          b.native.mlaAttention({
            qNope: track(b.fromArray('f32', [tokens, H, NOPE], qNope)),
            qPe: track(b.fromArray('f32', [tokens, H, ROPE], qPe)),
            kvB,
            cacheC: track(cacheTensor(b, cache, [slots, R], s.cacheC)),
            cacheKpe: track(cacheTensor(b, cache, [slots, ROPE], s.cacheKpe)),
            out,
            base,
            scale: SCALE,
          });
          return b.toArray(out) as Float32Array;
        };
        const at = `${T} tokens, ${cache} cache, ${kvb} kv_b`;
        const all = call(T, 0, s.qNope, s.qPe);
        details.push(expectClose(at, all, latentAttention({ q: joinQ(s, T), kvB: s.kvB, cacheC: s.cacheC, cacheKpe: s.cacheKpe, base: 0, tokens: T, heads: H, nope: NOPE, rope: ROPE, v: V, rank: R, scale: SCALE }), 1e-5, V));
        for (const t of [0, 1, 3, 4, 7, 8, 15, 16, 31, 32, 127, 128, 129, 351, 699, 700, 702].filter((t) => t < T)) {
          const one = call(1, t, s.qNope.subarray(t * H * NOPE, (t + 1) * H * NOPE), s.qPe.subarray(t * H * ROPE, (t + 1) * H * ROPE));
          if (!sameBits(one, all.subarray(t * H * V, (t + 1) * H * V))) fail(`${at}, token ${t}: prefill row differs from its decode step`);
        }
      }
      return { detail: details.join('; ') };
    });
  },
};

/**
 * The cache a tree node is decoded over after DDTree commits its path: the `base` committed slots,
 * then the node's ancestors and itself (mask row `node`, in order) compacted after them. Returns
 * the latent and rope caches and how many new keys the node sees.
 */
function committedPath(cacheC: Float32Array, cacheKpe: Float32Array, rank: number, rope: number, base: number, mask: Uint8Array, T: number, node: number) {
  const seen = [...Array(T).keys()].filter((j) => mask[node * T + j] === 1);
  const c = cacheC.slice();
  const kpe = cacheKpe.slice();
  seen.forEach((j, k) => {
    c.set(cacheC.subarray((base + j) * rank, (base + j + 1) * rank), (base + k) * rank);
    kpe.set(cacheKpe.subarray((base + j) * rope, (base + j + 1) * rope), (base + k) * rope);
  });
  return { c, kpe, keys: seen.length };
}

/**
 * DDTree's guarantee: a tree node's verify output equals decoding that node after its ancestors were
 * committed, bit for bit. 134 committed keys (chunks of 64: two inside the prefix, one holding its
 * end and the new tokens) and a 7-node tree; each node is then decoded over a cache holding the
 * prefix, its ancestors compacted after it, and itself.
 */
const treeEqualsDecode: KernelCheck = {
  name: 'mla_attention: a tree-verify row == decoding that node over its committed ancestors, bit for bit (keys across 3 chunks; rope 8 and 6; f32 and bf16 cache)',
  run(b) {
    for (const cache of CACHES) for (const rope of ROPES) withTensors(b, (track) => {
      const [T, base, slots] = [7, 134, 160];
      const mask = TREE7;
      const q = { nope: randomF32(T * H * NOPE, 31), pe: randomF32(T * H * rope, 32) };
      const kvB = randomF32(H * (NOPE + V) * R, 33, 0.2);
      const cacheC = randomF32(slots * R, 34);
      const cacheKpe = randomF32(slots * rope, 35);
      const call = (tokens: number, start: number, c: Float32Array, kpe: Float32Array, nope: Float32Array, pe: Float32Array, m?: Uint8Array) => {
        const out = track(b.empty('f32', [tokens, H, V]));
        b.native.mlaAttention({
          qNope: track(b.fromArray('f32', [tokens, H, NOPE], nope)),
          qPe: track(b.fromArray('f32', [tokens, H, rope], pe)),
          kvB: track(b.fromArray('f32', [H * (NOPE + V), R], kvB)),
          cacheC: track(cacheTensor(b, cache, [slots, R], c)),
          cacheKpe: track(cacheTensor(b, cache, [slots, rope], kpe)),
          mask: m ? track(b.fromArray('u8', [tokens, tokens], m)) : undefined,
          out,
          base: start,
          scale: SCALE,
        });
        return b.toArray(out) as Float32Array;
      };
      const verify = call(T, base, cacheC, cacheKpe, q.nope, q.pe, mask);
      for (let i = 0; i < T; i++) {
        const { c, kpe, keys } = committedPath(cacheC, cacheKpe, R, rope, base, mask, T, i);
        const decoded = call(1, base + keys - 1, c, kpe, q.nope.subarray(i * H * NOPE, (i + 1) * H * NOPE), q.pe.subarray(i * H * rope, (i + 1) * H * rope));
        if (!sameBits(decoded, verify.subarray(i * H * V, (i + 1) * H * V))) fail(`${cache} cache, rope ${rope}, node ${i}: tree-verify row differs from decoding it over its committed ancestors`);
      }
    });
  },
};

/**
 * One tensor-parallel rank of Kimi K2 (8 heads, nope 128, rope 64, v 128, rank 512, kv_b in bf16):
 * the dims the kernels are tuned for (on cuda: the whole-chunk small tiles at 211 KB of shared
 * memory, the 64-row tiles, the merge reading bf16 W_vb rows 8 values per load), which the small
 * checks above do not reach. Decode over 300 keys (5 chunks, the last partial), 9- and 17-node tree
 * verifies after 200 committed keys and causal prefills vs the reference, and each of their rows ==
 * decoding that token over the keys it sees, bit for bit; with a bf16 cache (on cuda the
 * tensor-core kernel: 32-row tiles of the prefill, one token's heads per tile of the tree) a
 * decode, the 9-node tree and the 41-token prefill the same way.
 */
const kimiRank: KernelCheck = {
  name: "mla_attention at Kimi K2's per-rank dims (8 heads, rank 512 + rope 64, bf16 kv_b): decode, 9- and 17-node tree verifies and 2-, 9- and 41-token prefills vs reference, their rows == decode; a bf16 cache likewise",
  run(b) {
    return withTensors(b, (track) => {
      const [h, nope, rope, v, rank, slots, scale] = [8, 128, 64, 128, 512, 320, 1 / Math.sqrt(192)];
      const kvB = bf16ArrayToF32(f32ArrayToBf16(randomF32(h * (nope + v) * rank, 41, 0.05)));
      const cacheC = randomF32(slots * rank, 42);
      const cacheKpe = randomF32(slots * rope, 43);
      const kvBDevice = track(b.fromArray('bf16', [h * (nope + v), rank], f32ArrayToBf16(kvB)));
      const call = (tokens: number, base: number, qNope: Float32Array, qPe: Float32Array, c: Float32Array, kpe: Float32Array, mask?: Uint8Array, cache: CacheDtype = 'f32') => {
        const out = track(b.empty('f32', [tokens, h, v]));
        b.native.mlaAttention({
          qNope: track(b.fromArray('f32', [tokens, h, nope], qNope)),
          qPe: track(b.fromArray('f32', [tokens, h, rope], qPe)),
          kvB: kvBDevice,
          cacheC: track(cacheTensor(b, cache, [slots, rank], c)),
          cacheKpe: track(cacheTensor(b, cache, [slots, rope], kpe)),
          mask: mask ? track(b.fromArray('u8', [tokens, tokens], mask)) : undefined,
          out,
          base,
          scale,
        });
        return b.toArray(out) as Float32Array;
      };
      // the reference's q layout: [T, h, nope + rope]
      const joinQRows = (tokens: number, qNope: Float32Array, qPe: Float32Array) => {
        const q = new Float32Array(tokens * h * (nope + rope));
        for (let th = 0; th < tokens * h; th++) {
          q.set(qNope.subarray(th * nope, (th + 1) * nope), th * (nope + rope));
          q.set(qPe.subarray(th * rope, (th + 1) * rope), th * (nope + rope) + nope);
        }
        return q;
      };
      const reference = (tokens: number, base: number, qNope: Float32Array, qPe: Float32Array, attends?: (i: number, j: number) => boolean) =>
        latentAttention({ q: joinQRows(tokens, qNope, qPe), kvB, cacheC, cacheKpe, base, tokens, heads: h, nope, rope, v, rank, scale, attends });
      const details: string[] = [];
      const d = { nope: randomF32(h * nope, 44), pe: randomF32(h * rope, 45) };
      details.push(expectClose('decode base 299', call(1, 299, d.nope, d.pe, cacheC, cacheKpe), reference(1, 299, d.nope, d.pe), 1e-5, v));
      // 9 nodes x 8 heads = 72 rows merge like a decode (two kernels), 17 x 8 = 136 in one block per
      // row: both must give a node the bits of decoding it
      const trees = [
        [-1, 0, 0, 1, 1, 2, 3, 4, 5],
        [-1, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15],
      ];
      trees.forEach((parents, n) => {
        const [T, base] = [parents.length, 200];
        const mask = ancestorMask(parents);
        const t = { nope: randomF32(T * h * nope, 46 + 2 * n), pe: randomF32(T * h * rope, 47 + 2 * n) };
        const verify = call(T, base, t.nope, t.pe, cacheC, cacheKpe, mask);
        details.push(expectClose(`${T}-node tree base ${base}`, verify, reference(T, base, t.nope, t.pe, (i, j) => mask[i * T + j] === 1), 1e-5, v));
        for (let i = 0; i < T; i++) {
          const { c, kpe, keys } = committedPath(cacheC, cacheKpe, rank, rope, base, mask, T, i);
          const decoded = call(1, base + keys - 1, t.nope.subarray(i * h * nope, (i + 1) * h * nope), t.pe.subarray(i * h * rope, (i + 1) * h * rope), c, kpe);
          if (!sameBits(decoded, verify.subarray(i * h * v, (i + 1) * h * v))) fail(`${T}-node tree, node ${i}: tree-verify row differs from decoding it over its committed ancestors`);
        }
      });
      // causal prefill: 2 tokens (16 rows, one small tile), 9 (72 rows in small tiles) and 41 (328
      // rows: on cuda five 64-row tiles and 8 rows in a small tile); token i's row must be decoding
      // it over the slots before it
      [2, 9, 41].forEach((T, n) => {
        const base = 200;
        const t = { nope: randomF32(T * h * nope, 60 + 2 * n), pe: randomF32(T * h * rope, 61 + 2 * n) };
        const prefill = call(T, base, t.nope, t.pe, cacheC, cacheKpe);
        details.push(expectClose(`${T}-token prefill base ${base}`, prefill, reference(T, base, t.nope, t.pe), 1e-5, v));
        for (let i = 0; i < T; i++) {
          const decoded = call(1, base + i, t.nope.subarray(i * h * nope, (i + 1) * h * nope), t.pe.subarray(i * h * rope, (i + 1) * h * rope), cacheC, cacheKpe);
          if (!sameBits(decoded, prefill.subarray(i * h * v, (i + 1) * h * v))) fail(`${T}-token prefill, token ${i}: row differs from decoding it`);
        }
      });
      // a bf16 cache (on cuda: the tensor-core kernel, whose tile sizes differ from the f32 ones):
      // vs reference over its values, and every row == decoding that token over the keys it sees
      const c16 = bf16Values(cacheC), kpe16 = bf16Values(cacheKpe);
      const reference16 = (tokens: number, base: number, qNope: Float32Array, qPe: Float32Array, attends?: (i: number, j: number) => boolean) =>
        latentAttention({ q: joinQRows(tokens, qNope, qPe), kvB, cacheC: c16, cacheKpe: kpe16, base, tokens, heads: h, nope, rope, v, rank, scale, attends });
      const tree = ancestorMask(trees[0]);
      const q41 = { nope: randomF32(41 * h * nope, 70), pe: randomF32(41 * h * rope, 71) };
      const decode16 = call(1, 299, d.nope, d.pe, c16, kpe16, undefined, 'bf16');
      details.push(expectClose('bf16 cache decode base 299', decode16, reference16(1, 299, d.nope, d.pe), 1e-5, v));
      const tq = { nope: q41.nope.subarray(0, 9 * h * nope), pe: q41.pe.subarray(0, 9 * h * rope) };
      const verify16 = call(9, 200, tq.nope, tq.pe, c16, kpe16, tree, 'bf16');
      details.push(expectClose('bf16 cache 9-node tree base 200', verify16, reference16(9, 200, tq.nope, tq.pe, (i, j) => tree[i * 9 + j] === 1), 1e-5, v));
      for (let i = 0; i < 9; i++) {
        const { c, kpe, keys } = committedPath(c16, kpe16, rank, rope, 200, tree, 9, i);
        const decoded = call(1, 200 + keys - 1, tq.nope.subarray(i * h * nope, (i + 1) * h * nope), tq.pe.subarray(i * h * rope, (i + 1) * h * rope), c, kpe, undefined, 'bf16');
        if (!sameBits(decoded, verify16.subarray(i * h * v, (i + 1) * h * v))) fail(`bf16 cache, 9-node tree, node ${i}: tree-verify row differs from decoding it over its committed ancestors`);
      }
      const prefill16 = call(41, 200, q41.nope, q41.pe, c16, kpe16, undefined, 'bf16');
      details.push(expectClose('bf16 cache 41-token prefill base 200', prefill16, reference16(41, 200, q41.nope, q41.pe), 1e-5, v));
      for (let i = 0; i < 41; i++) {
        const decoded = call(1, 200 + i, q41.nope.subarray(i * h * nope, (i + 1) * h * nope), q41.pe.subarray(i * h * rope, (i + 1) * h * rope), c16, kpe16, undefined, 'bf16');
        if (!sameBits(decoded, prefill16.subarray(i * h * v, (i + 1) * h * v))) fail(`bf16 cache, 41-token prefill, token ${i}: row differs from decoding it`);
      }
      return { detail: details.join('; ') };
    });
  },
};

const kvWrite: KernelCheck = {
  name: 'kv_write: rows land in their slots (f32, and bf16 rounded to nearest even); bad slots and mixed cache dtypes are rejected',
  run(b) {
    withTensors(b, (track) => {
      const c = randomF32(3 * R, 8);
      const kpe = randomF32(3 * ROPE, 9);
      const cacheC = track(b.zeros('f32', [S, R]));
      const cacheKpe = track(b.zeros('f32', [S, ROPE]));
      b.native.kvWrite({ c: track(b.fromArray('f32', [3, R], c)), kpe: track(b.fromArray('f32', [3, ROPE], kpe)), cacheC, cacheKpe, slots: track(b.fromArray('i32', [3], Int32Array.of(7, 2, 39))) });
      const gotC = b.toArray(cacheC) as Float32Array;
      const gotK = b.toArray(cacheKpe) as Float32Array;
      [7, 2, 39].forEach((slot, i) => {
        if (!sameBits(gotC.subarray(slot * R, (slot + 1) * R), c.subarray(i * R, (i + 1) * R))) fail(`slot ${slot} latent`);
        if (!sameBits(gotK.subarray(slot * ROPE, (slot + 1) * ROPE), kpe.subarray(i * ROPE, (i + 1) * ROPE))) fail(`slot ${slot} rope key`);
      });
      expectThrows('rows', () => b.native.kvWrite({ c: track(b.zeros('f32', [3, R])), kpe: track(b.zeros('f32', [2, ROPE])), cacheC, cacheKpe, slots: track(b.zeros('i32', [3])) }), /one row per token/);
      // a bf16 cache: each value rounded to nearest even, bit-exact with @kdtree/format
      const c16 = track(b.zeros('bf16', [S, R]));
      const kpe16 = track(b.zeros('bf16', [S, ROPE]));
      b.native.kvWrite({ c: track(b.fromArray('f32', [3, R], c)), kpe: track(b.fromArray('f32', [3, ROPE], kpe)), cacheC: c16, cacheKpe: kpe16, slots: track(b.fromArray('i32', [3], Int32Array.of(7, 2, 39))) });
      const got16 = { c: b.toArray(c16) as Uint16Array, kpe: b.toArray(kpe16) as Uint16Array };
      const want16 = { c: f32ArrayToBf16(c), kpe: f32ArrayToBf16(kpe) };
      [7, 2, 39].forEach((slot, i) => {
        expectEqual(`bf16 slot ${slot} latent`, Array.from(got16.c.subarray(slot * R, (slot + 1) * R)), Array.from(want16.c.subarray(i * R, (i + 1) * R)));
        expectEqual(`bf16 slot ${slot} rope key`, Array.from(got16.kpe.subarray(slot * ROPE, (slot + 1) * ROPE)), Array.from(want16.kpe.subarray(i * ROPE, (i + 1) * ROPE)));
      });
      expectThrows('mixed cache dtypes', () => b.native.kvWrite({ c: track(b.zeros('f32', [3, R])), kpe: track(b.zeros('f32', [3, ROPE])), cacheC: c16, cacheKpe, slots: track(b.zeros('i32', [3])) }), /cacheKpe must be bf16, got f32/);
      // rows as wide as a hidden state (the held taps): a row split over many blocks (its two parts
      // meeting inside a block), and rows wider than the most blocks a row gets (each thread then
      // writes several values), odd widths; f32 and bf16 (rounded to nearest even) buffers
      for (const [wide, second] of [[7168, 7168], [20001, 37], [300, 5]]) {
        const x = randomF32(2 * wide, 10);
        const y = randomF32(2 * second, 11);
        const slots = Int32Array.of(4, 1);
        for (const dtype of ['f32', 'bf16'] as const) {
          const intoX = track(b.zeros(dtype, [5, wide]));
          const intoY = track(b.zeros(dtype, [5, second]));
          b.native.kvWrite({ c: track(b.fromArray('f32', [2, wide], x)), kpe: track(b.fromArray('f32', [2, second], y)), cacheC: intoX, cacheKpe: intoY, slots: track(b.fromArray('i32', [2], slots)) });
          const bits = (t: DeviceTensor) => (dtype === 'f32' ? new Uint32Array((b.toArray(t) as Float32Array).buffer) : (b.toArray(t) as Uint16Array));
          const want = (v: Float32Array) => (dtype === 'f32' ? new Uint32Array(Float32Array.from(v).buffer) : f32ArrayToBf16(v));
          for (const [name, got, src, width] of [['first', bits(intoX), x, wide], ['second', bits(intoY), y, second]] as const) {
            for (let slot = 0; slot < 5; slot++) {
              const i = slots.indexOf(slot);
              const row = Array.from(got.subarray(slot * width, (slot + 1) * width));
              if (i < 0) expectEqual(`${dtype} width ${wide}: ${name} row of slot ${slot} (not named) stays zero`, row, Array(width).fill(0));
              else expectEqual(`${dtype} width ${wide}: ${name} row of slot ${slot}`, row, Array.from(want(src.subarray(i * width, (i + 1) * width))));
            }
          }
        }
      }
    });
  },
};

/**
 * The committed slots read on the device (baseOnDevice, with `base` as their bound) give the bits of
 * the same call with that value as `base`, on every path: f32 cache (CUDA-core tiles) and bf16 cache
 * (tensor cores), decode, causal prefill and tree verifies whose committed prefix ends inside a
 * chunk, on a chunk edge or before the first; 8 heads (small per-token tiles) and 32 (64-row ones).
 * On tensor cores a tree with the slots on the device runs its committed prefix's tiles and its
 * tokens' tiles in one launch, the host-given call in two: the bits must not tell them apart (the
 * 3-node tree takes one-group tiles for both parts, the others two-group shared tiles).
 * Out-of-bound values are clamped by the GPU kernels and rejected by the cpu backend.
 */
const deviceBase: KernelCheck = {
  name: 'mla_attention: the committed slots read on the device (baseOnDevice, bounded by base) == the same call with that base, bit for bit (f32 and bf16 cache; decode, prefill, 3-, 17- and 37-node trees; bases 0, 63, 130, 201; 8 and 32 heads); out-of-bound values clamped (cuda) or rejected (cpu)',
  run(b) {
    return withTensors(b, (track) => {
      const dims = [
        { h: 8, nope: 128, rope: 64, v: 128, rank: 512, slots: 320 },
        { h: 32, nope: 16, rope: 8, v: 16, rank: 64, slots: 260 },
      ];
      const bases = [0, 63, 130, 201];
      let calls = 0;
      for (const [di, dm] of dims.entries()) {
        const { h, nope, rope, v, rank, slots } = dm;
        const kvB = track(b.fromArray('bf16', [h * (nope + v), rank], f32ArrayToBf16(randomF32(h * (nope + v) * rank, 110 + di, 0.05))));
        const cases = di === 0 ? [{ T: 1 }, { T: 5 }, { T: 3, tree: true }, { T: 17, tree: true }, { T: 37, tree: true }] : [{ T: 1 }, { T: 9, tree: true }];
        for (const cache of CACHES) {
          const cacheC = track(cacheTensor(b, cache, [slots, rank], randomF32(slots * rank, 112 + di)));
          const cacheKpe = track(cacheTensor(b, cache, [slots, rope], randomF32(slots * rope, 113 + di)));
          for (const { T, tree } of cases) {
            const r = rng(120 + T);
            const mask = tree ? track(b.fromArray('u8', [T, T], ancestorMask(Array.from({ length: T }, (_, i) => (i === 0 ? -1 : Math.floor(r.uniform() * i)))))) : undefined;
            const args = {
              qNope: track(b.fromArray('f32', [T, h, nope], randomF32(T * h * nope, 130 + T))),
              qPe: track(b.fromArray('f32', [T, h, rope], randomF32(T * h * rope, 131 + T))),
              kvB,
              cacheC,
              cacheKpe,
              mask,
              scale: 1 / Math.sqrt(nope + rope),
            };
            const bound = slots - T;
            const attend = (base: number, committed?: number) => {
              const out = track(b.empty('f32', [T, h, v]));
              const baseOnDevice = committed === undefined ? undefined : track(b.fromArray('i32', [1], Int32Array.of(committed)));
              b.native.mlaAttention({ ...args, out, base, baseOnDevice });
              calls++;
              return b.toArray(out) as Float32Array;
            };
            const what = `${h} heads, ${cache} cache, T ${T}${tree ? ' (tree)' : ''}`;
            for (const base of bases) {
              if (!sameBits(attend(bound, base), attend(base))) fail(`${what}: base ${base} read on the device (bound ${bound}) differs from the same call with base ${base}`);
            }
            if (di === 0 && T === 17) {
              if (b.kind === 'cuda') {
                if (!sameBits(attend(bound, bound + 3), attend(bound))) fail(`${what}: a device base past the bound is not clamped to it`);
                if (!sameBits(attend(bound, -5), attend(0))) fail(`${what}: a negative device base is not clamped to 0`);
              } else {
                expectThrows('device base past its bound', () => attend(bound, bound + 3), new RegExp(`baseOnDevice holds ${bound + 3}, outside \\[0, base = ${bound}\\]`));
              }
            }
          }
        }
      }
      const one = track(b.zeros('f32', [1, H, NOPE]));
      const small = { qNope: one, qPe: track(b.zeros('f32', [1, H, ROPE])), kvB: track(b.zeros('f32', [H * (NOPE + V), R])), cacheC: track(b.zeros('f32', [S, R])), cacheKpe: track(b.zeros('f32', [S, ROPE])), out: track(b.zeros('f32', [1, H, V])), scale: 0.5 };
      expectThrows('device base shape', () => b.native.mlaAttention({ ...small, base: 3, baseOnDevice: track(b.zeros('i32', [2])) }), /mla_attention\(.*baseOnDevice: i32 \[2\]\): baseOnDevice must be \[1\], got \[2\]/);
      expectThrows('device base dtype', () => b.native.mlaAttention({ ...small, base: 3, baseOnDevice: track(b.zeros('f32', [1])) }), /baseOnDevice must be i32, got f32/);
      expectThrows('bound past the cache', () => b.native.mlaAttention({ ...small, base: 40, baseOnDevice: track(b.zeros('i32', [1])) }), /base \(the bound of baseOnDevice\) 40 \+ T 1 new tokens exceed the cache's 40 slots/);
      return { detail: `${calls} calls, every device base equal to its host call` };
    });
  },
};

const shapeErrors: KernelCheck = {
  name: 'mla_attention rejects inconsistent shapes, a too-small cache and bad masks',
  run(b) {
    withTensors(b, (track) => {
      const args = {
        qNope: track(b.zeros('f32', [2, H, NOPE])),
        qPe: track(b.zeros('f32', [2, H, ROPE])),
        kvB: track(b.zeros('f32', [H * (NOPE + V), R])),
        cacheC: track(b.zeros('f32', [S, R])),
        cacheKpe: track(b.zeros('f32', [S, ROPE])),
        out: track(b.zeros('f32', [2, H, V])),
        base: 3,
        scale: 0.5,
      };
      b.native.mlaAttention(args);
      expectThrows('cache overflow', () => b.native.mlaAttention({ ...args, base: 39 }), /base 39 \+ T 2 new tokens exceed the cache's 40 slots/);
      expectThrows('kv_b', () => b.native.mlaAttention({ ...args, kvB: track(b.zeros('f32', [H * NOPE, R])) }), /kv_b must be \[H \* \(nope \+ v\), R\] = \[84, 32\]/);
      expectThrows('mask', () => b.native.mlaAttention({ ...args, mask: track(b.zeros('u8', [3, 3])) }), /mask must be \[T, T\] = \[2, 2\]/);
      expectThrows('scale', () => b.native.mlaAttention({ ...args, scale: 0 }), /scale must be positive/);
      expectThrows('mixed cache dtypes', () => b.native.mlaAttention({ ...args, cacheC: track(b.zeros('bf16', [S, R])) }), /cacheKpe must be bf16, got f32/);
      expectThrows('cache dtype', () => b.native.mlaAttention({ ...args, cacheC: track(b.zeros('f16', [S, R])), cacheKpe: track(b.zeros('f16', [S, ROPE])) }), /cacheC must be f32 or bf16, got f16/);
    });
  },
};

/**
 * A bf16 `out` (the o_proj GEMM's input) holds the f32 output's values rounded to nearest even, bit
 * for bit: the same sums, stored in another dtype. Covers each way the cuda merge writes out: few
 * rows (a merge, then the projection; on CUDA cores for an f32 kv_b, on tensor cores for a bf16 one)
 * and many rows (merge and projection in one kernel, both forms), at Kimi K2's per-rank dims.
 */
const bf16Out: KernelCheck = {
  name: 'mla_attention with a bf16 out == the f32 out rounded to nearest even, bit for bit (decode, 9-node tree, 41-token prefill; f32 and bf16 kv_b)',
  run(b) {
    return withTensors(b, (track) => {
      const [h, nope, rope, v, rank, slots, scale] = [8, 128, 64, 128, 512, 320, 1 / Math.sqrt(192)];
      const cacheC = track(b.fromArray('f32', [slots, rank], randomF32(slots * rank, 52)));
      const cacheKpe = track(b.fromArray('f32', [slots, rope], randomF32(slots * rope, 53)));
      const kvBValues = bf16ArrayToF32(f32ArrayToBf16(randomF32(h * (nope + v) * rank, 51, 0.05)));
      const kvBs = { f32: track(b.fromArray('f32', [h * (nope + v), rank], kvBValues)), bf16: track(b.fromArray('bf16', [h * (nope + v), rank], f32ArrayToBf16(kvBValues))) };
      const tree9 = ancestorMask([-1, 0, 0, 1, 1, 2, 3, 5, 0]);
      const details: string[] = [];
      for (const [kvName, kvB] of Object.entries(kvBs)) {
        for (const [what, tokens, base, mask] of [['decode', 1, 200, undefined], ['9-node tree', 9, 200, tree9], ['41-token prefill', 41, 100, undefined]] as const) {
          const args = {
            qNope: track(b.fromArray('f32', [tokens, h, nope], randomF32(tokens * h * nope, 54))),
            qPe: track(b.fromArray('f32', [tokens, h, rope], randomF32(tokens * h * rope, 55))),
            kvB,
            cacheC,
            cacheKpe,
            mask: mask ? track(b.fromArray('u8', [tokens, tokens], mask)) : undefined,
            base,
            scale,
          };
          const f32Out = track(b.empty('f32', [tokens, h, v]));
          const bf16 = track(b.empty('bf16', [tokens, h, v]));
          b.native.mlaAttention({ ...args, out: f32Out });
          b.native.mlaAttention({ ...args, out: bf16 });
          const want = f32ArrayToBf16(b.toArray(f32Out) as Float32Array);
          const got = b.toArray(bf16) as Uint16Array;
          const bad = want.findIndex((x, i) => x !== got[i]);
          if (bad >= 0) fail(`${kvName} kv_b, ${what}: bf16 out[${bad}] = 0x${got[bad].toString(16)}, the f32 out rounded is 0x${want[bad].toString(16)}`);
        }
        details.push(`${kvName} kv_b: 3 shapes bit-exact`);
      }
      return { detail: details.join('; ') };
    });
  },
};

export const ATTENTION_CHECKS: KernelCheck[] = [decodePrefillTree, bf16Cache, invariance, longPrefill, treeEqualsDecode, kimiRank, bf16Out, deviceBase, kvWrite, shapeErrors];
