import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import { acceptTree, buildDraftTree, commitPath, ddtreeDecode, modelDrafter, topKLogProbs, treeMask, treePositions, type Drafter } from './ddtree.js';
import { greedyDecode } from './generate.js';
import type { ReferenceModel } from './model.js';
import { SeededRandom } from './synthetic.js';
import { tinyModel } from './test-support/tiny-model.js';

const RUNS = Number(process.env.KDTREE_FUZZ_RUNS ?? 40);

function randomLogits(depth: number, vocab: number, seed: number, spread = 3): Float32Array {
  const rng = new SeededRandom(seed);
  return Float32Array.from({ length: depth * vocab }, () => spread * rng.normal());
}

describe('DDTree build', () => {
  it('pops the B most probable prefixes, best first, parents before children', () => {
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 4 }), fc.integer({ min: 2, max: 6 }), fc.integer({ min: 0, max: 40 }), fc.nat(), (depth, vocab, budget, seed) => {
        const logits = randomLogits(depth, vocab, seed);
        const tree = buildDraftTree(9, logits, depth, vocab, budget);
        expect(tree.tokens[0]).toBe(9);
        expect(tree.size).toBeLessThanOrEqual(budget + 1);
        for (let i = 1; i < tree.size; i++) {
          expect(tree.parents[i]).toBeLessThan(i);
          expect(tree.depths[i]).toBe(tree.depths[tree.parents[i]] + 1);
          // pop order is best-first; a NaN log-prob (which compares false either way) fails here
          expect(Number.isFinite(tree.logProbs[i]), `log-prob of node ${i}: ${tree.logProbs[i]}`).toBe(true);
          expect(tree.logProbs[i]).toBeLessThanOrEqual(tree.logProbs[i - 1] + 1e-12);
        }
        // brute force: every prefix (token path of length 1..depth) with its log-prob
        const k = Math.min(budget, vocab);
        const top = topKLogProbs(logits, depth, vocab, Math.max(k, 1));
        const all: number[] = [];
        const walk = (d: number, lp: number) => {
          if (d === depth) return;
          for (let r = 0; r < k; r++) {
            const w = lp + top.logProbs[d * Math.max(k, 1) + r];
            all.push(w);
            walk(d + 1, w);
          }
        };
        walk(0, 0);
        all.sort((a, b) => b - a);
        const expected = all.slice(0, budget);
        const got = Array.from(tree.logProbs.slice(1)).sort((a, b) => b - a);
        expect(got.length).toBe(Math.min(budget, all.length));
        got.forEach((w, i) => expect(w).toBeCloseTo(expected[i], 9));
      }),
      { numRuns: 200 },
    );
  });

  it('gives siblings distinct tokens, tree positions and the ancestor mask', () => {
    const tree = buildDraftTree(5, randomLogits(3, 8, 4), 3, 8, 12);
    for (let i = 1; i < tree.size; i++) {
      for (let j = i + 1; j < tree.size; j++) if (tree.parents[i] === tree.parents[j]) expect(tree.tokens[i]).not.toBe(tree.tokens[j]);
    }
    expect(treePositions(tree, 100)).toEqual(Array.from(tree.depths, (d) => 100 + d));
    const mask = treeMask(tree);
    const n = tree.size;
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        let anc = false;
        for (let a = i; a >= 0; a = tree.parents[a]) if (a === j) anc = true;
        expect(mask[i * n + j]).toBe(anc ? 1 : 0);
      }
    }
  });

  it('accepts along children matching the target argmax and ends with the bonus', () => {
    // root 0 (token 50) -> node 1 (token 7) -> node 3 (token 8); node 2 (token 9) is 1's sibling
    const tree = { size: 4, tokens: Int32Array.of(50, 7, 9, 8), parents: Int32Array.of(-1, 0, 0, 1), depths: Int32Array.of(0, 1, 1, 2), logProbs: new Float64Array(4) };
    expect(acceptTree(tree, [7, 8, 1, 4])).toEqual({ path: [0, 1, 3], emitted: [7, 8, 4], bonus: 4 });
    expect(acceptTree(tree, [9, 8, 6, 4])).toEqual({ path: [0, 2], emitted: [9, 6], bonus: 6 });
    expect(acceptTree(tree, [3, 8, 6, 4])).toEqual({ path: [0], emitted: [3], bonus: 3 });
  });

  it('rejects bad budgets, depths and logits sizes', () => {
    expect(() => buildDraftTree(1, new Float32Array(8), 0, 8, 4)).toThrow(/depth must be a positive integer/);
    expect(() => buildDraftTree(1, new Float32Array(8), 1, 8, -1)).toThrow(/budget/);
    expect(() => buildDraftTree(1, new Float32Array(7), 1, 8, 4)).toThrow(/expected depth 1 x vocab 8/);
  });
});

describe('DDTree decoding is exactly greedy decoding', () => {
  let model: ReferenceModel;
  let reference: number[];
  const prompt = [1, 7, 42, 3];
  const maxNew = 14;
  beforeAll(async () => {
    model = await tinyModel(5);
    reference = greedyDecode(model, prompt, { maxNew, eos: [] }).tokens;
  });

  /** Random per-depth logits, with the true continuation boosted with probability p at each depth. */
  function noisyOracle(p: number, seed: number): Drafter {
    const rng = new SeededRandom(seed);
    const truth = [...prompt, ...reference];
    return (context, depth) => {
      const V = model.config.vocabSize;
      const logits = Float32Array.from({ length: depth * V }, () => 2 * rng.normal());
      for (let d = 0; d < depth; d++) {
        const next = truth[context.length + d];
        if (next !== undefined && rng.uniform() < p) logits[d * V + next] += 8;
      }
      return logits;
    };
  }

  it('for random draft logits, budgets and depths (property test)', () => {
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 24 }), fc.integer({ min: 1, max: 5 }), fc.double({ min: 0, max: 1, noNaN: true }), fc.nat(), (budget, depth, p, seed) => {
        const out = ddtreeDecode(model, prompt, { maxNew, budget, depth, drafter: noisyOracle(p, seed), eos: [] });
        expect(out.tokens).toEqual(reference);
        expect(out.acceptedPerStep.reduce((a, b) => a + b, 1)).toBeGreaterThanOrEqual(maxNew);
      }),
      { numRuns: RUNS },
    );
  });

  it('accepts long paths with a good drafter and commits their KV (decoding continues correctly)', () => {
    const out = ddtreeDecode(model, prompt, { maxNew, budget: 16, depth: 4, drafter: noisyOracle(1, 7), eos: [] });
    expect(out.tokens).toEqual(reference);
    expect(Math.max(...out.acceptedPerStep)).toBe(5); // depth 4 accepted + bonus
  });

  it('with a draft model as drafter', async () => {
    const draft = await tinyModel(6);
    const out = ddtreeDecode(model, prompt, { maxNew, budget: 8, depth: 3, drafter: modelDrafter(draft), eos: [] });
    expect(out.tokens).toEqual(reference);
  });

  it('commitPath moves the accepted slots into place', () => {
    const cache = model.newCache(16);
    model.forward([1, 2, 3], cache);
    const before = cache.layers[0].c.slice();
    const r = model.config.kvLoraRank;
    cache.length = 3;
    commitPath(cache, 0, [0, 2]);
    expect(cache.length).toBe(2);
    expect(Array.from(cache.layers[0].c.subarray(r, 2 * r))).toEqual(Array.from(before.subarray(2 * r, 3 * r)));
  });
});
