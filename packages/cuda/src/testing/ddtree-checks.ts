/** DDTree build / accept / KV commit against the @kdtree/reference executable spec. */
import { acceptTree, buildDraftTree, treeMask } from '@kdtree/reference';
import type { KdtreeBackend } from '../backend.js';
import { expectEqual, expectThrows, fail, randomF32, rng, withTensors, type KernelCheck } from './harness.js';

/** onDevice: root and start from i32 [1] buffers (rootOnDevice / startOnDevice), the host's values left out. */
function deviceBuild(b: KdtreeBackend, logits: Float32Array, depth: number, vocab: number, budget: number, root: number, start: number, onDevice = false, withLogProbs = false) {
  return withTensors(b, (track) => {
    const n = budget + 1;
    const t = { tokens: track(b.empty('i32', [n])), parents: track(b.empty('i32', [n])), depths: track(b.empty('i32', [n])), positions: track(b.empty('i32', [n])), mask: track(b.empty('u8', [n, n])), size: track(b.empty('i32', [1])), ...(withLogProbs ? { logProbs: track(b.empty('f32', [n])) } : {}) };
    const draftLogits = track(b.fromArray('f32', [depth, vocab], logits));
    if (onDevice) {
      const scalar = (v: number) => track(b.fromArray('i32', [1], Int32Array.of(v)));
      b.native.ddtreeBuild({ draftLogits, rootOnDevice: scalar(root), budget, startOnDevice: scalar(start), ...t });
    } else {
      b.native.ddtreeBuild({ draftLogits, root, budget, start, ...t });
    }
    const form = b.native.lastForm();
    const size = (b.toArray(t.size) as Int32Array)[0];
    return {
      form,
      size,
      tokens: (b.toArray(t.tokens) as Int32Array).slice(0, size),
      parents: (b.toArray(t.parents) as Int32Array).slice(0, size),
      depths: (b.toArray(t.depths) as Int32Array).slice(0, size),
      positions: (b.toArray(t.positions) as Int32Array).slice(0, size),
      mask: b.toArray(t.mask) as Uint8Array,
      logProbs: t.logProbs ? (b.toArray(t.logProbs) as Float32Array) : undefined,
    };
  });
}

const build: KernelCheck = {
  name: "ddtree_build: tokens, parents, depths, positions, mask and the nodes' cumulative log-probs equal the reference tree (B 0..1024, V 3..163840, L 1..700; budgets 1..32 on the cluster builds (a row over one block or two) and the fused build, exact ties among the logits, rows of one value, of one value but a few (an ngram draft), an ngram draft's floor past the first 1024 tokens, with a far outlier and with -Infinity), with root and start given by the host or read on the device; lastForm() names the build that ran",
  run(b) {
    const cases: { depth: number; vocab: number; budget: number; ties?: boolean; flat?: boolean; ngram?: boolean; low?: boolean; spike?: boolean; negInf?: boolean }[] = [
      // budgets 1..32 over at most 8 depths of 8192 tokens: the cluster build (dispatchPolicy
      // 'ddtreeBuild'), a row a block, or two past 4096 tokens ('cluster-halves')
      { depth: 1, vocab: 5, budget: 1 },
      { depth: 7, vocab: 8192, budget: 7 },
      { depth: 8, vocab: 7000, budget: 32 },
      { depth: 2, vocab: 1500, budget: 3 },
      // logits of a few values: ties within a warp and across warps; rows of one value (more
      // values at the threshold than the cluster build keeps: placed in index order)
      { depth: 5, vocab: 3000, budget: 24, ties: true },
      { depth: 3, vocab: 4096, budget: 16, flat: true },
      // warps without values (T = 0: more values above it than ranked, the cluster build's k
      // rounds), an ngram draft (the unseen tokens' one logit, placed in index order); fewer tokens
      // than the budget; a far outlier (exponentials below e^-60 of the maximum left out of the
      // sum); -Infinity among the logits
      { depth: 3, vocab: 300, budget: 16 },
      { depth: 4, vocab: 8192, budget: 32, ngram: true },
      // an ngram draft whose first 1500 tokens lie below its floor: the lowest indices at the
      // threshold are past the first 1024
      { depth: 3, vocab: 8191, budget: 20, ngram: true, low: true },
      { depth: 2, vocab: 3, budget: 32 },
      { depth: 5, vocab: 2048, budget: 8, spike: true },
      { depth: 3, vocab: 1000, budget: 12, negInf: true },
      // more depths or larger vocabularies: the fused build, slices of a row over the grid
      { depth: 32, vocab: 33, budget: 32 },
      { depth: 9, vocab: 16384, budget: 32 },
      { depth: 3, vocab: 163840, budget: 32 },
      { depth: 6, vocab: 20000, budget: 5 },
      { depth: 4, vocab: 40000, budget: 12, ties: true },
      // more than 32 depths: the passes, small budgets expanded as the one-launch builds expand them
      { depth: 40, vocab: 100, budget: 20 },
      { depth: 33, vocab: 700, budget: 32, ties: true },
      // the [depth, k] log-probs past shared memory: the register frontier reads them from the top-k
      { depth: 700, vocab: 50, budget: 32 },
      { depth: 1, vocab: 5, budget: 0 },
      { depth: 3, vocab: 5, budget: 40 },
      { depth: 4, vocab: 64, budget: 16 },
      { depth: 6, vocab: 512, budget: 300 },
      { depth: 2, vocab: 4000, budget: 128 },
      // the largest budget: log-prob table beside the heap past 48 KiB, then too large for shared memory
      { depth: 8, vocab: 3000, budget: 512 },
      { depth: 5, vocab: 2000, budget: 1024 },
      { depth: 20, vocab: 1100, budget: 1024 },
    ];
    for (const [i, c] of cases.entries()) {
      // (+ 0: no negative zeros, which the reference counts equal to +0 and the device orders below it)
      const logits = c.flat ? new Float32Array(c.depth * c.vocab).fill(0.5) : c.ties ? randomF32(c.depth * c.vocab, 40 + i, 1.5).map((v) => Math.round(v) + 0) : randomF32(c.depth * c.vocab, 40 + i, 3);
      for (let d = 0; d < c.depth; d++) {
        const row = logits.subarray(d * c.vocab, (d + 1) * c.vocab);
        if (c.ngram) row.forEach((v, j) => (row[j] = j % 997 === d ? 2 + v : c.low && j < 1500 ? -2e4 : -1e4));
        if (c.spike) row[(d * 131) % c.vocab] += 100;
        if (c.negInf) row.forEach((v, j) => (row[j] = j % 3 === 0 ? -Infinity : v));
      }
      const root = (7 * i) % c.vocab;
      const onDevice = i % 2 === 1;
      const withLogProbs = i % 3 !== 2;
      const got = deviceBuild(b, logits, c.depth, c.vocab, c.budget, root, 100, onDevice, withLogProbs);
      // (a budget of 0 is no query of the policy: the passes build the root alone)
      const form = b.kind !== 'cuda' ? 'cpu' : c.budget === 0 ? 'passes' : b.loaded.module.dispatchPolicy({ op: 'ddtreeBuild', m: c.depth, n: c.vocab, k: c.budget, sms: 1, sm90a: false }).form;
      if (got.form !== form) fail(`case ${i} (depth ${c.depth}, vocab ${c.vocab}, budget ${c.budget}): lastForm() is ${got.form}, expected ${form}`);
      const want = buildDraftTree(root, logits, c.depth, c.vocab, c.budget);
      if (withLogProbs) {
        // f32 of the reference's f64 sums: a few f32 ulps of the log-prob's magnitude
        const lp = got.logProbs!;
        for (let j = 0; j < want.size; j++) {
          if (!(Math.abs(lp[j] - want.logProbs[j]) <= 4e-7 * Math.max(1, Math.abs(want.logProbs[j])))) fail(`case ${i}: logProbs[${j}] = ${lp[j]}, expected ${want.logProbs[j]}`);
        }
        for (let j = want.size; j < c.budget + 1; j++) if (lp[j] !== -Infinity) fail(`case ${i}: logProbs[${j}] past the tree's ${want.size} nodes is ${lp[j]}, expected -Infinity`);
      }
      if (got.size !== want.size) fail(`case ${i}: size ${got.size}, expected ${want.size}`);
      expectEqual(`case ${i} tokens`, Array.from(got.tokens), Array.from(want.tokens));
      expectEqual(`case ${i} parents`, Array.from(got.parents), Array.from(want.parents));
      expectEqual(`case ${i} depths`, Array.from(got.depths), Array.from(want.depths));
      expectEqual(`case ${i} positions`, Array.from(got.positions), Array.from(want.depths, (d) => 100 + d));
      const n = c.budget + 1;
      const wantMask = treeMask(want);
      for (let r = 0; r < want.size; r++) expectEqual(`case ${i} mask row ${r}`, Array.from(got.mask.subarray(r * n, r * n + want.size)), Array.from(wantMask.subarray(r * want.size, (r + 1) * want.size)));
    }
    return { detail: `${cases.length} trees identical to the reference (${cases.length / 2} with root and start on the device)` };
  },
};

const acceptAndCommit: KernelCheck = {
  name: 'ddtree_accept and kv_commit: accepted path, bonus and compacted KV equal the reference; a start read on the device and the next start written in its place',
  run(b) {
    withTensors(b, (track) => {
      const vocab = 32;
      const depth = 4;
      const budget = 20;
      const r = rng(7);
      for (let trial = 0; trial < 6; trial++) {
        const logits = randomF32(depth * vocab, 60 + trial, 3);
        const tree = buildDraftTree(3, logits, depth, vocab, budget);
        // target argmax: follow a random root-to-leaf path for a while, then diverge
        const argmax = new Int32Array(tree.size).map(() => Math.floor(r.uniform() * vocab));
        let cur = 0;
        for (let step = 0; step < trial % 4; step++) {
          const kids = Array.from({ length: tree.size }, (_, i) => i).filter((i) => tree.parents[i] === cur);
          if (kids.length === 0) break;
          const next = kids[Math.floor(r.uniform() * kids.length)];
          argmax[cur] = tree.tokens[next];
          cur = next;
        }
        const want = acceptTree(tree, argmax);
        const n = tree.size;
        const path = track(b.empty('i32', [n]));
        const pathLen = track(b.empty('i32', [1]));
        const bonus = track(b.empty('i32', [1]));
        b.native.ddtreeAccept({
          tokens: track(b.fromArray('i32', [n], tree.tokens)),
          parents: track(b.fromArray('i32', [n], tree.parents)),
          size: track(b.fromArray('i32', [1], Int32Array.of(n))),
          targetArgmax: track(b.fromArray('i32', [n], argmax)),
          path,
          pathLen,
          bonus,
        });
        const len = (b.toArray(pathLen) as Int32Array)[0];
        expectEqual(`trial ${trial} path`, Array.from((b.toArray(path) as Int32Array).subarray(0, len)), want.path);
        if ((b.toArray(bonus) as Int32Array)[0] !== want.bonus) fail(`trial ${trial}: bonus differs`);
        // commit into three cache tensors of different widths, one of them bf16 (an odd width: rows
        // of 10 bytes)
        // odd trials: the start from the device, moved on in place (nextStart = startOnDevice)
        const start = 5;
        const rows = start + n + 2;
        const startOnDevice = trial % 2 === 1 ? track(b.fromArray('i32', [1], Int32Array.of(start))) : undefined;
        const c1 = randomF32(rows * 6, 70 + trial);
        const c2 = randomF32(rows * 3, 80 + trial);
        const c3 = Uint16Array.from(randomF32(rows * 5, 90 + trial), (v) => Math.floor((v + 1) * 30000));
        const d1 = track(b.fromArray('f32', [rows, 6], c1));
        const d2 = track(b.fromArray('f32', [rows, 3], c2));
        const d3 = track(b.fromArray('bf16', [rows, 5], c3));
        b.native.kvCommit(startOnDevice ? { caches: [d1, d2, d3], path, pathLen, startOnDevice, nextStart: startOnDevice } : { caches: [d1, d2, d3], path, pathLen, start });
        if (startOnDevice) {
          const next = (b.toArray(startOnDevice) as Int32Array)[0];
          if (next !== start + want.path.length) fail(`trial ${trial}: nextStart ${next}, expected start ${start} + path length ${want.path.length}`);
        }
        for (const [dev, host, width] of [[d1, c1, 6], [d2, c2, 3], [d3, c3, 5]] as const) {
          const want2 = host.slice();
          for (let k = 0; k < want.path.length; k++) want2.copyWithin((start + k) * width, (start + want.path[k]) * width, (start + want.path[k] + 1) * width);
          expectEqual(`trial ${trial} commit width ${width}`, Array.from(b.toArray(dev).subarray(0, (start + want.path.length) * width)), Array.from(want2.subarray(0, (start + want.path.length) * width)));
        }
      }
      expectThrows('budget', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [2, 8])), root: 0, budget: 4, start: 0, tokens: track(b.zeros('i32', [4])), parents: track(b.zeros('i32', [5])), depths: track(b.zeros('i32', [5])), positions: track(b.zeros('i32', [5])), mask: track(b.zeros('u8', [5, 5])), size: track(b.zeros('i32', [1])) }), /tokens must be \[budget \+ 1\] = \[5\]/);
      expectThrows('budget limit', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [1, 8])), root: 0, budget: 1025, start: 0, tokens: track(b.zeros('i32', [1026])), parents: track(b.zeros('i32', [1026])), depths: track(b.zeros('i32', [1026])), positions: track(b.zeros('i32', [1026])), mask: track(b.zeros('u8', [1026, 1026])), size: track(b.zeros('i32', [1])) }), /budget 1025 must be in \[0, 1024\]/);
      const big = () => track(b.zeros('i32', [1026]));
      expectThrows('accept tree size', () => b.native.ddtreeAccept({ tokens: big(), parents: big(), size: track(b.zeros('i32', [1])), targetArgmax: big(), path: big(), pathLen: track(b.zeros('i32', [1])), bonus: track(b.zeros('i32', [1])) }), /a tree holds at most 1025 nodes \(budget 1024 \+ root\), got 1026/);
      const one = () => track(b.zeros('i32', [1]));
      expectThrows('start on device shape', () => b.native.kvCommit({ caches: [track(b.zeros('f32', [4, 2]))], path: one(), pathLen: one(), startOnDevice: track(b.zeros('i32', [2])) }), /kv_commit\(.*startOnDevice: i32 \[2\].*\): startOnDevice must be \[1\], got \[2\]/);
      expectThrows('next start dtype', () => b.native.kvCommit({ caches: [track(b.zeros('f32', [4, 2]))], path: one(), pathLen: one(), nextStart: track(b.zeros('f32', [1])) }), /nextStart must be i32, got f32/);
      expectThrows('root on device dtype', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [2, 8])), rootOnDevice: track(b.zeros('f32', [1])), budget: 0, tokens: one(), parents: one(), depths: one(), positions: one(), mask: track(b.zeros('u8', [1, 1])), size: one() }), /rootOnDevice must be i32, got f32/);
      if (b.kind === 'cpu') {
        // the cpu backend reads device scalars on the host and rejects what the GPU kernels skip or write as is
        expectThrows('root on device value', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [2, 8])), rootOnDevice: track(b.fromArray('i32', [1], Int32Array.of(8))), budget: 0, tokens: one(), parents: one(), depths: one(), positions: one(), mask: track(b.zeros('u8', [1, 1])), size: one() }), /rootOnDevice holds token 8, outside the vocabulary \[0, 8\)/);
        const fromI32 = (...v: number[]) => track(b.fromArray('i32', [v.length], Int32Array.from(v)));
        const accept = (size: number, argmaxRows: number) => () =>
          b.native.ddtreeAccept({ tokens: fromI32(0, 1, 2), parents: fromI32(-1, 0, 1), size: fromI32(size), targetArgmax: track(b.zeros('i32', [argmaxRows])), path: track(b.zeros('i32', [3])), pathLen: one(), bonus: one() });
        expectThrows('accept size past the nodes', accept(4, 3), /ddtree_accept: size 4 is outside \[1, 3\] \(tokens' nodes\)/);
        expectThrows('accept size past targetArgmax', accept(3, 2), /ddtree_accept: size 3 is more nodes than targetArgmax's 2 \(one target argmax a node\)/);
        expectThrows('start on device value', () => b.native.kvCommit({ caches: [track(b.zeros('f32', [4, 2]))], path: one(), pathLen: track(b.fromArray('i32', [1], Int32Array.of(1))), startOnDevice: track(b.fromArray('i32', [1], Int32Array.of(4))) }), /kv_commit: path\[0\] = 0 is not a slot at or after 0 inside caches\[0\]: f32 \[4, 2\] from start 4/);
        // a path that fits the first cache but not the second: refused before any row moves
        const first = Float32Array.from({ length: 8 }, (_, i) => i);
        const roomy = track(b.fromArray('f32', [8, 1], first));
        expectThrows('a commit refused by a later cache', () => b.native.kvCommit({ caches: [roomy, track(b.zeros('f32', [3, 1]))], path: track(b.fromArray('i32', [2], Int32Array.of(0, 5))), pathLen: track(b.fromArray('i32', [1], Int32Array.of(2))), start: 0 }), /kv_commit: path\[1\] = 5 is not a slot at or after 1 inside caches\[1\]: f32 \[3, 1\] from start 0/);
        expectEqual('the first cache after a refused commit', Array.from(b.toArray(roomy)), Array.from(first));
      }
      expectThrows('root', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [2, 8])), root: 9, budget: 0, start: 0, tokens: track(b.zeros('i32', [1])), parents: track(b.zeros('i32', [1])), depths: track(b.zeros('i32', [1])), positions: track(b.zeros('i32', [1])), mask: track(b.zeros('u8', [1, 1])), size: track(b.zeros('i32', [1])) }), /root token 9 is outside the vocabulary \[0, 8\)/);
    });
  },
};

const arange: KernelCheck = {
  name: 'arange: start + startOnDevice + i (i32), in place over the device start too; bad arguments rejected',
  run(b) {
    return withTensors(b, (track) => {
      const L = track(b.fromArray('i32', [1], Int32Array.of(300)));
      for (const n of [1, 3, 17, 1500]) {
        const out = track(b.empty('i32', [n]));
        b.native.arange({ out, startOnDevice: L, start: -2 });
        expectEqual(`n ${n}`, Array.from(b.toArray(out) as Int32Array), Array.from({ length: n }, (_, i) => 298 + i));
      }
      const plain = track(b.empty('i32', [5]));
      b.native.arange({ out: plain, start: 7 });
      expectEqual('host start only', Array.from(b.toArray(plain) as Int32Array), [7, 8, 9, 10, 11]);
      // a committed length moved on in place: L += 1 three times (a decode step's advance)
      for (let i = 0; i < 3; i++) b.native.arange({ out: L, startOnDevice: L, start: 1 });
      if ((b.toArray(L) as Int32Array)[0] !== 303) fail(`L after three in-place advances is ${(b.toArray(L) as Int32Array)[0]}, expected 303`);
      // in place over a longer out whose first element is the start: every value from the old start
      const wide = track(b.fromArray('i32', [4], Int32Array.of(50, 0, 0, 0)));
      b.native.arange({ out: wide, startOnDevice: { ...wide, shape: [1] } });
      expectEqual('in place, 4 values', Array.from(b.toArray(wide) as Int32Array), [50, 51, 52, 53]);
      expectThrows('out dtype', () => b.native.arange({ out: track(b.zeros('f32', [2])) }), /arange\(out: f32 \[2\]\): out must be i32, got f32/);
      expectThrows('start shape', () => b.native.arange({ out: track(b.zeros('i32', [2])), startOnDevice: track(b.zeros('i32', [1, 1])) }), /startOnDevice must have 1 dimensions, got 2/);
      expectThrows('i32 range', () => b.native.arange({ out: track(b.zeros('i32', [4])), start: 2 ** 31 - 2 }), /start 2147483646 \+ 4 values leave the i32 range/);
      return { detail: 'n 1, 3, 17, 1500; in place; 3 rejections' };
    });
  },
};

export const DDTREE_CHECKS: KernelCheck[] = [build, acceptAndCommit, arange];
