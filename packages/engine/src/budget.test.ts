import { describe, expect, it } from 'vitest';
import { BudgetPolicy, bucketsUpTo, CALIBRATION_PROBES, MIN_CALIBRATION, PROBE_BUDGET } from './budget.js';

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

  it('chooses with a given calibration (a probe ignores a calibration that rules every tree out)', () => {
    const p = new BudgetPolicy(curve, 0);
    const confident = logs(Array.from({ length: 64 }, (_, i) => 0.95 ** (i + 1)));
    for (let i = 0; i < 20; i++) p.record(confident, 64, 0);
    const ruled = logs(Array.from({ length: 64 }, (_, i) => 0.5 ** (i + 1)));
    expect(p.choose(ruled).budget).toBe(0);
    expect(p.choose(ruled, 1).budget).toBeGreaterThan(0);
  });

  it('is calibrated once its trees have drafted an expected token (until then the engine runs probes of PROBE_BUDGET)', () => {
    const p = new BudgetPolicy(curve, 0);
    expect(p.calibrated).toBe(false);
    const sure = logs([0.6, ...Array(63).fill(0.001)]);
    p.record(sure, PROBE_BUDGET, 0);
    expect(p.calibrated).toBe(false); // 0.6 expected so far
    expect(p.calibration).toBe(1);
    p.record(sure, PROBE_BUDGET, 0);
    expect(p.calibrated).toBe(true); // 0.6 x 0.9 + 0.6
    expect(p.calibration).toBe(MIN_CALIBRATION);
    expect(p.choose(sure).calibration).toBe(MIN_CALIBRATION);
    // a drafter unsure of its own top tokens: after CALIBRATION_PROBES probes its probabilities choose
    const unsure = new BudgetPolicy(curve, 0);
    const low = logs([0.05, ...Array(63).fill(0.001)]);
    for (let i = 0; i < CALIBRATION_PROBES - 1; i++) unsure.record(low, PROBE_BUDGET, 0);
    expect(unsure.calibrated).toBe(false);
    unsure.record(low, PROBE_BUDGET, 1);
    expect(unsure.calibrated).toBe(true);
  });

  it('waits longer after a try the further the best tree was from paying, longest for a drafter that predicts nothing', () => {
    expect(BudgetPolicy.backoff(1, { treeVsDecode: 0.8, bestGain: 0.5, calibration: 1 })).toBe(2);
    expect(BudgetPolicy.backoff(2, { treeVsDecode: 0.3, bestGain: 0.5, calibration: 1 })).toBe(8);
    expect(BudgetPolicy.backoff(1, { treeVsDecode: 0.9, bestGain: 0.05, calibration: 1 })).toBe(8);
    expect(BudgetPolicy.backoff(1, { treeVsDecode: 0.9, bestGain: 0.001, calibration: 1 })).toBe(32);
    expect(BudgetPolicy.backoff(512, { treeVsDecode: 0.9, bestGain: 0.001, calibration: 1 })).toBe(1024);
    // trees that were never accepted: the calibration sits at its floor, whatever the drafter now claims
    expect(BudgetPolicy.backoff(1, { treeVsDecode: 0.9, bestGain: 0.5, calibration: MIN_CALIBRATION })).toBe(32);
    const p = new BudgetPolicy(curve, 0);
    expect(p.choose(logs(Array(64).fill(1e-5))).bestGain).toBeLessThan(0.1);
  });

  it('never considers a tree dearer than depth + 1 decode steps, nor backs off a drafter that costs next to nothing', () => {
    expect(new BudgetPolicy(curve, 0, 4).largestUseful).toBe(32); // 4.5 ms <= 5 x 1 ms < 8 ms
    expect(new BudgetPolicy(curve, 0, 1).largestUseful).toBe(8); // 1.9 ms <= 2 x 1 ms
    expect(new BudgetPolicy(curve, 0).largestUseful).toBe(64);
    // a certain chain of 64: with depth 4 no budget past 32 is chosen
    expect(new BudgetPolicy(curve, 0, 4).choose(Array(64).fill(0)).budget).toBeLessThanOrEqual(32);
    expect(new BudgetPolicy(curve, 0.01).waitAfterNoTree(8)).toBe(0);
    expect(new BudgetPolicy(curve, 0.5).waitAfterNoTree(8)).toBe(8);
  });
});
