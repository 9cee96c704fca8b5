/**
 * Choosing the tree budget B of each DDTree step to maximise expected tokens per second:
 *
 *   E(b)    = 1 + sum_{i=1..b} p_i     expected tokens a step emits (the bonus, plus each draft node
 *                                      accepted with the probability the drafter gave its path)
 *   cost(b) = verify(b + 1 nodes)      measured on this backend, per bucket of tree sizes
 *   b*      = argmax_b E(b) / (draft + cost(b)) over the buckets, against 1 / decode for b = 0:
 *             decoding without drafting, which the engine then does for a while
 *
 * The heap pops nodes best-first, so the first b nodes of the tree built with the largest budget
 * are the best tree of budget b, and their cumulative probabilities p_i are the tree's own output.
 * On a MoE model the verify cost grows with the distinct experts the tree's tokens route to (a
 * 65-node verify of Kimi K2's MoE layer reads ~289 of 384 experts), so the curve, not a constant,
 * decides. Drafters are not perfectly calibrated: the draft probabilities are scaled by the ratio
 * of tokens actually accepted to tokens expected over recent steps.
 */
import { EngineError } from './errors.js';

/** Tree budgets the verify graphs are captured for (auto picks one of these). */
export const BUDGET_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024];

export function bucketsUpTo(maxBudget: number): number[] {
  const out = BUDGET_BUCKETS.filter((b) => b <= maxBudget);
  if (out.length === 0) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `maxBudget must be >= 1, got ${maxBudget}`, 'maxBudget');
  return out;
}

/** The calibration's floor: a drafter whose trees are never accepted still gets a try now and then. */
export const MIN_CALIBRATION = 0.05;

/**
 * The budget of a probe: a try that runs while the calibration is a guess or rules trees out. One
 * node (the drafter's top token at depth 1) costs a 2-node verify, about 1.2 decode steps on an
 * H200 at Kimi K2's size, and tells whether the drafter predicts.
 */
export const PROBE_BUDGET = 1;

/** Probes after which the drafter's own probabilities choose the trees, whatever they expected. */
export const CALIBRATION_PROBES = 3;

export interface BudgetChoice {
  /** The budget to run; 0: a plain decode step pays more than any tree. */
  budget: number;
  /** The tokens that budget's step is expected to emit. */
  expected: number;
  /** The best tree's rate over plain decoding's (below 1 the step decodes). */
  treeVsDecode: number;
  /** The draft tokens the largest tree expects to add to a step (about 0: a drafter that predicts nothing). */
  bestGain: number;
  /** The calibration it applied. */
  calibration: number;
}

/** Measured milliseconds of one step: a plain decode (budget 0) and a verify per bucket. */
export interface CostCurve {
  decodeMs: number;
  /** bucket -> ms of drafting nothing but building and verifying a tree of that budget. */
  verifyMs: Map<number, number>;
}

export class BudgetPolicy {
  /** Running sums of accepted and expected draft tokens (decayed), for the calibration ratio. */
  private accepted = 0;
  private expected = 0;
  /** Trees recorded (probes included). */
  private trees = 0;

  constructor(
    readonly curve: CostCurve,
    /** Milliseconds the drafter takes per step (paid whatever the budget). */
    private draftMs: number,
    /** The draft depth: a step emits at most depth + 1 tokens. */
    private readonly depth = Infinity,
  ) {}

  /**
   * The largest budget that could ever pay: a step emits at most depth + 1 tokens, so a verify
   * (with the draft) dearer than depth + 1 decode steps loses whatever the drafter's probabilities.
   * The engine builds the tree at this budget to read its nodes' probabilities.
   */
  get largestUseful(): number {
    const buckets = [...this.curve.verifyMs].sort((x, y) => x[0] - y[0]);
    let largest = buckets[0][0];
    for (const [b, ms] of buckets) if (ms + this.draftMs <= (this.depth + 1) * this.curve.decodeMs) largest = b;
    return largest;
  }

  /**
   * Plain decode steps before the next try, after a try that found no tree worth running: none for
   * a drafter whose try costs next to nothing beside a decode step (ngram: when its suffix has no
   * earlier match now, one may come at the next token), else the backoff.
   */
  waitAfterNoTree(backoff: number): number {
    return this.draftMs < 0.05 * this.curve.decodeMs ? 0 : backoff;
  }

  /** The calibration ratio applied to the draft probabilities, in [MIN_CALIBRATION, 2]. */
  get calibration(): number {
    if (this.expected < 1) return 1;
    return Math.min(2, Math.max(MIN_CALIBRATION, this.accepted / this.expected));
  }

  /**
   * Whether the trees that ran have drafted an expected token's worth, or CALIBRATION_PROBES of
   * them have run (a drafter whose top tokens are unlikely by its own account would never get
   * there on probes alone): until then the engine runs probes (PROBE_BUDGET) instead of the trees
   * it would choose.
   */
  get calibrated(): boolean {
    return this.expected >= 1 || this.trees >= CALIBRATION_PROBES;
  }

  /**
   * The budget for a tree whose nodes (in pop order, root excluded) have these cumulative draft
   * log-probabilities; 0 means a plain decode step pays more than any tree.
   */
  choose(logProbs: ArrayLike<number>, cal = this.calibration): BudgetChoice {
    // budget 0 stands for decoding without a drafter (see the engine's idle steps): no draft cost
    let best = { budget: 0, expected: 1, rate: 1 / this.curve.decodeMs };
    const decodeRate = best.rate;
    let bestTree = 0;
    let sum = 0;
    let i = 0;
    const largest = this.largestUseful;
    for (const [b, ms] of [...this.curve.verifyMs].sort((x, y) => x[0] - y[0])) {
      if (b > largest) break;
      for (; i < Math.min(b, logProbs.length); i++) sum += Math.exp(logProbs[i]);
      const expected = 1 + cal * sum;
      const rate = expected / (ms + this.draftMs);
      bestTree = Math.max(bestTree, rate);
      if (rate > best.rate) best = { budget: b, expected, rate };
    }
    // treeVsDecode: the best tree's rate over plain decoding's (below 1 the step decodes);
    // bestGain: the draft tokens the largest tree expects to add to a step (about 0: a drafter that
    // predicts nothing, whatever the costs)
    return { budget: best.budget, expected: best.expected, treeVsDecode: bestTree / decodeRate, bestGain: cal * sum, calibration: cal };
  }

  /**
   * Plain decode steps before the next try after a try that found no tree worth running, given how
   * many the last wait was: longer the further the best tree was from paying, and much longer for a
   * drafter that predicts nothing (each try costs a draft, a tree build and a host round trip).
   */
  static backoff(previous: number, choice: Pick<BudgetChoice, 'treeVsDecode' | 'bestGain' | 'calibration'>): number {
    // a calibration at its floor: the trees that ran were (almost) never accepted
    const useless = choice.bestGain < 0.01 || choice.calibration <= MIN_CALIBRATION;
    const factor = useless ? 32 : choice.bestGain < 0.1 ? 8 : choice.treeVsDecode < 0.5 ? 4 : 2;
    return Math.min(1024, previous * factor);
  }

  /** What a step with `budget` expected and actually accepted (draft tokens, bonus excluded). */
  record(logProbs: ArrayLike<number>, budget: number, accepted: number): void {
    let sum = 0;
    for (let i = 0; i < Math.min(budget, logProbs.length); i++) sum += Math.exp(logProbs[i]);
    const decay = 0.9;
    if (budget > 0) this.trees++;
    this.accepted = decay * this.accepted + accepted;
    this.expected = decay * this.expected + sum;
  }

  updateDraftMs(ms: number): void {
    this.draftMs = 0.8 * this.draftMs + 0.2 * ms;
  }
}
