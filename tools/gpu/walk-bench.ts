/**
 * The demo's models on one GPU (bundled into .gpu/walk-bench.mjs; docs/benchmarks/engine.md,
 * "A DFlash drafter that predicts its target"): the k2-mini walk target with INT4 routed experts,
 * its draft model (the target's layers plus 5% noise) and the DFlash drafter built for it (block
 * 8), made here as `kdtree gen-model --preset k2-mini --structure walk --quant kimi-k2 --draft
 * --dflash` makes them. In one run, 128 new tokens after the golden prompt:
 *   - greedy; chain and DDTree with the DFlash drafter at equal budgets (3, 7) and DDTree at larger
 *     ones (8, 16, 32, 64) and `auto` (with the budgets auto ran, from a traced generation); the
 *     draft model and ngram for comparison
 *   - DDTree's tokens/s over the chain's at budgets 3 and 7 from interleaved pairs (median, range)
 *   - every mode checked against this backend's greedy (greedy itself against the f32 reference),
 *     and, with f32 activations and cache, the DFlash DDTree run's tokens and draftTop1 per step against
 *     @kdtree/reference's dflashDecode over the same target and drafter
 * Speculative rows are the median of 3 generations after one that captures their graphs.
 * Writes $OUT/walk-bench.json. KDTREE_BENCH_SMOKE=1 runs it on the cpu twin with the small preset.
 */
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend } from '@kdtree/cuda';
import { createEngine, type GenerateOptions, type GenerationResult } from '@kdtree/engine';
import {
  dflashDecode,
  GOLDEN_PROMPT,
  greedyDecode,
  loadDflashModel,
  loadModel,
  parseModelConfig,
  perturbWeights,
  presetConfigJson,
  randomWeights,
  walkDflashConfig,
  walkDflashWeights,
  walkStructure,
  walkWeights,
  WALK_TENSORS,
  writeDflashDirectory,
  writeSyntheticModel,
} from '@kdtree/reference';

const here = dirname(fileURLToPath(import.meta.url));
const smoke = process.env.KDTREE_BENCH_SMOKE === '1';
const b = createBackend({ backend: smoke ? 'cpu' : 'cuda', searchPaths: [here], onlySearchPaths: true });
const preset = smoke ? 'small' : 'k2-mini';
const maxNew = smoke ? 48 : 128;
const BLOCK = 8;
const EQUAL_PAIRS = 9;  // chain / DDTree pairs a budget, for their ratio at equal budgets
const log = (s: string) => console.log(s);

const dir = mkdtempSync(join(tmpdir(), 'kdtree-walk-bench-'));
const report: Record<string, unknown> = { device: b.info(), preset, maxNew, blockSize: BLOCK };
try {
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const walk = walkStructure(config, 1);
  const base = walkWeights(config, randomWeights(config, 1), walk);
  const target = join(dir, 'target.kdtr');
  const draft = join(dir, 'draft.kdtr');
  const flash = join(dir, 'dflash');
  await writeSyntheticModel(draft, { preset, seed: 1, quant: 'kimi-k2', structure: 'walk', weights: base }, 'walk-bench');
  await writeSyntheticModel(target, { preset, seed: 1, quant: 'kimi-k2', structure: 'walk', weights: perturbWeights(base, 0.05, 2, WALK_TENSORS) }, 'walk-bench');
  const drafter = walkDflashConfig(config, walk, { blockSize: BLOCK });
  await writeDflashDirectory(flash, drafter.json, walkDflashWeights(drafter.config, walk));

  const prompt = GOLDEN_PROMPT;
  const reference = (await loadModel(target)).model;
  const engine = await createEngine({ model: target, backend: b, cacheTokens: 1024, maxBudget: 64 });
  try {
    const median = (runs: GenerationResult[]) => runs.sort((x, y) => x.stats.tokensPerSecond - y.stats.tokensPerSecond)[1];
    const once = (options: Partial<GenerateOptions>) => engine.complete(prompt, { maxNew, eos: [], ...options });
    const run = async (options: Partial<GenerateOptions>) => {
      await once(options);
      const runs: GenerationResult[] = [];
      for (let i = 0; i < 3; i++) runs.push(await once(options));
      return median(runs);
    };
    // every mode against this backend's greedy (bf16 activations and cache on cuda); greedy itself
    // against the f32 reference's, where the two may part at a near tie of the walk's two steps
    const greedy = await run({});
    const oracle = greedyDecode(reference, prompt, { maxNew, eos: [] }).tokens;
    const diverge = oracle.findIndex((t, i) => t !== greedy.tokens[i]);
    report.greedyVsReference = diverge < 0 ? 'identical' : `first divergence at token ${diverge}`;
    log(`greedy on ${smoke ? 'cpu' : 'cuda'} vs the f32 reference: ${report.greedyVsReference as string}`);
    const rows: Record<string, unknown>[] = [];
    const record = (mode: string, r: GenerationResult) => {
      const exact = r.tokens.join() === greedy.tokens.join();
      rows.push({ mode, tokensPerSecond: r.stats.tokensPerSecond, meanAcceptedLength: r.stats.meanAcceptedLength, targetForwards: r.stats.targetForwards, speedup: r.stats.tokensPerSecond / greedy.stats.tokensPerSecond, exact });
      log(`${mode}: ${r.stats.tokensPerSecond.toFixed(1)} tokens/s, ${r.stats.meanAcceptedLength.toFixed(2)} tokens a step, ${r.stats.targetForwards} target forwards, ${exact ? 'exact' : 'DIFFERENT FROM GREEDY'}`);
    };
    record('greedy', greedy);
    const dflash = `dflash:${flash}`;
    const draftModel = `model:${draft}`;
    // chain and DDTree at equal budgets: [budget, chain's options, DDTree's]
    const equalBudgets: [number, Partial<GenerateOptions>, Partial<GenerateOptions>][] = [
      [3, { spec: 'chain', drafter: dflash, budget: 3, depth: 3 }, { spec: 'ddtree', drafter: dflash, budget: 3 }],
      [7, { spec: 'chain', drafter: dflash, budget: 7 }, { spec: 'ddtree', drafter: dflash, budget: 7 }],
    ];
    const modes: [string, Partial<GenerateOptions>][] = [
      ...equalBudgets.flatMap(([budget, chain, tree]): [string, Partial<GenerateOptions>][] => [
        [`chain, dflash, ${budget}`, chain],
        [`ddtree, dflash, B ${budget}`, tree],
      ]),
      ...[8, 16, 32, 64].map((budget): [string, Partial<GenerateOptions>] => [`ddtree, dflash, B ${budget}`, { spec: 'ddtree', drafter: dflash, budget }]),
      ['ddtree, dflash, auto', { spec: 'ddtree', drafter: dflash, budget: 'auto' }],
      ['chain, model, 4', { spec: 'chain', drafter: draftModel, budget: 4, depth: 4 }],
      ['ddtree, model, B 16', { spec: 'ddtree', drafter: draftModel, budget: 16, depth: 4 }],
      ['ddtree, model, auto', { spec: 'ddtree', drafter: draftModel, budget: 'auto', depth: 4 }],
      ['ddtree, ngram, B 8', { spec: 'ddtree', drafter: 'ngram', budget: 8, depth: 4 }],
    ];
    for (const [mode, options] of modes) record(mode, await run(options));
    report.modes = rows;
    // the budgets auto ran, step by step (a traced generation: its argmax read back each step, so untimed)
    const autoSteps = (await once({ spec: 'ddtree', drafter: dflash, budget: 'auto', trace: true })).steps;
    const byBudget = new Map<number, { steps: number; accepted: number }>();
    for (const s of autoSteps) {
      const at = byBudget.get(s.budget) ?? { steps: 0, accepted: 0 };
      at.steps++;
      at.accepted += s.accepted;
      byBudget.set(s.budget, at);
    }
    const ranBudgets = [...byBudget].sort((x, y) => x[0] - y[0]);
    report.autoBudgets = Object.fromEntries(ranBudgets);
    log(`ddtree, dflash, auto (traced): ${ranBudgets.map(([budget, at]) => `budget ${budget} x ${at.steps} (${(at.accepted / at.steps).toFixed(2)} accepted)`).join(', ')}`);
    // DDTree against the chain at equal budgets, interleaved: each pair's two generations run back
    // to back (in alternating order), so a host's drift between modes cancels in the pair's ratio
    const equal: Record<string, unknown>[] = [];
    for (const [budget, chain, tree] of equalBudgets) {
      const ratios: number[] = [];
      for (let i = 0; i < EQUAL_PAIRS; i++) {
        let c: GenerationResult;
        let t: GenerationResult;
        if (i % 2 === 0) {
          c = await once(chain);
          t = await once(tree);
        } else {
          t = await once(tree);
          c = await once(chain);
        }
        for (const r of [c, t]) if (r.tokens.join() !== greedy.tokens.join()) throw new Error(`budget ${budget}, pair ${i}: a generation differs from greedy`);
        ratios.push(t.stats.tokensPerSecond / c.stats.tokensPerSecond);
      }
      ratios.sort((x, y) => x - y);
      const median = ratios[Math.floor(ratios.length / 2)];
      equal.push({ budget, pairs: EQUAL_PAIRS, medianRatio: median, minRatio: ratios[0], maxRatio: ratios[ratios.length - 1] });
      log(`ddtree / chain at budget ${budget}, ${EQUAL_PAIRS} interleaved pairs: median ${(100 * median).toFixed(1)}% (${(100 * ratios[0]).toFixed(1)}-${(100 * ratios[ratios.length - 1]).toFixed(1)}%)`);
    }
    report.equalBudget = equal;
    report.curve = Object.fromEntries(engine.measureCosts(BLOCK - 1).verifyMs);
  } finally {
    await engine.dispose();
  }
  // the drafter on this backend is the reference's: with f32 activations and cache the target's
  // taps follow the f32 reference, so the tokens and every step's draftTop1 must be its own
  const exact = await createEngine({ model: target, backend: b, cacheTokens: 1024, maxBudget: 64, activations: 'f32', cacheDtype: 'f32' });
  try {
    const traced = await exact.complete(prompt, { maxNew, eos: [], spec: 'ddtree', drafter: `dflash:${flash}`, budget: 16, trace: true });
    const ref = dflashDecode(reference, (await loadDflashModel(flash, reference)).model, prompt, { maxNew, budget: 16, eos: [] });
    const steps = traced.steps.map((s) => s.draftTop1);
    const same = steps.filter((s, i) => s.join() === ref.draftTop1PerStep[i]?.join()).length;
    const tokens = traced.tokens.join() === ref.tokens.join();
    report.draftTop1 = { activations: 'f32', cacheDtype: 'f32', steps: steps.length, referenceSteps: ref.draftTop1PerStep.length, equal: same, tokensEqual: tokens };
    log(`f32 activations and cache, DDTree B 16: tokens ${tokens ? 'equal' : 'DIFFERENT FROM'} the reference's; draftTop1 equal at ${same} of ${steps.length} steps (reference: ${ref.draftTop1PerStep.length} steps)`);
  } finally {
    await exact.dispose();
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
if (process.env.OUT) {
  mkdirSync(process.env.OUT, { recursive: true });
  writeFileSync(join(process.env.OUT, 'walk-bench.json'), `${JSON.stringify(report, null, 1)}\n`);
}
