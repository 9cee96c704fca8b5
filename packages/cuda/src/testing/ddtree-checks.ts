/** DDTree build / accept / KV commit against the @kdtree/reference executable spec. */
import { acceptTree, buildDraftTree, treeMask } from '@kdtree/reference';
import type { KdtreeBackend } from '../backend.js';
import { expectEqual, expectThrows, fail, randomF32, rng, withTensors, type KernelCheck } from './harness.js';

function deviceBuild(b: KdtreeBackend, logits: Float32Array, depth: number, vocab: number, budget: number, root: number, start: number) {
  return withTensors(b, (track) => {
    const n = budget + 1;
    const t = { tokens: track(b.empty('i32', [n])), parents: track(b.empty('i32', [n])), depths: track(b.empty('i32', [n])), positions: track(b.empty('i32', [n])), mask: track(b.empty('u8', [n, n])), size: track(b.empty('i32', [1])) };
    b.native.ddtreeBuild({ draftLogits: track(b.fromArray('f32', [depth, vocab], logits)), root, budget, start, ...t });
    const size = (b.toArray(t.size) as Int32Array)[0];
    return {
      size,
      tokens: (b.toArray(t.tokens) as Int32Array).slice(0, size),
      parents: (b.toArray(t.parents) as Int32Array).slice(0, size),
      depths: (b.toArray(t.depths) as Int32Array).slice(0, size),
      positions: (b.toArray(t.positions) as Int32Array).slice(0, size),
      mask: b.toArray(t.mask) as Uint8Array,
    };
  });
}

const build: KernelCheck = {
  name: 'ddtree_build: tokens, parents, depths, positions and mask equal the reference tree (B 0..1024, V 5..4000, L 1..20)',
  run(b) {
    const cases = [
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
      const logits = randomF32(c.depth * c.vocab, 40 + i, 3);
      const root = (7 * i) % c.vocab;
      const got = deviceBuild(b, logits, c.depth, c.vocab, c.budget, root, 100);
      const want = buildDraftTree(root, logits, c.depth, c.vocab, c.budget);
      if (got.size !== want.size) fail(`case ${i}: size ${got.size}, expected ${want.size}`);
      expectEqual(`case ${i} tokens`, Array.from(got.tokens), Array.from(want.tokens));
      expectEqual(`case ${i} parents`, Array.from(got.parents), Array.from(want.parents));
      expectEqual(`case ${i} depths`, Array.from(got.depths), Array.from(want.depths));
      expectEqual(`case ${i} positions`, Array.from(got.positions), Array.from(want.depths, (d) => 100 + d));
      const n = c.budget + 1;
      const wantMask = treeMask(want);
      for (let r = 0; r < want.size; r++) expectEqual(`case ${i} mask row ${r}`, Array.from(got.mask.subarray(r * n, r * n + want.size)), Array.from(wantMask.subarray(r * want.size, (r + 1) * want.size)));
    }
    return { detail: `${cases.length} trees identical to the reference` };
  },
};

const acceptAndCommit: KernelCheck = {
  name: 'ddtree_accept and kv_commit: accepted path, bonus and compacted KV equal the reference',
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
        const start = 5;
        const rows = start + n + 2;
        const c1 = randomF32(rows * 6, 70 + trial);
        const c2 = randomF32(rows * 3, 80 + trial);
        const c3 = Uint16Array.from(randomF32(rows * 5, 90 + trial), (v) => Math.floor((v + 1) * 30000));
        const d1 = track(b.fromArray('f32', [rows, 6], c1));
        const d2 = track(b.fromArray('f32', [rows, 3], c2));
        const d3 = track(b.fromArray('bf16', [rows, 5], c3));
        b.native.kvCommit({ caches: [d1, d2, d3], path, pathLen, start });
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
      expectThrows('root', () => b.native.ddtreeBuild({ draftLogits: track(b.zeros('f32', [2, 8])), root: 9, budget: 0, start: 0, tokens: track(b.zeros('i32', [1])), parents: track(b.zeros('i32', [1])), depths: track(b.zeros('i32', [1])), positions: track(b.zeros('i32', [1])), mask: track(b.zeros('u8', [1, 1])), size: track(b.zeros('i32', [1])) }), /root token 9 is outside the vocabulary \[0, 8\)/);
    });
  },
};

export const DDTREE_CHECKS: KernelCheck[] = [build, acceptAndCommit];
