/**
 * The engine's exactness suite on a GPU host (bundled into .gpu/engine-check.mjs): on the cuda
 * backend, chain and DDTree decoding (ngram and draft-model drafters, budgets 1-128 and auto,
 * depths 1-16) must emit exactly the engine's greedy tokens; the forward pass is compared with the
 * golden reference layer by layer on transformers' fixtures (bf16 tolerances: the GPU's GEMMs round
 * x to bf16); greedy tokens are compared with the reference's, reporting the first divergence and
 * the reference's top-1/top-2 margin there (a bf16 forward may flip a token whose margin is tiny).
 * The DFlash drafter (dflash:PATH, a random drafter paired with each synthetic target): chain and
 * DDTree == greedy, and with f32 activations and cache each step's draftTop1 == the reference
 * dflashDecode's (the drafter on cuda is the reference's, not just verified exactly), and so is
 * every draft of `auto` (whose plain steps hold their rows on the device) over the whole context.
 * Greedy's step ahead: an eos and an abort take the queued step back, and the next generation is
 * exact.
 *   /tmp/node .gpu/engine-check.mjs          (OUT=dir writes engine-check.json)
 * Exits 1 if any exactness check fails.
 */
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import {
  argmax,
  dflashConfigJson,
  dflashDecode,
  greedyDecode,
  loadDflashModel,
  loadModel,
  parseDflashConfig,
  parseModelConfig,
  perturbWeights,
  presetConfigJson,
  randomDflashWeights,
  randomWeights,
  targetTaps,
  teacherForcedLogits,
  top2Margin,
  writeDflashDirectory,
  writeSyntheticModel,
  type ModelPreset,
} from '@kdtree/reference';
import { createBackend } from '@kdtree/cuda';
import { createEngine, DeviceModel, ModelSource, Runner, view, type Drafter, type GenerateOptions } from '@kdtree/engine';

const here = dirname(fileURLToPath(import.meta.url));
const results: { check: string; ok: boolean; detail: string }[] = [];
const record = (check: string, ok: boolean, detail: string) => {
  results.push({ check, ok, detail });
  console.log(`${ok ? 'PASS' : 'FAIL'} ${check}${detail ? `\n     ${detail}` : ''}`);
};
const work = mkdtempSync(join(tmpdir(), 'kdtree-engine-check-'));
// KDTREE_ENGINE_CHECK_BACKEND=cpu runs the same checks on the cpu twin (a check of the script itself)
const loadOptions = { backend: createBackend({ backend: (process.env.KDTREE_ENGINE_CHECK_BACKEND ?? 'cuda') as 'cuda' | 'cpu', searchPaths: [here], onlySearchPaths: true }) };

async function pair(preset: ModelPreset, seed: number) {
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const base = randomWeights(config, seed);
  const draft = join(work, `${preset}-draft.kdtr`);
  const target = join(work, `${preset}.kdtr`);
  await writeSyntheticModel(draft, { preset, seed, weights: base, quant: 'kimi-k2' }, 'engine-check');
  await writeSyntheticModel(target, { preset, seed, weights: perturbWeights(base, 0.05, seed + 1), quant: 'kimi-k2' }, 'engine-check');
  return { target, draft };
}

const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];

for (const preset of ['tiny', 'k2-mini'] as ModelPreset[]) {
  const t0 = performance.now();
  const { target, draft } = await pair(preset, 21);
  const maxNew = 48;
  const engine = await createEngine({ model: target, ...loadOptions, cacheTokens: 512, maxBudget: 128 });
  try {
    const greedy = (await engine.complete(PROMPT, { maxNew, eos: [] })).tokens;
    // the reference's greedy tokens, and where the engine's first differ
    const { model } = await loadModel(target);
    const ref = greedyDecode(model, PROMPT, { maxNew, eos: [] }).tokens;
    const diverge = ref.findIndex((t, i) => t !== greedy[i]);
    let margin = '';
    if (diverge >= 0) {
      const logits = teacherForcedLogits(model, [...PROMPT, ...ref.slice(0, diverge)]);
      const V = model.config.vocabSize;
      const row = logits.subarray((PROMPT.length + diverge - 1) * V, (PROMPT.length + diverge) * V);
      margin = `; the reference's top-1/top-2 margin there is ${top2Margin(row).toExponential(2)} (its argmax ${argmax(row)})`;
    }
    record(`${preset}: engine greedy on cuda vs the f32 reference`, true, diverge < 0 ? `identical ${maxNew} tokens` : `first divergence at token ${diverge}${margin}`);
    let runs = 0;
    const failures: string[] = [];
    const accepted: Record<string, number> = {};
    for (const drafter of ['ngram', `model:${draft}`]) {
      const cases: GenerateOptions[] = [];
      for (const budget of [1, 2, 4, 8]) cases.push({ maxNew, spec: 'chain', drafter, budget, depth: 8 });
      for (const depth of [1, 2, 4, 8, 16]) for (const budget of [1, 3, 8, 16, 33, 64, 128]) cases.push({ maxNew, spec: 'ddtree', drafter, budget, depth });
      for (const depth of [2, 4, 8]) cases.push({ maxNew, spec: 'ddtree', drafter, budget: 'auto', depth });
      for (const c of cases) {
        const r = await engine.complete(PROMPT, { ...c, eos: [] });
        runs++;
        const key = `${c.spec} ${drafter.startsWith('model') ? 'model' : 'ngram'} B${c.budget} L${c.depth}`;
        accepted[key] = Number(r.stats.meanAcceptedLength.toFixed(2));
        if (r.tokens.join() !== greedy.join()) failures.push(`${key}: [${r.tokens.slice(0, 12)}...]`);
      }
    }
    record(`${preset}: chain and DDTree (ngram and draft model, budgets 1-128 and auto, depths 1-16) == engine greedy on cuda`, failures.length === 0, failures.length ? failures.join('; ') : `${runs} generations identical; mean accepted ${JSON.stringify(accepted)}`);
    // greedy runs a step ahead: the step queued after an eos (or an abort) is taken back
    const committed = () => (engine as unknown as { runner: { committed: number } }).runner.committed;
    const stop = greedy[13];
    const upTo = greedy.indexOf(stop) + 1;
    const byEos = await engine.complete(PROMPT, { maxNew, eos: [stop] });
    const eosOk = byEos.tokens.join() === greedy.slice(0, upTo).join() && committed() === PROMPT.length + upTo - 1;
    const controller = new AbortController();
    const seen: number[] = [];
    let code = '';
    try {
      for await (const chunk of engine.generate(PROMPT, { maxNew, eos: [], signal: controller.signal })) {
        seen.push(...chunk.tokens);
        if (seen.length >= 5) controller.abort(new Error('enough'));
      }
    } catch (error) {
      code = (error as { code?: string }).code ?? String(error);
    }
    const abortOk = code === 'KDTREE_ENGINE_ABORTED' && seen.join() === greedy.slice(0, 5).join() && committed() === PROMPT.length + 4;
    const after = (await engine.complete(PROMPT, { maxNew, eos: [] })).tokens;
    record(
      `${preset}: greedy a step ahead: eos and abort take the queued step back, the next generation is exact`,
      eosOk && abortOk && after.join() === greedy.join(),
      `eos at token ${upTo}: ${eosOk ? 'ok' : `tokens ${byEos.tokens.length}, L ${committed()}`}; abort after 5: ${abortOk ? 'ok' : `${code}, ${seen.length} tokens`}; next ${after.join() === greedy.join() ? 'exact' : 'DIFFERENT'}`,
    );
  } finally {
    await engine.dispose();
  }
  console.log(`   (${preset}: ${((performance.now() - t0) / 1000).toFixed(1)} s)`);
}

// the DFlash drafter: a random one (Qwen3 layers, GQA of 8 query heads over 2 KV heads of 128, as
// Kimi K2.5-DFlash's head dim) tapping two target layers; greedy-exact at every budget, and drafting
// what the reference drafts
for (const preset of ['tiny', 'k2-mini'] as ModelPreset[]) {
  const t0 = performance.now();
  const { target } = await pair(preset, 41);
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const dir = join(work, `${preset}-dflash`);
  const json = dflashConfigJson(config, { blockSize: 8, heads: 8, kvHeads: 2, headDim: 128, targetLayerIds: [0, config.numLayers - 1] });
  await writeDflashDirectory(dir, json, randomDflashWeights(parseDflashConfig(json), 42));
  const drafter = `dflash:${dir}`;
  const maxNew = 40;
  const engine = await createEngine({ model: target, ...loadOptions, cacheTokens: 512, maxBudget: 64 });
  try {
    const greedy = (await engine.complete(PROMPT, { maxNew, eos: [] })).tokens;
    const cases: GenerateOptions[] = [];
    for (const budget of [1, 2, 4, 7]) cases.push({ maxNew, spec: 'chain', drafter, budget });
    for (const depth of [1, 3, 7]) for (const budget of [1, 3, 8, 16, 33, 64]) cases.push({ maxNew, spec: 'ddtree', drafter, budget, depth });
    cases.push({ maxNew, spec: 'ddtree', drafter, budget: 'auto' });
    const failures: string[] = [];
    for (const c of cases) {
      const r = await engine.complete(PROMPT, { ...c, eos: [] });
      if (r.tokens.join() !== greedy.join()) failures.push(`${c.spec} B${c.budget} L${c.depth ?? 7}: [${r.tokens.slice(0, 12)}...]`);
    }
    record(`${preset}: chain and DDTree with a DFlash drafter (budgets 1-64 and auto, depths 1-7) == engine greedy on cuda`, failures.length === 0, failures.length ? failures.join('; ') : `${cases.length} generations identical`);
  } finally {
    await engine.dispose();
  }
  // f32 activations and cache: the target's taps follow the f32 reference, so the drafts must too
  const exact = await createEngine({ model: target, ...loadOptions, cacheTokens: 512, maxBudget: 64, activations: 'f32', cacheDtype: 'f32' });
  try {
    const { model } = await loadModel(target);
    const ref = (await loadDflashModel(dir, model)).model;
    const mismatches: string[] = [];
    let steps = 0;
    for (const [budget, depth] of [[1, 7], [8, 3], [33, 7]]) {
      const r = await exact.complete(PROMPT, { maxNew, eos: [], spec: 'ddtree', drafter, budget, depth, trace: true });
      const golden = dflashDecode(model, ref, PROMPT, { maxNew, budget, depth, eos: [] });
      if (r.tokens.join() !== golden.tokens.join()) {
        mismatches.push(`B${budget} L${depth}: tokens differ from the reference's at ${golden.tokens.findIndex((t, i) => t !== r.tokens[i])}`);
        continue;
      }
      r.steps.forEach((s, i) => {
        steps++;
        if (s.draftTop1.join() !== golden.draftTop1PerStep[i]?.join()) mismatches.push(`B${budget} L${depth} step ${i + 1}: [${s.draftTop1}] vs [${golden.draftTop1PerStep[i]}]`);
      });
    }
    record(`${preset}: DFlash draftTop1 per step on cuda (f32 activations and cache) == the reference dflashDecode's`, mismatches.length === 0, mismatches.length ? mismatches.slice(0, 6).join('; ') : `${steps} steps identical`);
    // auto backs off the random drafter into plain steps that hold their rows on the device: every
    // draft after them must be the reference drafter's over the whole committed context
    const inner = await exact.drafter(drafter);
    const V = model.config.vocabSize;
    const drafts: { tokens: number[]; top1: number[] }[] = [];
    const recording: Drafter = {
      name: 'dflash-recorded',
      vocabSize: inner.vocabSize,
      maxDepth: inner.maxDepth,
      targetLayers: inner.targetLayers,
      begin: (prompt) => inner.begin(prompt),
      commit: (hidden, rows) => inner.commit!(hidden, rows),
      draft(request) {
        if (!inner.draft(request)) return false;
        const logits = exact.backend.toArray(request.out) as Float32Array;
        drafts.push({ tokens: [...request.tokens], top1: Array.from({ length: request.depth }, (_, d) => argmax(logits, d * V, V)) });
        return true;
      },
      dispose() {},
    };
    const auto = await exact.complete(PROMPT, { maxNew: 96, eos: [], spec: 'ddtree', drafter: recording, budget: 'auto', trace: true });
    const plain = auto.steps.filter((s) => s.budget === 0 && s.draftTop1.length === 0).length;
    const wrong: string[] = [];
    for (const { tokens, top1 } of drafts) {
      const n = tokens.length - 1;
      const taps = targetTaps(model, ref.config.targetLayerIds, n);
      model.forward(tokens.slice(0, -1), model.newCache(n + 1), { logitRows: [], onLayer: taps.onLayer });
      const { logits } = ref.draft(ref.newCache(), taps.hidden, n, tokens[n]);
      const want = top1.map((_, d) => argmax(logits, d * V, V));
      if (want.join() !== top1.join()) wrong.push(`after ${n} tokens: [${top1}] vs [${want}]`);
    }
    record(
      `${preset}: DFlash auto's drafts after plain steps (rows held on the device) == the reference drafter's over the whole context`,
      wrong.length === 0 && plain > 0 && drafts.length >= 2,
      wrong.length ? wrong.slice(0, 4).join('; ') : `${drafts.length} drafts identical, ${plain} plain steps between them`,
    );
  } finally {
    await exact.dispose();
  }
  console.log(`   (${preset} dflash: ${((performance.now() - t0) / 1000).toFixed(1)} s)`);
}

// every captured step (decode, DDTree steps, a chain step) against the same ops called directly,
// from the same state, step after step: the cache, the token, the committed length, the path
{
  const { target } = await pair('tiny', 31);
  const b = loadOptions.backend;
  const source = await ModelSource.open(target);
  const model = await DeviceModel.load(b, source, { rows: 64 });
  await source.close();
  const r = new Runner(b, model, 256, 'bf16', 64);
  const tree = r.treeBuffers(33);
  const V = model.config.vocabSize;
  let x = 99;
  const draft = r.own(b.fromArray('f32', [4, V], Float32Array.from({ length: 4 * V }, () => ((x = (Math.imul(x, 1103515245) + 12345) >>> 0) / 2 ** 32) * 6)));
  const tensors = () => [...r.cache.all(), r.token, r.cache.length[0], tree.path, tree.pathLen];
  const state = () => tensors().map((t) => Buffer.from((b.toArray(t) as Uint8Array).buffer.slice(0)));
  const failures: string[] = [];
  const steps: [string, (s: number) => void][] = [
    ['decode', (s) => r.queueAppend(1, r.token, view(tree.logits, [1, V]), s)],
    ...[4, 16, 32].map((budget): [string, (s: number) => void] => [`tree ${budget}`, (s) => r.queueTreeStep(tree, draft, budget, s)]),
    ['chain 4', (s) => r.queueChainStep(tree, draft, 4, s)],
  ];
  for (const [label, queue] of steps) {
    r.prefill(PROMPT, 0);
    const start = state();
    const direct: Buffer[][] = [];
    for (let i = 0; i < 4; i++) {
      queue(0);
      b.synchronize();
      direct.push(state());
    }
    tensors().forEach((t, i) => b.native.upload(t.buffer, new Uint8Array(start[i]), t.offset ?? 0));
    const graph = r.graph(label, queue);
    for (let i = 0; i < 4; i++) {
      r.launch(graph);
      b.synchronize();
      state().forEach((bytes, j) => {
        if (!bytes.equals(direct[i][j])) failures.push(`${label} step ${i + 1} tensor ${j}`);
      });
    }
  }
  record('captured steps (decode, DDTree budgets 4/16/32, chain 4) == the same ops called directly, 4 steps each', failures.length === 0, failures.slice(0, 8).join('; '));
  r.dispose();
  model.dispose();
}

// the forward pass against the reference on transformers' fixtures: the GPU's GEMMs round x to bf16
// run from the repository root, where the fixtures travel with the checkout
const HF = join(process.cwd(), 'packages', 'reference', 'fixtures', 'hf');
// f32 activations (the reference's) on every fixture; bf16 ones (the cuda default) on those whose
// routing has no near tie that bf16 rounding tips: rope-noqlora-grouped-int4-k25's group-limited
// top-k of layer 1 picks another expert for a row under bf16 h on both backends (a 0.3 row error)
const forwardRuns = [
  ...['yarn-qlora-moe', 'yarn-qlora-moe-int4', 'rope-noqlora-grouped', 'rope-noqlora-grouped-int4-k25', 'yarn-mscale-dense'].map((fixture) => ({ fixture, activations: 'f32' as const })),
  ...['yarn-qlora-moe-int4', 'yarn-mscale-dense'].map((fixture) => ({ fixture, activations: 'bf16' as const })),
];
for (const { fixture, activations } of forwardRuns) {
  const path = join(HF, fixture);
  const { model } = await loadModel(path);
  const tokens = [1, 7, 42, 3, 99, 5, 64, 11, 2, 77, 13, 8, 100, 31, 4, 9, 55];
  const hidden: Float32Array[] = [];
  model.forward(tokens, model.newCache(tokens.length), { onLayer: (_, x) => hidden.push(x.slice()) });
  const engine = await createEngine({ model: path, ...loadOptions, cacheTokens: 64, maxBudget: 32, activations });
  try {
    const ours = await engine.teacherForced(tokens);
    const H = model.config.hiddenSize;
    let worst = 0;
    ours.hidden.forEach((h, l) => {
      for (let r = 0; r < tokens.length; r++) {
        let max = 0;
        let diff = 0;
        for (let i = r * H; i < (r + 1) * H; i++) {
          max = Math.max(max, Math.abs(hidden[l][i]));
          diff = Math.max(diff, Math.abs(h[i] - hidden[l][i]));
        }
        worst = Math.max(worst, diff / max);
      }
    });
    // a bf16 latent cache (and bf16 activations: relative 2^-9 per GEMM input) through a few layers
    record(`${fixture}, ${activations} activations: every layer's hidden state on cuda vs the reference, per row, within 5e-2`, worst <= 5e-2, `worst row error ${worst.toExponential(2)}`);
  } finally {
    await engine.dispose();
  }
}

const failed = results.filter((r) => !r.ok).length;
console.log(`\n${results.length - failed} passed, ${failed} failed`);
if (process.env.OUT) {
  mkdirSync(process.env.OUT, { recursive: true });
  writeFileSync(join(process.env.OUT, 'engine-check.json'), `${JSON.stringify(results, null, 1)}\n`);
}
process.exit(failed ? 1 : 0);
