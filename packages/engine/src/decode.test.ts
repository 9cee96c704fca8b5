/**
 * Decoding on the engine: greedy equals the golden reference's greedy tokens, and chain and DDTree
 * speculation equal greedy for every drafter, budget and depth (a divergence is a bug, never a
 * tolerance). Then the API's contract: tracing, eos, errors that leave the engine usable, abort,
 * queued generations, dispose.
 */
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { greedyDecode, loadModel, modelDrafter, argmax } from '@kdtree/reference';
import { BUDGET_BUCKETS, createEngine, EngineError, ModelSource, NgramDrafter, type Drafter, type Engine, type GenerateOptions } from './index.js';
import type { DeviceTensor } from '@kdtree/cuda';
import { PROBE_BUDGET, STICKY_AFTER, type CostCurve } from './budget.js';
import { syntheticPair, tempDir, TEST_BACKEND, type ModelPair } from './test-support/models.js';

const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];
const MAX_NEW = 40;

interface Setup {
  pair: ModelPair;
  engine: Engine;
  greedy: number[];
}

async function setup(dir: string, quant: 'kimi-k2' | 'seed' | undefined, seed: number): Promise<Setup> {
  const pair = await syntheticPair(dir, 'tiny', seed, quant);
  const { model } = await loadModel(pair.target);
  const greedy = greedyDecode(model, PROMPT, { maxNew: MAX_NEW, eos: [] }).tokens;
  const engine = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 256, cacheDtype: 'f32', activations: 'f32', maxBudget: 128 });
  return { pair, engine, greedy };
}

/** A drafter of `engine`'s vocabulary that writes `logits(tokens, depth, V)` ([depth, V]) as its draft. */
function logitsDrafter(engine: Engine, name: string, logits: (tokens: readonly number[], depth: number, V: number) => Float32Array): Drafter {
  const V = engine.config.vocabSize;
  return {
    name,
    vocabSize: V,
    maxDepth: 16,
    begin() {},
    draft({ tokens, depth, out }) {
      engine.backend.native.upload(out.buffer, logits(tokens, depth, V), out.offset ?? 0);
    },
    dispose() {},
  };
}

/** A drafter certain of greedy's next tokens (logit 30, the rest -30), and right. */
function alwaysRight(engine: Engine, greedy: number[], name: string): Drafter {
  return logitsDrafter(engine, name, (tokens, d, V) => {
    const logits = new Float32Array(d * V).fill(-30);
    const emitted = tokens.length - PROMPT.length;
    for (let i = 0; i < d; i++) logits[i * V + (greedy[emitted + i] ?? 0)] = 30;
    return logits;
  });
}

/**
 * Runs `fn` with auto's cost curve at `depth` set to trees cheap to verify (every bucket up to 128
 * useful, each node a little dearer than the last; a decode step `decodeMs`, against which the
 * drafter's measured time weighs) and every tree auto builds for its probabilities recorded (its
 * budget), then puts the engine back.
 */
async function withCheapTrees(engine: Engine, depth: number, fn: (builds: number[]) => Promise<void>, decodeMs = 1): Promise<void> {
  const e = engine as unknown as { costs: Map<number, CostCurve>; buildForLogProbs(logits: DeviceTensor, budget: number): Float32Array };
  const saved = e.costs.get(depth);
  e.costs.set(depth, { decodeMs, verifyMs: new Map(BUDGET_BUCKETS.filter((k) => k <= 128).map((k) => [k, decodeMs * (1 + k / 1000)])) });
  const build = e.buildForLogProbs.bind(e);
  const builds: number[] = [];
  e.buildForLogProbs = (logits, budget) => {
    builds.push(budget);
    return build(logits, budget);
  };
  try {
    await fn(builds);
  } finally {
    delete (e as { buildForLogProbs?: unknown }).buildForLogProbs;
    if (saved === undefined) e.costs.delete(depth);
    else e.costs.set(depth, saved);
  }
}

describe(`decoding on the engine (${TEST_BACKEND})`, () => {
  const dir = tempDir();
  const setups: Record<string, Setup> = {};
  beforeAll(async () => {
    setups['kimi-k2'] = await setup(dir, 'kimi-k2', 11);
    setups.seed = await setup(dir, 'seed', 12);
    setups.float = await setup(dir, undefined, 13);
  });
  afterAll(async () => {
    for (const s of Object.values(setups)) await s.engine.dispose();
  });

  for (const quant of ['kimi-k2', 'seed', 'float'] as const) {
    describe(quant === 'float' ? 'float (bf16 weights, routed experts too)' : `INT4 ${quant === 'kimi-k2' ? 'routed experts (Kimi K2)' : 'MLPs (seed scheme)'}`, () => {
      it('greedy equals the reference, streamed one token a chunk', async () => {
        const { engine, greedy } = setups[quant];
        const chunks: number[][] = [];
        let stats;
        for await (const chunk of engine.generate(PROMPT, { maxNew: MAX_NEW, eos: [] })) {
          chunks.push(chunk.tokens);
          stats = chunk.stats ?? stats;
        }
        expect(chunks.flat()).toEqual(greedy);
        expect(chunks.every((c) => c.length === 1)).toBe(true);
        expect(stats).toMatchObject({ spec: 'greedy', steps: MAX_NEW - 1, meanAcceptedLength: 1, stoppedBy: 'max', targetForwards: MAX_NEW });
      });

      for (const drafter of ['ngram', 'model']) {
        for (const spec of ['chain', 'ddtree'] as const) {
          it(`${spec} with the ${drafter} drafter equals greedy at budgets 1..128${spec === 'ddtree' ? ' and auto' : ''} and depths 1..16`, async () => {
            const { engine, greedy, pair } = setups[quant];
            const d = drafter === 'model' ? `model:${pair.draft}` : 'ngram';
            const accepted: number[] = [];
            for (const depth of [1, 2, 3, 4, 8, 16]) {
              for (const budget of [1, 2, 3, 5, 8, 16, 33, 64, 128]) {
                if (spec === 'chain' && budget > depth + 1 && budget !== 128) continue; // longer chains are cut at the depth
                const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec, drafter: d, budget, depth });
                expect(r.tokens, `budget ${budget}, depth ${depth}`).toEqual(greedy);
                expect(r.stats.steps).toBeLessThanOrEqual(MAX_NEW - 1);
                accepted.push(r.stats.meanAcceptedLength);
              }
            }
            if (spec === 'ddtree') {
              for (const depth of [1, 4, 16]) {
                const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec, drafter: d, budget: 'auto', depth, trace: true });
                expect(r.tokens, `auto, depth ${depth}`).toEqual(greedy);
                expect(r.steps.every((s) => s.budget === 0 || BUDGET_BUCKETS.includes(s.budget))).toBe(true);
              }
            }
            // the drafters predict something: some configuration accepts more than the bonus alone
            expect(Math.max(...accepted)).toBeGreaterThan(1);
          });
        }
      }
    });
  }

  it("bf16 activations and a bf16 cache (the cuda defaults): chain and ddtree equal that engine's own greedy, INT4 and float", async () => {
    for (const quant of ['kimi-k2', 'float'] as const) {
      const { pair } = setups[quant];
      const engine = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 256, cacheDtype: 'bf16', activations: 'bf16', maxBudget: 64 });
      try {
        const greedy = (await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens;
        for (const [spec, drafter, budget, depth] of [['chain', 'ngram', 4, 4], ['ddtree', 'ngram', 16, 4], ['ddtree', `model:${pair.draft}`, 8, 3], ['ddtree', `model:${pair.draft}`, 'auto', 4]] as const) {
          const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec, drafter, budget, depth });
          expect(r.tokens, `${quant}: ${spec} ${drafter} budget ${budget} depth ${depth}`).toEqual(greedy);
        }
      } finally {
        await engine.dispose();
      }
    }
  });

  it("the trace: a model drafter's argmax at each depth equals the reference draft model's", async () => {
    const { engine, pair, greedy } = setups['kimi-k2'];
    const { model: draft } = await loadModel(pair.draft);
    const refDrafter = modelDrafter(draft);
    const depth = 4;
    const r = await engine.complete(PROMPT, { maxNew: 24, eos: [], spec: 'ddtree', drafter: `model:${pair.draft}`, budget: 8, depth, trace: true });
    expect(r.tokens).toEqual(greedy.slice(0, 24));
    expect(r.steps.length).toBe(r.stats.steps);
    let emitted = 1;
    for (const step of r.steps) {
      const context = [...PROMPT, ...greedy.slice(0, emitted)];
      const logits = refDrafter(context, depth);
      const vocab = draft.config.vocabSize;
      expect(step.draftTop1).toEqual(Array.from({ length: depth }, (_, d) => argmax(logits, d * vocab, vocab)));
      expect(step.treeSize).toBe(9);
      emitted += step.accepted + 1;
    }
  });

  it('ngram at a fixed budget decodes plainly where the context has no earlier match of its suffix, and verifies a tree where it has one; exact', async () => {
    const { engine } = setups['kimi-k2'];
    const depth = 4;
    // a prompt that repeats itself, so some steps match and the greedy tokens (which may loop) add more
    const prompt = [...PROMPT, ...PROMPT.slice(0, 3)];
    const plain = await engine.complete(prompt, { maxNew: 24, eos: [] });
    const r = await engine.complete(prompt, { maxNew: 24, eos: [], spec: 'ddtree', drafter: 'ngram', budget: 8, depth, trace: true });
    expect(r.tokens).toEqual(plain.tokens);
    let emitted = 1;
    const kinds = new Set<string>();
    for (const step of r.steps) {
      const matched = NgramDrafter.continuations([...prompt, ...plain.tokens.slice(0, emitted)], depth, 4)[0].size > 0;
      expect(step.treeSize, `step at ${emitted} tokens`).toBe(matched ? 9 : 1);
      kinds.add(matched ? 'tree' : 'plain');
      emitted += step.accepted + 1;
    }
    expect([...kinds].sort()).toEqual(['plain', 'tree']);
  });

  it("reports budget auto's measurement of the cost curve (once per depth) apart from the prefill: calibrationMs", async () => {
    const { engine } = setups['kimi-k2'];
    const e = engine as unknown as { costs: Map<number, CostCurve> };
    const depth = 3;
    const saved = e.costs.get(depth);
    e.costs.delete(depth);
    try {
      // a drafter of its own: no policy kept for it, so its first generation measures the curve
      const drafter = logitsDrafter(engine, 'flat', (_, d, V) => new Float32Array(d * V));
      const options = { maxNew: 4, eos: [], spec: 'ddtree', drafter, budget: 'auto', depth } as const;
      const first = await engine.complete(PROMPT, options);
      expect(e.costs.has(depth)).toBe(true);
      expect(first.stats.calibrationMs).toBeGreaterThan(0);
      const again = await engine.complete(PROMPT, options);
      expect(again.stats.calibrationMs).toBe(0);
      expect((await engine.complete(PROMPT, { maxNew: 4, eos: [] })).stats.calibrationMs).toBe(0);
    } finally {
      if (saved !== undefined) e.costs.set(depth, saved);
    }
  });

  it('ngram auto plans every try on the host (NgramDrafter.treeLogProbs): no tree built for its probabilities, none planned from the last tree or sticky; exact', async () => {
    const { engine } = setups['kimi-k2'];
    const depth = 4;
    const prompt = [...PROMPT, ...PROMPT.slice(0, 3)];
    const plain = await engine.complete(prompt, { maxNew: 24, eos: [] });
    const plans = vi.spyOn(NgramDrafter.prototype, 'treeLogProbs');
    // a drafter of its own: a fresh policy, whatever earlier tests taught the engine's 'ngram'
    const drafter = new NgramDrafter(engine.backend, engine.config.vocabSize, 16);
    try {
      // a decode step of a second on the curve: the tries' measured costs (a fraction of a
      // millisecond here) never add up to a wait, so every step with a match tries and plans
      await withCheapTrees(engine, depth, async (builds) => {
        // twice: the second generation starts from the calibration the first taught
        for (let g = 0; g < 2; g++) {
          plans.mockClear();
          const r = await engine.complete(prompt, { maxNew: 24, eos: [], spec: 'ddtree', drafter, budget: 'auto', depth, trace: true });
          expect(r.tokens).toEqual(plain.tokens);
          const trees = r.steps.filter((s) => s.budget > 0).length;
          expect(trees).toBeGreaterThan(0);
          // each step whose context has a match planned from its own draft's tree (no waits here),
          // and each tree that ran was one of those
          let emitted = 1;
          let matched = 0;
          for (const step of r.steps) {
            if (NgramDrafter.continuations([...prompt, ...plain.tokens.slice(0, emitted)], depth, 4)[0].size > 0) matched++;
            emitted += step.accepted + 1;
          }
          expect(plans.mock.calls.length).toBe(matched);
          expect(trees).toBeLessThanOrEqual(matched);
        }
        expect(builds).toEqual([]);
      }, 1000);
    } finally {
      plans.mockRestore();
      drafter.dispose();
    }
  });

  it("a model drafter catches up on tokens decoded without drafting in captured power-of-two steps (36 tokens: 32 + 2 + 1, then the last), and drafts the reference draft model's argmax", async () => {
    const { engine, pair, greedy } = setups['kimi-k2'];
    const { model: draft } = await loadModel(pair.draft);
    const refDrafter = modelDrafter(draft);
    // a drafter of its own: the engine's shared one writes into the engine's draft logits
    const source = await ModelSource.open(pair.draft);
    const drafter = await engine.modelDrafter(source).finally(() => source.close());
    const b = engine.backend;
    const V = draft.config.vocabSize;
    const depth = 3;
    const out = b.zeros('f32', [16, V]);
    try {
      drafter.begin();
      for (const emitted of [1, 2, 38, 40]) {
        const context = [...PROMPT, ...greedy.slice(0, emitted)];
        drafter.draft({ tokens: context, depth, out });
        const logits = b.toArray(out) as Float32Array;
        const want = refDrafter(context, depth);
        const top1 = (x: Float32Array) => Array.from({ length: depth }, (_, d) => argmax(x, d * V, V));
        expect(top1(logits), `after ${emitted} emitted tokens`).toEqual(top1(want));
      }
    } finally {
      b.free(out);
      drafter.dispose();
    }
  });

  it("keeps auto's policy (its calibration) for the next generation with the same drafter and depth: the first probes a confident drafter that is always wrong, the second goes on from what those trees taught", async () => {
    const { engine, greedy } = setups['kimi-k2'];
    // certain of draft tokens that are never the target's (each greedy token + 1 + depth); the
    // target's own token at each depth is the least likely of all, so no tree of any budget auto
    // picks holds it (the other tokens tie, and a wide tree would otherwise take some of them)
    const wrong = logitsDrafter(engine, 'always-wrong', (tokens, depth, V) => {
      const logits = new Float32Array(depth * V).fill(-30);
      const emitted = tokens.length - PROMPT.length;
      const next = greedy[emitted] ?? 0;
      for (let d = 0; d < depth; d++) {
        logits[d * V + ((next + 1 + d) % V)] = 30;
        const target = greedy[emitted + d];
        if (target !== undefined) logits[d * V + target] = -60;
      }
      return logits;
    });
    const options = { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: wrong, budget: 'auto', depth: 3, trace: true } as const;
    expect(engine.autoPolicy(wrong, 3)).toBeUndefined();
    // trees that would pay were the drafter right, whatever this machine's timings (on the cpu
    // twin a verify of 2 nodes costs nearly 2 decode steps, and a loaded machine tips the choice)
    await withCheapTrees(
      engine,
      3,
      async () => {
        const first = await engine.complete(PROMPT, options);
        const kept = engine.autoPolicy(wrong, 3);
        expect(kept).toBeDefined();
        // a fresh policy takes the drafter's certainty on trust only as far as a probe, and none was accepted
        expect(first.steps[0].budget).toBe(PROBE_BUDGET);
        expect(kept!.calibrated).toBe(true);
        const second = await engine.complete(PROMPT, options);
        expect(engine.autoPolicy(wrong, 3)).toBe(kept);
        expect(engine.autoPolicy(wrong, 4)).toBeUndefined();
        expect(first.tokens).toEqual(greedy);
        expect(second.tokens).toEqual(greedy);
        expect([...first.steps, ...second.steps].every((s) => s.accepted === 0)).toBe(true);
      },
      1000,
    );
  });

  it("auto builds the largest tree's first 32 nodes (one launch on cuda) and the whole tree only where those do not decide its plan; exact either way", async () => {
    const { engine, greedy } = setups['kimi-k2'];
    // sure of one token a depth (the nodes past 32 add nothing) or unsure of all (each node past 32
    // as likely as the 32nd: a tree of 128 might pay)
    const drafter = (name: string, sure: boolean) =>
      logitsDrafter(engine, name, (tokens, d, V) => {
        const logits = new Float32Array(d * V);
        if (sure) for (let i = 0; i < d; i++) logits[i * V + ((tokens.at(-1)! + i) % V)] = 30;
        return logits;
      });
    for (const sure of [true, false]) {
      await withCheapTrees(engine, 5, async (budgets) => {
        const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: drafter(sure ? 'sure' : 'unsure', sure), budget: 'auto', depth: 5 });
        expect(r.tokens).toEqual(greedy);
        expect(budgets[0]).toBe(32);
        // each whole tree right after the 32 nodes that did not decide
        budgets.forEach((k, i) => expect(k === 32 || (k === 128 && budgets[i - 1] === 32)).toBe(true));
        if (sure) expect(budgets.every((k) => k === 32)).toBe(true);
        else expect(budgets.filter((k) => k === 128).length).toBeGreaterThan(0);
      });
    }
  });

  it('auto runs a budget it planned and had accepted a few times in a row without plans (no tree built for its probabilities) for a few steps; exact', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const right = alwaysRight(engine, greedy, 'always-right');
    await withCheapTrees(engine, 4, async (builds) => {
      const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: right, budget: 'auto', depth: 4, trace: true });
      expect(r.tokens).toEqual(greedy);
      const trees = r.steps.filter((s) => s.budget > 0).length;
      // the first plans (probes, then STICKY_AFTER trees) build; sticky steps do not (nor do trees
      // planned from the last one: with a sure chain of exactly 4 nodes, 4-node trees cannot tell
      // whether more nodes would pay, so sticky runs are what skips the plans here)
      expect(trees).toBeGreaterThan(STICKY_AFTER + 2);
      expect(builds.length).toBeLessThan(trees);
      expect(r.steps.every((s) => s.budget === 0 || s.accepted > 0)).toBe(true);
    });
  });

  it('auto plans a try from the last tree it ran (no tree built for its probabilities) once that tree decides: a drafter sure of 5 tokens runs 6-node trees on plans made once; exact', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const right = alwaysRight(engine, greedy, 'always-right-5');
    await withCheapTrees(engine, 5, async (builds) => {
      const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: right, budget: 'auto', depth: 5, trace: true });
      expect(r.tokens).toEqual(greedy);
      const trees = r.steps.filter((s) => s.budget > 0);
      // 5 sure nodes: the best bucket is 6 (its sixth node adds nothing, and so decides that no
      // larger tree pays); a probe and the first plan build, every later try plans from the last tree
      expect(trees.length).toBeGreaterThan(3);
      expect(builds).toEqual([32, 32]);
      // (the last tree stops at maxNew)
      expect(trees.slice(builds.length).map((s) => s.budget)).toEqual(Array(trees.length - builds.length).fill(6));
      expect(trees.slice(builds.length, -1).every((s) => s.accepted === 5)).toBe(true);
    });
  });

  it('auto decodes plainly where a drafter proposes nothing (draft() returns false), whichever way the try was planned, and tells its policy; exact', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const depth = 4;
    const routes = new Set<string>();
    for (const period of [6, 3]) {
      // sure and right, but silent on every period-th request, its logits then all equal (as if it
      // proposed V guesses): between silences of period 6 a plan, a tree planned from the last, a
      // plan, then sticky steps; of period 3 the planned tries fall silent too
      const right = alwaysRight(engine, greedy, `always-right-silent-${period}`);
      const uniform = logitsDrafter(engine, 'uniform', (_, d, V) => new Float32Array(d * V));
      let requests = 0;
      let route = 'plan';
      // what each try did, in order: its route when silent, then the policy's calls; and the
      // trees built for plans before each event
      const events: string[] = [];
      const builtBefore: number[] = [];
      let builds: number[] = [];
      const log = (e: string) => {
        events.push(e);
        builtBefore.push(builds.length);
      };
      const silent: Drafter = {
        ...right,
        draft(request) {
          if (++requests % period !== 0) {
            log('draft');
            return right.draft(request);
          }
          log(`silent ${route}`);
          uniform.draft(request);
          return false;
        },
      };
      await withCheapTrees(engine, depth, async (planBuilds) => {
        builds = planBuilds;
        const options = { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: silent, budget: 'auto', depth, trace: true } as const;
        expect((await engine.complete(PROMPT, options)).tokens).toEqual(greedy);
        // the kept policy, watched in the second generation: each try's route, and what it was told
        const policy = engine.autoPolicy(silent, depth)!;
        const fromLast = policy.planFromLast.bind(policy);
        const sticky = policy.sticky.bind(policy);
        const record = policy.record.bind(policy);
        const recordSticky = policy.recordSticky.bind(policy);
        const recordSilent = policy.recordSilent.bind(policy);
        const draftMs = policy.updateDraftMs.bind(policy);
        policy.planFromLast = () => {
          const b = fromLast();
          route = b === undefined ? 'plan' : 'last';
          return b;
        };
        policy.sticky = () => {
          const b = sticky();
          if (b !== undefined) route = 'sticky';
          return b;
        };
        policy.record = (logProbs, budget, accepted, probe) => (log(`record ${budget} ${accepted}`), record(logProbs, budget, accepted, probe));
        policy.recordSticky = (accepted, logProbs) => (log(`sticky ${accepted}`), recordSticky(accepted, logProbs));
        policy.recordSilent = (ms) => (log('record silent'), recordSilent(ms));
        policy.updateDraftMs = (ms) => (log('draft ms'), draftMs(ms));
        events.length = 0;
        builtBefore.length = 0;
        const r = await engine.complete(PROMPT, options);
        expect(r.tokens).toEqual(greedy);
        // silent requests became plain steps, never trees of guesses (which accept nothing)
        expect(r.steps.every((s) => s.budget === 0 || s.accepted > 0)).toBe(true);
        // a silent try's cost is no draft sample and it is no miss: it is recorded as silent, or ends a sticky run
        const told = { plan: ['record silent'], last: ['record silent'], sticky: ['sticky 0'] } as Record<string, string[]>;
        events.forEach((e, i) => {
          if (!e.startsWith('silent ')) return;
          const r = e.slice('silent '.length);
          routes.add(r);
          const end = events.slice(i + 1).findIndex((x) => x === 'draft' || x.startsWith('silent '));
          const last = end < 0 ? events.length : i + 1 + end;
          expect(events.slice(i + 1, last), `${e} (period ${period})`).toEqual(told[r]);
          // and built no tree for a plan
          expect((end < 0 ? builds.length : builtBefore[last]) - builtBefore[i], `${e} (period ${period})`).toBe(0);
        });
      });
    }
    expect([...routes].sort()).toEqual(['last', 'plan', 'sticky']);
  });

  it('eos stops the generation at the token, in every mode', async () => {
    const { engine, greedy, pair } = setups['kimi-k2'];
    const stop = greedy[13];
    const expected = greedy.slice(0, greedy.indexOf(stop) + 1);
    for (const options of [{}, { spec: 'ddtree', drafter: 'ngram', budget: 8 }, { spec: 'chain', drafter: `model:${pair.draft}`, budget: 4 }] as Partial<GenerateOptions>[]) {
      const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [stop], ...options });
      expect(r.tokens).toEqual(expected);
      expect(r.stats.stoppedBy).toBe('eos');
    }
  });

  it('profileDecode times every part of a decode step (each layer, the router apart, lm_head), needs prompt + 3 slots, and leaves no sequence behind', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const parts = await engine.profileDecode(PROMPT);
    const names = parts.map((p) => p.part);
    expect(names[0]).toBe('embedding');
    expect(names.at(-1)).toBe('lm_head');
    for (const l of [0, 1]) for (const part of ['kv', 'q', 'mla', 'attention']) expect(names).toContain(`${part} ${l}`);
    expect(names).toContain('router 1');
    expect(names).toContain('routed 1');
    for (const p of parts) expect(p.ms).toBeGreaterThanOrEqual(0);
    const tight = await createEngine({ model: setups['kimi-k2'].pair.target, backend: TEST_BACKEND, cacheTokens: PROMPT.length + 2 });
    try {
      await expect(tight.profileDecode(PROMPT)).rejects.toThrow(new RegExp(`needs ${PROMPT.length + 3} cache slots, the cache has ${PROMPT.length + 2}`));
    } finally {
      await tight.dispose();
    }
    // the next generation starts from an empty cache
    expect((await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens).toEqual(greedy);
  });

  it('greedy decodes a step ahead: the step queued after an eos or an abort is taken back (L is what the steps read leave), none is queued past maxNew, and the next generation is exact', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const runner = (engine as unknown as { runner: { committed: number; launchDecode(): void } }).runner;
    const launch = runner.launchDecode.bind(runner);
    let launched = 0;
    runner.launchDecode = () => {
      launched++;
      launch();
    };
    try {
      // maxNew: the prefill's token and MAX_NEW - 1 steps, each launched ahead, none past the last
      expect((await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens).toEqual(greedy);
      expect(launched).toBe(MAX_NEW - 1);
      expect(runner.committed).toBe(PROMPT.length + MAX_NEW - 1);
      // eos at the 14th token: 13 steps read, the 14th queued ahead and taken back
      launched = 0;
      const stop = greedy[13];
      const upTo = greedy.indexOf(stop) + 1;
      const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [stop] });
      expect(r.tokens).toEqual(greedy.slice(0, upTo));
      expect(r.stats.targetForwards).toBe(upTo);
      expect(launched).toBe(upTo);
      expect(runner.committed).toBe(PROMPT.length + upTo - 1);
      // an abort after 5 tokens
      const controller = new AbortController();
      const seen: number[] = [];
      const run = async () => {
        for await (const chunk of engine.generate(PROMPT, { maxNew: MAX_NEW, eos: [], signal: controller.signal })) {
          seen.push(...chunk.tokens);
          if (seen.length >= 5) controller.abort(new Error('enough'));
        }
      };
      await expect(run()).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ABORTED' });
      expect(seen).toEqual(greedy.slice(0, 5));
      expect(runner.committed).toBe(PROMPT.length + 4);
      expect((await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens).toEqual(greedy);
    } finally {
      delete (runner as { launchDecode?: unknown }).launchDecode;
    }
  });

  it('scratchSlots is the room a generation leaves: prompt + maxNew + scratchSlots = cacheTokens fits, one more does not', async () => {
    const { engine } = setups['kimi-k2'];
    const cap = engine.options.cacheTokens;
    const cases: GenerateOptions[] = [{ maxNew: 0 }, { maxNew: 0, spec: 'ddtree', budget: 8, depth: 3 }, { maxNew: 0, spec: 'chain', depth: 12, budget: 2 }, { maxNew: 0, spec: 'ddtree', budget: 'auto' }];
    expect(cases.map((o) => engine.scratchSlots(o))).toEqual([1, 9, 13, engine.options.maxBudget + 1]);
    for (const o of cases) {
      const room = cap - PROMPT.length - engine.scratchSlots(o);
      await expect(engine.complete(PROMPT, { ...o, maxNew: room + 1, eos: [] })).rejects.toThrow(/exceed the KV cache/);
    }
    // the largest request that fits runs (greedy: every slot of the cache but the step's one)
    const room = cap - PROMPT.length - engine.scratchSlots({});
    expect((await engine.complete(PROMPT, { maxNew: room, eos: [] })).tokens).toHaveLength(room);
  });

  it('bad requests throw a clear EngineError and leave the engine usable', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const bad: [string, () => Promise<unknown>, RegExp][] = [
      ['token outside the vocabulary', () => engine.complete([1, 128], { maxNew: 4 }), /prompt\[1\]: token 128 is outside the vocabulary \[0, 128\)/],
      ['empty prompt', () => engine.complete([], { maxNew: 4 }), /prompt: needs at least one token/],
      ['beyond the cache', () => engine.complete(PROMPT, { maxNew: 250 }), /exceed the KV cache of 256 tokens/],
      ['budget out of range', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', budget: 129 }), /budget: expected an integer in \[1, 128\] \(the engine's maxBudget\), got 129/],
      ['auto for a chain', () => engine.complete(PROMPT, { maxNew: 4, spec: 'chain', budget: 'auto' }), /budget: 'auto' chooses a DDTree budget/],
      ['depth out of range', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', depth: 17 }), /depth: expected an integer in \[1, 16\] \(the engine's maxDepth\), got 17/],
      ['unknown spec', () => engine.complete(PROMPT, { maxNew: 4, spec: 'beam' as 'greedy' }), /spec: expected one of greedy, chain, ddtree/],
      ['unknown drafter', () => engine.complete(PROMPT, { maxNew: 4, spec: 'chain', drafter: 'oracle' }), /drafter: expected 'ngram', 'model:PATH' or 'dflash:PATH'/],
      ['maxNew not an integer', () => engine.complete(PROMPT, { maxNew: 1.5 }), /maxNew: expected an integer >= 0, got 1\.5/],
      ['maxNew negative', () => engine.complete(PROMPT, { maxNew: -1 }), /maxNew: expected an integer >= 0, got -1/],
      // eslint-disable-next-line no-sparse-arrays
      ['a hole in the prompt', () => engine.complete([1, , 3] as number[], { maxNew: 4 }), /prompt\[1\]: expected an integer token id, got nothing \(a hole in the array\)/],
      ['a prompt of text', () => engine.complete('1,2' as unknown as number[], { maxNew: 4 }), /prompt: expected an array of token ids, got string/],
      ['a token as a string', () => engine.complete(['1'] as unknown as number[], { maxNew: 4 }), /prompt\[0\]: expected an integer token id, got "1" \(a string\)/],
      ['no options', () => engine.complete(PROMPT, undefined as unknown as { maxNew: number }), /options: expected the generation's options/],
      ['eos not an array', () => engine.complete(PROMPT, { maxNew: 4, eos: 5 as unknown as number[] }), /eos: expected an array of token ids, got number/],
      ['a drafter that is no Drafter', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: {} as Drafter }), /drafter: expected 'ngram', 'model:PATH', 'dflash:PATH' or a Drafter/],
      ['a drafter of no depth', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: { ...logitsDrafter(engine, 'shallow', (_, d, V) => new Float32Array(d * V)), maxDepth: 0 } }), /drafter shallow: maxDepth must be a positive integer, got 0/],
      ['a drafter without begin()', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: { ...logitsDrafter(engine, 'headless', (_, d, V) => new Float32Array(d * V)), begin: undefined } as unknown as Drafter }), /drafter headless: begin must be a method/],
      ['model: without a path', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: 'model:' }), /drafter: model: needs the path of its model after the colon/],
      ['a drafter path that does not exist', () => engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: 'dflash:/nonexistent/dir' }), /drafter dflash:\/nonexistent\/dir: \/nonexistent\/dir: no such file or directory/],
    ];
    for (const [what, call, message] of bad) {
      const error = await call().then(() => undefined, (e: unknown) => e);
      expect(error, what).toBeInstanceOf(EngineError);
      expect((error as Error).message, what).toMatch(message);
    }
    expect((await engine.complete(PROMPT, { maxNew: 8, eos: [] })).tokens).toEqual(greedy.slice(0, 8));
    // a typed array is a prompt too, and a Set an eos
    expect((await engine.complete(Int32Array.from(PROMPT) as unknown as number[], { maxNew: 8, eos: new Set<number>() as unknown as number[] })).tokens).toEqual(greedy.slice(0, 8));
  });

  it('a drafter of another vocabulary is refused', async () => {
    const { engine } = setups['kimi-k2'];
    const other = await syntheticPair(dir, 'small', 5);
    await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: `model:${other.draft}` })).rejects.toThrow(/vocabulary of 512 tokens, the target 128/);
  });

  it('an aborted generation throws KDTREE_ENGINE_ABORTED; the next one is exact', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    const controller = new AbortController();
    const seen: number[] = [];
    const run = async () => {
      for await (const chunk of engine.generate(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: 'ngram', budget: 4, signal: controller.signal })) {
        seen.push(...chunk.tokens);
        if (seen.length >= 5) controller.abort(new Error('enough'));
      }
    };
    await expect(run()).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ABORTED' });
    expect(seen.length).toBeLessThan(MAX_NEW);
    expect(greedy.slice(0, seen.length)).toEqual(seen);
    expect((await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: 'ngram', budget: 4 })).tokens).toEqual(greedy);
  });

  it('generations started together run one after another, each exact', async () => {
    const { engine, greedy, pair } = setups['kimi-k2'];
    const prompts = [PROMPT, [5, 6, 7], PROMPT.slice(2)];
    const { model } = await loadModel(pair.target);
    const expected = prompts.map((p) => greedyDecode(model, p, { maxNew: 20, eos: [] }).tokens);
    const results = await Promise.all(prompts.map((p, i) => engine.complete(p, { maxNew: 20, eos: [], spec: i === 1 ? 'ddtree' : 'greedy', drafter: 'ngram' })));
    expect(results.map((r) => r.tokens)).toEqual(expected);
    expect(expected[0]).toEqual(greedy.slice(0, 20));
  });

  it('a disposed engine refuses to generate', async () => {
    const pair = setups['kimi-k2'].pair;
    const engine = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 64 });
    await engine.dispose();
    await expect(engine.complete(PROMPT, { maxNew: 2 })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_DISPOSED' });
  });

  it('a budget past what a tree of its depth can hold over the vocabulary is refused; up to it, and auto, stay exact', async () => {
    const { pair, greedy } = setups['kimi-k2'];
    const engine = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 256, maxBudget: 160 });
    try {
      await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: 'ngram', budget: 129, depth: 1 })).rejects.toMatchObject({
        code: 'KDTREE_ENGINE_ARGUMENT',
        field: 'budget',
        message: 'budget: expected an integer in [1, 128] (a tree of depth 1 over 128 tokens holds 128 nodes), got 129',
      });
      // depth 2 holds 128 + 128^2: the engine's maxBudget bounds it
      await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: 'ngram', budget: 161, depth: 2 })).rejects.toThrow("budget: expected an integer in [1, 160] (the engine's maxBudget), got 161");
      // the draft model proposes at every step: trees of the whole vocabulary at depth 1 run
      for (const budget of [128, 'auto'] as const) {
        const r = await engine.complete(PROMPT, { maxNew: 12, eos: [], spec: 'ddtree', drafter: `model:${pair.draft}`, budget, depth: 1, trace: true });
        expect(r.tokens, String(budget)).toEqual(greedy.slice(0, 12));
        if (budget === 128) expect(r.steps.length > 0 && r.steps.every((step) => step.treeSize === 129), 'every step a tree of 128 nodes').toBe(true);
      }
    } finally {
      await engine.dispose();
    }
  });

  it('a queued generation aborted while it waits ends at once, not when its turn comes; the queue goes on', async () => {
    const { engine, greedy } = setups['kimi-k2'];
    // the running generation is held at its second chunk until the waiting one has ended
    let resume!: () => void;
    const held = new Promise<void>((r) => (resume = r));
    const running = (async () => {
      const seen: number[] = [];
      for await (const chunk of engine.generate(PROMPT, { maxNew: 12, eos: [] })) {
        seen.push(...chunk.tokens);
        if (seen.length === 1) await held;
      }
      return seen;
    })();
    const controller = new AbortController();
    const queued = engine.complete(PROMPT, { maxNew: 4, eos: [], signal: controller.signal });
    const after = engine.complete(PROMPT, { maxNew: 6, eos: [] });
    const already = engine.complete(PROMPT, { maxNew: 4, eos: [], signal: AbortSignal.abort() });
    await expect(already).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ABORTED' });
    controller.abort(new Error('the client left'));
    await expect(queued).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ABORTED', cause: new Error('the client left') });
    resume();
    expect(await running).toEqual(greedy.slice(0, 12));
    expect((await after).tokens).toEqual(greedy.slice(0, 6));
  });

  it('dispose() ends a running generation at its next step and queued ones at once, then frees the engine', async () => {
    const pair = setups['kimi-k2'].pair;
    const engine = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 64 });
    const seen: number[] = [];
    let queued: Promise<unknown> | undefined;
    let disposal: Promise<void> | undefined;
    const running = (async () => {
      for await (const chunk of engine.generate(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: 'ngram', budget: 4 })) {
        seen.push(...chunk.tokens);
        if (queued !== undefined) continue;
        // one queued behind this generation, then the engine disposed
        queued = engine.complete(PROMPT, { maxNew: 4, eos: [] }).then(() => 'ran', (e: unknown) => e);
        disposal = engine.dispose();
      }
    })();
    await expect(running).rejects.toMatchObject({ code: 'KDTREE_ENGINE_DISPOSED' });
    expect(await queued).toMatchObject({ code: 'KDTREE_ENGINE_DISPOSED' });
    expect(seen.length).toBeLessThan(MAX_NEW);
    await disposal;
    // idempotent, and the engine stays refused
    await engine.dispose();
    await expect(engine.complete(PROMPT, { maxNew: 2 })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_DISPOSED' });
  });

  it('createEngine names a model path that is not there and turns a load stopped by its signal into KDTREE_ENGINE_ABORTED', async () => {
    const missing = `${dir}/no-such-model.kdtr`;
    await expect(createEngine({ model: missing, backend: TEST_BACKEND })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ARGUMENT', field: 'model', message: `model: ${missing}: no such file or directory` });
    const pair = setups['kimi-k2'].pair;
    await expect(createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 64, config: missing })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ARGUMENT', field: 'config' });
    for (const abortAt of ['before', 'during'] as const) {
      const controller = new AbortController();
      if (abortAt === 'before') controller.abort(new Error('stop'));
      const parts: string[] = [];
      const onLoadProgress = (p: { part: string }) => {
        parts.push(p.part);
        controller.abort(new Error('stop'));
      };
      const error = await createEngine({ model: pair.target, backend: TEST_BACKEND, cacheTokens: 64, signal: controller.signal, onLoadProgress }).then(() => undefined, (e: unknown) => e);
      expect(error, abortAt).toBeInstanceOf(EngineError);
      expect(error, abortAt).toMatchObject({ code: 'KDTREE_ENGINE_ABORTED', field: 'signal', cause: new Error('stop') });
      expect(parts.length, abortAt).toBe(abortAt === 'before' ? 0 : 1);
    }
  });
});
