import { createBackend } from '@kdtree/cuda';
import { afterAll, describe, expect, it } from 'vitest';
import { NgramDrafter } from './drafters.js';
import { TEST_BACKEND } from './test-support/models.js';

describe('NgramDrafter', () => {
  const b = createBackend({ backend: TEST_BACKEND });
  const V = 97;
  const depth = 3;
  const drafter = new NgramDrafter(b, V, 4);
  // the request's logits sit past the start of their buffer, as a view of the engine's would
  const buffer = b.zeros('f32', [depth + 2, V]);
  const out = { buffer: buffer.buffer, dtype: 'f32' as const, shape: [depth, V], offset: V * 4 };
  afterAll(() => {
    drafter.dispose();
    b.free(buffer);
  });

  /** The logits `draft` should write: each depth's seen tokens at the log of their share, -1e4 elsewhere. */
  function expected(tokens: number[]): Float32Array {
    const want = new Float32Array(depth * V).fill(-1e4);
    NgramDrafter.continuations(tokens, depth, 4).forEach((seen, d) => {
      const total = [...seen.values()].reduce((x, y) => x + y, 0);
      for (const [token, c] of seen) want[d * V + token] = Math.log(c / total);
    });
    return want;
  }

  const logits = () => (b.toArray(buffer) as Float32Array).slice(V, (depth + 1) * V);

  it('writes the log-frequency of every token that followed a match of the suffix, at each depth, and nothing outside its rows', () => {
    // the suffix 1 2 came three times before: depth 1 saw 3 (twice) and 9, depth 2 saw 4, 5 and 1
    const tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 1, 0, 1, 2];
    expect(drafter.draft({ tokens, depth, out })).toBe(true);
    const got = logits();
    const want = expected(tokens);
    expect(Array.from(got)).toEqual(Array.from(want));
    expect(got[3]).toBeCloseTo(Math.log(2 / 3), 6);
    // the rows around the request's are untouched
    const all = b.toArray(buffer) as Float32Array;
    expect(all.subarray(0, V).every((x) => x === 0)).toBe(true);
    expect(all.subarray((depth + 1) * V).every((x) => x === 0)).toBe(true);
  });

  it('writes more continuations than its first scatter holds (one token followed by every other), and a later draft rewrites every row', () => {
    // token 0 is followed by each of 1..90 once: 90 entries at depth 1 alone
    const tokens = Array.from({ length: 90 }, (_, i) => [0, i + 1]).flat().concat([0]);
    expect(drafter.draft({ tokens, depth, out })).toBe(true);
    expect(Array.from(logits())).toEqual(Array.from(expected(tokens)));
    const short = [5, 6, 5];
    expect(drafter.draft({ tokens: short, depth, out })).toBe(true);
    expect(Array.from(logits())).toEqual(Array.from(expected(short)));
  });

  it('proposes nothing where the suffix has no earlier match, and writes nothing', () => {
    const before = logits();
    expect(drafter.draft({ tokens: [1, 2, 3, 4], depth, out })).toBe(false);
    expect(Array.from(logits())).toEqual(Array.from(before));
  });

  it("gives on the host the logProbs of the device's best tree under its last draft (treeLogProbs), -Infinity past the nodes there are", () => {
    /** The device build's logProbs of the best `budget`-node tree under the logits at `at`, root excluded. */
    function built(at: typeof out, rows: number, budget: number): Float32Array {
      const n = budget + 1;
      const t = { tokens: b.zeros('i32', [n]), parents: b.zeros('i32', [n]), depths: b.zeros('i32', [n]), positions: b.zeros('i32', [n]), mask: b.zeros('u8', [n, n]), size: b.zeros('i32', [1]), logProbs: b.zeros('f32', [n]) };
      try {
        b.native.ddtreeBuild({ draftLogits: { ...at, shape: [rows, V] }, root: 0, budget, start: 0, ...t });
        return (b.toArray(t.logProbs) as Float32Array).slice(1);
      } finally {
        for (const x of Object.values(t)) b.free(x);
      }
    }
    const close = (host: Float32Array, device: Float32Array) => {
      expect(host.length).toBe(device.length);
      // both sum at most `depth` f32 log-probs; a node through an unseen token sits near -1e4
      host.forEach((x, i) => (device[i] === -Infinity ? expect(x).toBe(-Infinity) : expect(Math.abs(x - device[i])).toBeLessThanOrEqual(1e-5 * Math.max(1, Math.abs(device[i])))));
    };
    // alternatives at every depth; one token followed by most others; a match whose last depth saw
    // nothing (its V logits all UNSEEN: uniform there)
    const contexts = [[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 1, 0, 1, 2], Array.from({ length: 60 }, (_, i) => [0, (i % 30) + 1]).flat().concat([0]), [5, 6, 5]];
    for (const tokens of contexts) {
      expect(drafter.draft({ tokens, depth, out })).toBe(true);
      for (const budget of [1, 3, 8, 40]) close(drafter.treeLogProbs(budget), built(out, depth, budget));
    }
    // one depth of V = 97 tokens: a tree of 128 nodes has 97
    expect(drafter.draft({ tokens: contexts[0], depth: 1, out: { ...out, shape: [1, V] } })).toBe(true);
    const host = drafter.treeLogProbs(128);
    close(host, built(out, 1, 128));
    expect(host.findIndex((x) => x === -Infinity)).toBe(97);
  });
});
