import { describe, expect, it } from 'vitest';
import { BudgetPolicy, bucketsUpTo } from './budget.js';

// a MoE-like curve: a decode step 1 ms, a verify growing with the tree (distinct experts touched)
const curve = { decodeMs: 1, verifyMs: new Map([[1, 1.1], [2, 1.2], [4, 1.4], [8, 1.9], [16, 2.8], [32, 4.5], [64, 8]]) };
const logs = (ps: number[]) => ps.map(Math.log);

describe('BudgetPolicy', () => {
  it('buckets stop at the engine\'s largest budget', () => {
    expect(bucketsUpTo(16)).toEqual([1, 2, 3, 4, 6, 8, 12, 16]);
    expect(() => bucketsUpTo(0)).toThrow(/maxBudget must be >= 1/);
  });

  it('picks the bucket with the most expected tokens per millisecond', () => {
    const p = new BudgetPolicy(curve, 0);
    // a confident chain: each node accepted with probability 0.9^depth
    const chain = logs(Array.from({ length: 64 }, (_, i) => 0.9 ** (i + 1)));
    const { budget, expected } = p.choose(chain);
    // E(b)/cost(b): b=8 gives (1 + 5.2)/1.9 = 3.26, b=4 (1+3.1)/1.4 = 2.93, b=16 (1+7.4)/2.8 = 3.0
    expect(budget).toBe(8);
    expect(expected).toBeCloseTo(1 + chain.slice(0, 8).reduce((s, l) => s + Math.exp(l), 0), 6);
  });

  it('chooses a plain decode step (0) when no tree pays for its verify', () => {
    const p = new BudgetPolicy(curve, 0);
    expect(p.choose(logs(Array(64).fill(0.01))).budget).toBe(0);
    // the drafter's own cost counts against every tree
    expect(new BudgetPolicy(curve, 5).choose(logs([0.5, 0.2, ...Array(62).fill(0.01)])).budget).toBe(0);
  });

  it('scales the draft probabilities by how many tokens were really accepted', () => {
    const p = new BudgetPolicy(curve, 0);
    const confident = logs(Array.from({ length: 64 }, (_, i) => 0.95 ** (i + 1)));
    const before = p.choose(confident).budget;
    for (let i = 0; i < 20; i++) p.record(confident, before, 0); // the drafter promised much and delivered nothing
    expect(p.calibration).toBe(0.05);
    expect(p.choose(confident).budget).toBeLessThan(before);
  });
});
