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
 * of tokens actually accepted to tokens expected over the last few trees. A try that finds nothing
 * (no tree worth running, a rejected probe, or a drafter that proposes nothing) is paid for by the
 * plain decode steps after it, TRY_SHARE of a decode step each (UNPROVEN_TRY_SHARE for a dear
 * drafter never accepted), as many as its cost holds whole payments (BudgetPolicy.tryNow, record;
 * a drafter that proposes nothing is no miss: recordSilent).
 *
 * A plan builds a tree for its probabilities and reads them back before the verify: the device
 * waits for that round trip (tens of microseconds, a tenth of a step of a small model). Every tree
 * that runs reads its own nodes' probabilities back with its accepted path, so a try plans from the
 * last tree instead where that tree's nodes decide the plan (planFromLast: a drafter's confidence
 * changes slowly from one draft to the next). A budget planned and accepted a few times in a row
 * runs a few steps without plans where they do not (sticky, STICKY_AFTER). A drafter that knows its
 * tree on the host (Drafter.treeLogProbs: prompt lookup) plans every try afresh instead: the engine
 * asks neither planFromLast nor sticky, since its plan costs the device nothing.
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

/**
 * The share of decode time that tries finding nothing may cost: a try that runs no tree (its draft
 * and the tree build read back) or only a probe that is rejected (its draft and its verify beyond
 * a decode step) is paid for by the plain decode steps that follow it, TRY_SHARE of a decode step
 * each. The wait is sized by the try's own cost: ngram (a try costs a few percent of a decode step)
 * tries again a few steps later, a drafter whose draft costs two decode steps about 200 later.
 */
export const TRY_SHARE = 0.01;

/**
 * TRY_SHARE for a drafter never accepted whose draft costs more than a decode step (the median of
 * its measured tries): its next try is unlikely to find more, and each costs more than the step it
 * replaces, so its tries may cost a quarter of that. A random DFlash drafter of Kimi K2.5's size (a
 * try about two decode steps) then tries every ~800 steps once past its first misses (whose waits
 * are capped at a step, two and FIRST_WAIT whatever the share), about 0.25% of greedy's time.
 * Cheap tries (prompt lookup: next to nothing without a match) keep TRY_SHARE: text can
 * turn repetitive at any step, and their waits stay a few steps long.
 */
export const UNPROVEN_TRY_SHARE = 0.0025;

/**
 * The most plain decode steps after the k-th try in a row that found nothing (silent tries apart:
 * BudgetPolicy.recordSilent): for a drafter whose
 * draft tokens have been accepted, 2^(k-1) since the last one (a rejection is little proof that a
 * good stretch is over: the next try comes after one plain step, and the waits grow to what the
 * cost asks within a few misses). For one never accepted, 2^(k-1) too for its first
 * CALIBRATION_PROBES - 1 misses (one rejected probe is little proof either: a drafter's first
 * draft after a prompt is often its worst, and a drafter that predicts a walk from the tokens
 * before it cannot predict where the prompt ends), FIRST_WAIT after its CALIBRATION_PROBES-th and
 * MAX_WAIT after later ones.
 */
export const FIRST_WAIT = 32;
export const MAX_WAIT = 1024;

/**
 * The calibration's memory: each tree that runs keeps this share of the sums before it (about the
 * last three trees count), so a drafter whose worth changes within a generation (ngram entering or
 * leaving a repetitive stretch) is rated by its last trees, not by a stretch that is over.
 */
export const CALIBRATION_DECAY = 0.7;

/**
 * Plans in a row that chose the same budget and had a draft token accepted, after which that
 * budget runs STICKY_STEPS steps without a plan: a plan builds a tree for its probabilities and
 * reads them back, and the step's verify waits for that round trip (tens of microseconds, a tenth
 * of a step of a small model). A sticky tree that accepts nothing ends the run: the next try plans.
 */
export const STICKY_AFTER = 3;
export const STICKY_STEPS = 4;

/** The drafter's last step times the policy takes the median of. */
export const DRAFT_SAMPLES = 5;

/**
 * Once the median has its DRAFT_SAMPLES, one try in this many planned from the last tree is timed
 * (sampleDue): a draft's cost changes slowly, and timing one costs the host three native calls (two
 * events and their read), a tenth of a step of a small model. A try that plans is always timed: a
 * wait after one that found nothing is sized by its own cost.
 */
export const DRAFT_SAMPLE_EVERY = 8;

/** What a try runs: a budget (0: a plain decode step), and whether it is a probe (PROBE_BUDGET testing whether the drafter predicts). */
export interface BudgetPlan {
  budget: number;
  probe: boolean;
  choice: BudgetChoice;
}

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
  /** Running sums of accepted and expected draft tokens (decayed per tree that ran), for the calibration ratio. */
  private accepted = 0;
  private expected = 0;
  /** Trees recorded (probes included). */
  private trees = 0;
  /** Milliseconds of tries that found nothing, not yet paid for by plain decode steps (the wait before the next try). */
  private debt = 0;
  /** Tries in a row that found nothing, and whether a draft token was ever accepted. */
  private misses = 0;
  /** Tries in a row whose drafter proposed nothing (recordSilent), apart from the misses. */
  private silences = 0;
  private proven = false;
  /** Exploring probes taken at a loss since a tree or probe last paid (record). */
  private explorations = 0;
  private readonly draftSamples: number[] = [];
  /** The budget of the last plans that ran a tree and had a token accepted, how many in a row, and the sticky steps left. */
  private stickyBudget = 0;
  private stickyRun = 0;
  private stickyLeft = 0;
  /**
   * planFromLast's nodes: the cumulative draft log-probs (pop order, root excluded) of this
   * generation's last try that ran a tree: the tree it ran, read back, or after a plan the
   * planning build's (the same draft; the tree that ran is their first `budget`).
   */
  private last: ArrayLike<number> | undefined;
  /** Whether the first measurement (left out of the median) came, and the last one. */
  private measured = false;
  private lastDraftMs: number | undefined;
  /** Tries planned from the last tree since the last one timed (sampleDue). */
  private unsampled = 0;
  /** The last measured cost of a try whose drafter proposed nothing (recordSilent). */
  private silentMs: number | undefined;
  /**
   * The curve's buckets in ascending budget, taken once: every try asks the policy several
   * questions over them, and on a small model's ~0.3 ms step sorting the curve for each one cost a
   * few percent of the step.
   */
  private readonly buckets: readonly (readonly [budget: number, ms: number])[];
  /** largestUseful for the draftMs it was found with (the draft's median moves a few times a generation). */
  private largest = { draftMs: NaN, budget: 0 };

  constructor(
    /** Measured before the policy is made, and not changed after (the policy keeps its buckets). */
    readonly curve: CostCurve,
    /** Milliseconds the drafter takes per step (paid whatever the budget). */
    private draftMs: number,
    /** The draft depth: a step emits at most depth + 1 tokens. */
    private readonly depth = Infinity,
  ) {
    if (curve.verifyMs.size === 0) throw new EngineError('KDTREE_ENGINE_ARGUMENT', 'the cost curve has no verify bucket', 'curve');
    this.buckets = [...curve.verifyMs].sort((x, y) => x[0] - y[0]);
  }

  /**
   * The largest budget that could ever pay: a step emits at most depth + 1 tokens, so a verify
   * (with the draft) dearer than depth + 1 decode steps loses whatever the drafter's probabilities.
   * The engine builds the tree at this budget to read its nodes' probabilities.
   */
  get largestUseful(): number {
    if (this.largest.draftMs === this.draftMs) return this.largest.budget;
    let largest = this.buckets[0][0];
    for (const [b, ms] of this.buckets) if (ms + this.draftMs <= (this.depth + 1) * this.curve.decodeMs) largest = b;
    this.largest = { draftMs: this.draftMs, budget: largest };
    return largest;
  }

  /** The calibration ratio applied to the draft probabilities, in [MIN_CALIBRATION, 2]. */
  get calibration(): number {
    // until calibrated the drafter is taken at its word; after, the ratio applies however little
    // the trees expected (a tree expecting 0.2 tokens, never accepted, must not keep a ratio of 1)
    if (!this.calibrated || this.expected <= 0) return 1;
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
    for (const [b, ms] of this.buckets) {
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
   * Whether the first m = logProbs.length nodes of the largest tree already decide plan(): in pop
   * order the nodes' probabilities fall, so each node past them adds at most the m-th's, and no
   * larger bucket's rate can then pass the best rate within them (or plain decoding's), under the
   * calibration or under 1 (the probe's check). Then plan() of these nodes is plan() of the whole
   * tree, and the engine need not build the largest tree (on cuda a tree of up to 32 nodes is one
   * launch, a larger one four).
   */
  decides(logProbs: ArrayLike<number>): boolean {
    const m = logProbs.length;
    const largest = this.largestUseful;
    if (m >= largest) return true;
    if (m === 0) return false;
    let prefix = 0;
    for (let i = 0; i < m; i++) prefix += Math.exp(logProbs[i]);
    const last = Math.exp(logProbs[m - 1]);
    const buckets = this.buckets;
    for (const cal of [this.calibration, 1]) {
      let best = 1 / this.curve.decodeMs;
      let sum = 0;
      let i = 0;
      for (const [b, ms] of buckets) {
        if (b > m) break;
        for (; i < b; i++) sum += Math.exp(logProbs[i]);
        best = Math.max(best, (1 + cal * sum) / (ms + this.draftMs));
      }
      for (const [b, ms] of buckets) {
        if (b <= m || b > largest) continue;
        if ((1 + cal * (prefix + (b - m) * last)) / (ms + this.draftMs) > best) return false;
      }
    }
    return true;
  }

  /**
   * A generation starts: the wait left by the last one is dropped (a new context: prompt lookup may
   * match where the last did not), except for a drafter not accepted once in CALIBRATION_PROBES or
   * more tries in a row that found nothing or proposed nothing, or one exploring (its probes taken,
   * no tree paying since). Its wait, sized by what its tries cost, goes on: over many short
   * generations a drafter that predicts nothing, or whose trees do not pay, then costs TRY_SHARE (or
   * UNPROVEN_TRY_SHARE) of the decode time, not a try at each start.
   */
  begin(): void {
    const fewTries = this.misses < CALIBRATION_PROBES && this.silences < CALIBRATION_PROBES;
    if ((this.proven || fewTries) && this.explorations === 0) this.debt = 0;
    this.stickyRun = 0;
    this.stickyLeft = 0;
    this.last = undefined;
  }

  /**
   * The budget of this try planned from the last tree that ran (its nodes' probabilities, read back
   * with its path), without a tree built for this try's own: where those nodes decide the plan
   * (decides: no larger bucket could pay more) and it is a calibrated tree. Undefined: plan from
   * this try's tree (or run a sticky budget). A tree run on this plan is recorded with its own
   * probabilities (record), as every tree is.
   */
  planFromLast(): number | undefined {
    const last = this.last;
    if (last === undefined || !this.calibrated || !this.decides(last)) return undefined;
    const { budget } = this.choose(last);
    return budget > 0 ? budget : undefined;
  }

  /**
   * The budget this try runs without a plan (no tree built for its probabilities, nothing read
   * back; recordSticky then says how it went), or undefined: plan. See STICKY_AFTER.
   */
  sticky(): number | undefined {
    return this.stickyLeft > 0 ? this.stickyBudget : undefined;
  }

  /**
   * What a sticky step (sticky()) accepted: nothing ends the sticky run; a token is a token (the
   * wait and misses as in record). `logProbs`: its tree's, read back, for planFromLast.
   */
  recordSticky(accepted: number, logProbs?: ArrayLike<number>): void {
    if (this.stickyLeft <= 0) throw new Error('recordSticky: no sticky step was due');
    this.stickyLeft--;
    if (logProbs !== undefined) this.last = logProbs;
    if (accepted > 0) {
      this.debt = 0;
      this.misses = 0;
      this.proven = true;
      if (this.lossMs(this.draftMs, this.stickyBudget, accepted) <= 0) this.explorations = 0;
    } else {
      this.stickyRun = 0;
      this.stickyLeft = 0;
    }
  }

  /** Whether this step tries the drafter; false: a plain decode step of the wait, which pays stepPayment of the debt. */
  tryNow(): boolean {
    if (this.wait === 0) return true;
    this.debt = Math.max(0, this.debt - this.stepPayment);
    return false;
  }

  /**
   * What a try runs, given its tree's log-probs: the chosen tree; a probe while the trees have
   * given no evidence yet (the calibration is a guess); a probe too when the calibration alone
   * rules trees out and the drafter's own probabilities would still draft, so a drafter that has
   * become good (a repetitive stretch for ngram) wins its calibration back; else 0, a plain decode
   * step.
   */
  plan(logProbs: ArrayLike<number>): BudgetPlan {
    const choice = this.choose(logProbs);
    if (choice.budget > 0) return this.calibrated ? { budget: choice.budget, probe: false, choice } : { budget: Math.min(choice.budget, PROBE_BUDGET), probe: true, choice };
    return this.choose(logProbs, 1).budget > 0 ? { budget: PROBE_BUDGET, probe: true, choice } : { budget: 0, probe: false, choice };
  }

  /**
   * What a try ran (`budget`, 0: a plain decode step; `probe` as planned) and the draft tokens it
   * accepted (bonus excluded); `logProbs`: the tree's nodes (after a plan the planning build's, of
   * which it ran the first `budget`), which a tree that is not a probe leaves to planFromLast. The
   * trees that ran teach the calibration. A try that ran no tree, or only a probe that was
   * rejected, found nothing: a wait follows, sized by its cost (stepPayment) and capped by the
   * misses in a row (2^(k-1), FIRST_WAIT, MAX_WAIT); an accepted token ends the wait, but for an
   * exploring probe's (a probe of a calibrated drafter) that cost more than decoding its tokens while
   * the calibration still rules every tree out: its loss is paid by a wait capped at 2^(k-1) steps
   * for the k-th such probe since a tree or probe last paid.
   */
  record(logProbs: ArrayLike<number>, budget: number, accepted: number, probe = false): void {
    this.silences = 0;
    // a probe of a calibrated drafter explores: its calibration ruled every tree out (plan)
    const exploring = probe && this.calibrated;
    if (budget > 0) {
      let sum = 0;
      for (let i = 0; i < Math.min(budget, logProbs.length); i++) sum += Math.exp(logProbs[i]);
      this.trees++;
      this.accepted = CALIBRATION_DECAY * this.accepted + accepted;
      this.expected = CALIBRATION_DECAY * this.expected + sum;
    }
    // a probe's one node decides nothing past it; a plain step ran no tree
    this.last = budget > 0 && !probe ? logProbs : undefined;
    // the same budget planned and accepted STICKY_AFTER times in a row: it runs on without plans
    // (where planFromLast cannot plan); any other tree ends a sticky run still due, since a tree
    // planned from the last one may run while a run is due
    if (budget > 0 && !probe && accepted > 0) {
      this.stickyRun = budget === this.stickyBudget ? this.stickyRun + 1 : 1;
      this.stickyBudget = budget;
      this.stickyLeft = this.stickyRun >= STICKY_AFTER ? STICKY_STEPS : 0;
    } else {
      this.stickyRun = 0;
      this.stickyLeft = 0;
    }
    const decode = this.curve.decodeMs;
    const draftMs = this.lastDraftMs ?? this.draftMs;
    const loss = budget > 0 ? this.lossMs(draftMs, budget, accepted) : 0;
    if (accepted > 0 && exploring) {
      // an exploring probe taken: where it did not pay and the calibration it taught still rules
      // every tree out, the plain steps after it pay for it, the waits growing with the
      // explorations since a tree last paid (else an accurate first node keeps a drafter too dear
      // for its trees on probes, each a loss); one that paid is a tree that paid
      this.misses = 0;
      this.proven = true;
      if (loss <= 0) this.explorations = 0;
      else if (this.choose(logProbs).budget === 0) {
        this.explorations++;
        this.debt = Math.min(Math.min(MAX_WAIT, 2 ** (this.explorations - 1)) * this.stepPayment, this.debt + loss);
      }
    } else if (accepted > 0) {
      this.debt = 0;
      this.misses = 0;
      this.proven = true;
      if (!probe && loss <= 0) this.explorations = 0;
    } else if (budget === 0 || probe) {
      this.misses++;
      const cost = draftMs + (budget > 0 ? Math.max(0, this.verifyMs(budget) - decode) : 0);
      const steps = this.proven || this.misses < CALIBRATION_PROBES ? Math.min(MAX_WAIT, 2 ** (this.misses - 1)) : this.misses === CALIBRATION_PROBES ? FIRST_WAIT : MAX_WAIT;
      this.debt = Math.min(steps * this.stepPayment, this.debt + cost);
    }
  }

  /**
   * Plain decode steps left before the next try: the whole payments the debt still holds. What is
   * left of a payment carries over to the next try's debt, so a try cheaper than a payment (prompt
   * lookup finding no match) waits for nothing until such tries add up to one.
   */
  get wait(): number {
    return Math.max(0, Math.floor(this.debt / this.stepPayment + 1e-9));
  }

  /**
   * What a plain decode step of a wait pays off: TRY_SHARE of a decode step, UNPROVEN_TRY_SHARE for
   * a drafter never accepted whose draft (the median of its tries) costs more than a decode step (a
   * decode measured at 0 ms, a clock too coarse, must not make every wait infinite). Neither input
   * changes during a wait: `proven` is set before any debt it sizes (a taken token), and a try's
   * measurement comes only once the wait is over. What is left of a payment when a try runs (wait)
   * may then be measured in the smaller payment: at most UNPROVEN_TRY_SHARE / TRY_SHARE plain
   * steps more, once.
   */
  private get stepPayment(): number {
    const decode = Math.max(this.curve.decodeMs, 1e-6);
    const dearAndUnproven = !this.proven && this.draftMs > decode;
    return (dearAndUnproven ? UNPROVEN_TRY_SHARE : TRY_SHARE) * decode;
  }

  /**
   * A measurement of the drafter's step (the draft, and the tree build read back): the policy uses
   * the median of the last DRAFT_SAMPLES, so a one-off (a draft that captured a new graph) neither
   * rules trees out nor stretches the waits, and ngram's steps with and without a match even out.
   * The policy's first measurement is left out of the median: that try built its tree at the
   * largest budget before any cost was known and may have captured the drafter's graphs, so the
   * first plan takes the drafter at its word (a probe at most, while uncalibrated). What a try
   * that found nothing costs (the wait after it) is its own measurement, but for a silent try that
   * was not timed (recordSilent).
   */
  updateDraftMs(ms: number): void {
    this.lastDraftMs = ms;
    if (!this.measured) {
      this.measured = true;
      return;
    }
    this.draftSamples.push(ms);
    if (this.draftSamples.length > DRAFT_SAMPLES) this.draftSamples.shift();
    const sorted = [...this.draftSamples].sort((x, y) => x - y);
    this.draftMs = sorted[Math.floor(sorted.length / 2)];
  }

  /**
   * A try whose drafter proposed nothing (Drafter.draft returned false), and its measured cost
   * (undefined: it was not timed, see sampleDue; the last timed silent try's cost stands in, or
   * before any, the last draft's, which is more). Like
   * every try that found nothing it is paid for by plain decode steps (TRY_SHARE of a decode step
   * each, as in record), but it is no miss: a drafter with nothing to propose says nothing of how its
   * proposals fare (prompt lookup finds no earlier match for the last tokens, and may find one at the
   * next step), so it neither lengthens the waits after later misses nor ends a run of them. Nor is
   * its cost a sample of what a draft costs (a prompt-lookup try without a match does almost nothing,
   * and would make trees look cheaper than they are).
   */
  recordSilent(measuredMs?: number): void {
    if (measuredMs !== undefined) this.silentMs = measuredMs;
    const ms = this.silentMs ?? this.lastDraftMs ?? this.draftMs;
    this.last = undefined;
    this.stickyRun = 0;
    this.stickyLeft = 0;
    // capped as a proven drafter's misses are, by its own count: no match now is little proof that
    // none comes at the next token
    this.silences++;
    this.debt = Math.min(Math.min(MAX_WAIT, 2 ** (this.silences - 1)) * this.stepPayment, this.debt + ms);
  }

  /**
   * Whether this try planned from the last tree is to be timed (then updateDraftMs, or recordSilent
   * with its cost): while the median lacks DRAFT_SAMPLES samples, then every DRAFT_SAMPLE_EVERY-th
   * such try. Counts the try.
   */
  sampleDue(): boolean {
    if (this.draftSamples.length < DRAFT_SAMPLES || ++this.unsampled >= DRAFT_SAMPLE_EVERY) {
      this.unsampled = 0;
      return true;
    }
    return false;
  }

  /**
   * More of the last measured try (a second tree build it had to run): added to its measurement,
   * the one the median and a wait after it use.
   */
  amendDraftMs(ms: number): void {
    if (this.lastDraftMs === undefined) return;
    this.lastDraftMs += ms;
    if (this.draftSamples.length === 0) return;
    this.draftSamples[this.draftSamples.length - 1] += ms;
    const sorted = [...this.draftSamples].sort((x, y) => x - y);
    this.draftMs = sorted[Math.floor(sorted.length / 2)];
  }

  /** What a try of a `budget`-node tree cost over decoding the tokens it emitted (at most 0: it paid). */
  private lossMs(draftMs: number, budget: number, accepted: number): number {
    return draftMs + this.verifyMs(budget) - (1 + accepted) * this.curve.decodeMs;
  }

  private verifyMs(budget: number): number {
    return this.curve.verifyMs.get(budget) ?? Math.min(...this.curve.verifyMs.values());
  }
}
