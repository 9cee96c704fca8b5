/**
 * The DFlash drafter on the engine: chain and DDTree with `dflash:PATH` emit greedy's tokens at
 * every budget and depth, and the drafter is the reference's — each step's draftTop1 equals
 * @kdtree/reference dflashDecode's argmax per depth (the same taps, contexts and positions, step
 * after step). A tiny synthetic target (its last layer tapped: the final-norm path) paired with a
 * random drafter written as z-lab publishes one.
 */
import { copyFileSync, mkdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  dflashConfigJson,
  dflashDecode,
  dflashWeightSpecs,
  greedyDecode,
  loadDflashModel,
  loadModel,
  parseDflashConfig,
  parseModelConfig,
  presetConfigJson,
  randomDflashWeights,
  writeDflashDirectory,
  writeSyntheticModel,
  argmax,
  targetTaps,
  type DflashModel,
  type ReferenceModel,
} from '@kdtree/reference';
import { createEngine, DflashDrafter, EngineError, type Drafter, type Engine } from './index.js';
import { estimateDflashMemory } from './memory.js';
import { tempDir, TEST_BACKEND } from './test-support/models.js';

const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];
const MAX_NEW = 24;
const BLOCK = 5;
/** How long recordingDrafter's drafts take. */
const SLOW_DRAFT_MS = 30;

describe(`the DFlash drafter on the engine (${TEST_BACKEND})`, () => {
  const dir = tempDir('kdtree-dflash-engine-');
  const target = join(dir, 'tiny.kdtr');
  const drafter = join(dir, 'tiny-dflash');
  let engine: Engine;
  let reference: { model: ReferenceModel; drafter: DflashModel };
  let greedy: number[];

  beforeAll(async () => {
    await writeSyntheticModel(target, { preset: 'tiny', seed: 21 }, 'engine tests');
    const tiny = parseModelConfig(presetConfigJson('tiny'), 'tiny');
    // 6 query heads over 2 KV heads of 24 dims (a head ratio of 3, a head dim no multiple of 32)
    const json = dflashConfigJson(tiny, { blockSize: BLOCK, heads: 6, kvHeads: 2, headDim: 24, intermediate: 96 });
    await writeDflashDirectory(drafter, json, randomDflashWeights(parseDflashConfig(json), 22));
    const { model } = await loadModel(target);
    reference = { model, drafter: (await loadDflashModel(drafter, model)).model };
    greedy = greedyDecode(model, PROMPT, { maxNew: MAX_NEW, eos: [] }).tokens;
    engine = await createEngine({ model: target, backend: TEST_BACKEND, cacheTokens: 256, cacheDtype: 'f32', activations: 'f32', maxBudget: 64 });
  });
  afterAll(async () => {
    await engine?.dispose();
  });

  /** Each recorded draft's argmax per depth equals the reference drafter's over the whole committed context, recomputed from scratch. */
  function expectReferenceDrafts(drafts: { tokens: number[]; top1: number[] }[], ref = reference.drafter): void {
    const { model } = reference;
    const V = model.config.vocabSize;
    for (const { tokens, top1 } of drafts) {
      const committed = tokens.length - 1;
      const taps = targetTaps(model, ref.config.targetLayerIds, committed);
      model.forward(tokens.slice(0, -1), model.newCache(committed + 1), { logitRows: [], onLayer: taps.onLayer });
      const { logits } = ref.draft(ref.newCache(), taps.hidden, committed, tokens[committed]);
      expect(top1, `after ${committed} committed tokens`).toEqual(top1.map((_, d) => argmax(logits, d * V, V)));
    }
  }

  /**
   * `inner`, recording its commits and drafts, and made to take SLOW_DRAFT_MS a draft on the
   * backend's clock (the cpu twin's is the host's): dearer than any tree of a random drafter is
   * worth, so `auto` backs off into plain decode steps whatever the machine's speed.
   */
  function recordingDrafter(inner: DflashDrafter, b: Engine['backend']): { drafter: Drafter; commits: number[]; drafts: { tokens: number[]; top1: number[] }[] } {
    const V = inner.vocabSize;
    const commits: number[] = [];
    const drafts: { tokens: number[]; top1: number[] }[] = [];
    const drafter: Drafter = {
      name: 'dflash-recorded',
      vocabSize: V,
      maxDepth: inner.maxDepth,
      targetLayers: inner.targetLayers,
      begin: () => inner.begin(),
      commit: (hidden, rows) => {
        commits.push(rows);
        inner.commit(hidden, rows);
      },
      draft(request) {
        if (!inner.draft(request)) return false;
        if (b.kind === 'cpu') for (const until = performance.now() + SLOW_DRAFT_MS; performance.now() < until; );
        else b.native.hold(SLOW_DRAFT_MS * 1000, 0);
        const logits = b.toArray(request.out) as Float32Array;
        drafts.push({ tokens: [...request.tokens], top1: Array.from({ length: request.depth }, (_, d) => argmax(logits, d * V, V)) });
        return true;
      },
      dispose() {},
    };
    return { drafter, commits, drafts };
  }

  it("estimates the drafter's device memory before loading: its weights are the checkpoint's tensors (bf16 matrices, f32 norms)", () => {
    const config = reference.drafter.config;
    const tensors = dflashWeightSpecs(config).reduce((sum, spec) => sum + spec.shape.reduce((a, b) => a * b, 1) * (spec.shape.length === 1 ? 4 : 2), 0);
    const estimate = estimateDflashMemory(config, { capacity: 256, maxRows: 64 });
    expect(estimate.weights).toBe(tensors);
    expect(estimate.cache).toBe(4 * 2 * config.numLayers * 256 * config.numKvHeads * config.headDim);
    expect(estimate.total).toBe(estimate.weights + estimate.cache + estimate.workspace + estimate.staging);
    // Kimi K2.5-DFlash (6 layers, hidden 7168, 64 / 8 heads of 128, intermediate 18432, 6 taps): ~6.5 GiB of bf16
    const k25 = parseDflashConfig(dflashConfigJson(parseModelConfig({ ...presetConfigJson('tiny'), hidden_size: 7168, num_hidden_layers: 61 }, 'k2'), { layers: 6, heads: 64, kvHeads: 8, headDim: 128, intermediate: 18432, blockSize: 8, targetLayerIds: [1, 12, 24, 35, 47, 58] }));
    expect(estimateDflashMemory(k25, { capacity: 4096, maxRows: 2048 }).weights / 2 ** 30).toBeCloseTo(6.48, 2);
    // the engine's taps of the target for it: f32 [maxRows, hidden] per distinct tapped layer, beside its own scratch
    const wider = estimateDflashMemory(k25, { capacity: 4096, maxRows: 2048 }).workspace - estimateDflashMemory(k25, { capacity: 4096, maxRows: 1024 }).workspace;
    expect(wider).toBe(4 * 1024 * (4 * 7168 + 3 * 8 * 128) + 4 * 1024 * 6 * 7168);
    // the rows of taps the engine holds for it: f32 [heldRows, hidden] per distinct tapped layer
    const held = estimateDflashMemory(k25, { capacity: 4096, maxRows: 2048, heldRows: 512 }).workspace - estimateDflashMemory(k25, { capacity: 4096, maxRows: 2048 }).workspace;
    expect(held).toBe(4 * 512 * 6 * 7168);
    const twice = parseDflashConfig(dflashConfigJson(parseModelConfig({ ...presetConfigJson('tiny'), hidden_size: 7168, num_hidden_layers: 61 }, 'k2'), { layers: 6, heads: 64, kvHeads: 8, headDim: 128, intermediate: 18432, blockSize: 8, targetLayerIds: [1, 1, 24, 24, 47, 58] }));
    expect(estimateDflashMemory(twice, { capacity: 4096, maxRows: 2048, heldRows: 512 }).workspace - estimateDflashMemory(twice, { capacity: 4096, maxRows: 2048 }).workspace).toBe(4 * 512 * 4 * 7168);
  });

  it('taps the target layers the drafter names, the last one among them', () => {
    expect(reference.drafter.config.targetLayerIds).toEqual([0, 1]);
    expect(reference.model.config.numLayers).toBe(2);
  });

  for (const spec of ['chain', 'ddtree'] as const) {
    it(`${spec} with dflash:PATH equals greedy at budgets 1..64 and depths 1..${BLOCK - 1}${spec === 'ddtree' ? ", and each step's draftTop1 is the reference dflashDecode's" : ''}`, async () => {
      for (const depth of [1, 2, BLOCK - 1]) {
        for (const budget of [1, 2, 3, 8, 17, 64]) {
          if (spec === 'chain' && budget > depth + 1 && budget !== 64) continue; // longer chains are cut at the depth
          const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec, drafter: `dflash:${drafter}`, budget, depth, trace: true });
          expect(r.tokens, `budget ${budget}, depth ${depth}`).toEqual(greedy);
          expect(r.stats.drafter).toBe(`dflash:${drafter}`);
          expect(r.steps.every((s) => s.draftTop1.length === depth)).toBe(true);
          if (spec === 'ddtree') {
            const ref = dflashDecode(reference.model, reference.drafter, PROMPT, { maxNew: MAX_NEW, budget, depth, eos: [] });
            expect(ref.tokens).toEqual(greedy);
            expect(r.steps.map((s) => s.draftTop1), `budget ${budget}, depth ${depth}`).toEqual(ref.draftTop1PerStep);
            expect(r.steps.map((s) => s.accepted + 1)).toEqual(ref.acceptedPerStep);
          }
        }
      }
    });
  }

  it('feeds the drafter the accepted nodes of multi-token tree paths (gathered rows): every draft equals the reference drafter over the whole committed context', async () => {
    // a random drafter accepts almost nothing; this wrapper records the DFlash drafter's argmax per
    // depth, then overwrites its logits so that the tree accepts long paths through second
    // siblings (node indices that are not 0, 1, 2, ...): the target's next tokens at every depth,
    // outranked at depth 1 by a wrong token
    const inner = (await engine.drafter(`dflash:${drafter}`)) as DflashDrafter;
    const b = engine.backend;
    const V = inner.vocabSize;
    const drafts: { tokens: number[]; top1: number[] }[] = [];
    const wrapper: Drafter = {
      name: 'dflash-steered',
      vocabSize: V,
      maxDepth: inner.maxDepth,
      targetLayers: inner.targetLayers,
      begin: () => inner.begin(),
      commit: (hidden, rows) => inner.commit(hidden, rows),
      draft(request) {
        inner.draft(request);
        const { depth, out, tokens } = request;
        const logits = b.toArray(out) as Float32Array;
        drafts.push({ tokens: [...tokens], top1: Array.from({ length: depth }, (_, d) => argmax(logits, d * V, V)) });
        const steered = new Float32Array(depth * V);
        const next = greedy.slice(tokens.length - PROMPT.length);
        for (let d = 0; d < depth && d < next.length; d++) {
          steered[d * V + next[d]] = 5;
          if (d === 0) steered[(next[0] + 1) % V] = 6;
        }
        b.native.upload(out.buffer, steered, out.offset ?? 0);
      },
      dispose() {},
    };
    const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: wrapper, budget: 8, depth: BLOCK - 1, trace: true });
    expect(r.tokens).toEqual(greedy);
    expect(Math.max(...r.steps.map((s) => s.accepted))).toBe(BLOCK - 1);
    expectReferenceDrafts(drafts);
  });

  it('drafts the same logits with the root read on the device (inside its graph, at every replay) as uploaded, and refuses a rootOnDevice that is not i32 [1]', async () => {
    const d = (await engine.drafter(`dflash:${drafter}`)) as DflashDrafter;
    const b = engine.backend;
    const V = d.vocabSize;
    const uploaded = b.zeros('f32', [2, V]);
    const onDevice = b.zeros('f32', [2, V]);
    const root = b.zeros('i32', [1]);
    try {
      for (const token of [PROMPT[0], PROMPT[1]]) {
        d.begin();
        d.draft({ tokens: [token], depth: 2, out: uploaded });
        b.native.upload(root.buffer, Int32Array.of(token));
        d.draft({ tokens: [token], depth: 2, out: onDevice, rootOnDevice: root });
        expect(b.toArray(onDevice), `root ${token}`).toEqual(b.toArray(uploaded));
      }
      expect(b.toArray(onDevice)).not.toEqual(new Float32Array(2 * V));
      expect(() => d.draft({ tokens: [PROMPT[0]], depth: 2, out: onDevice, rootOnDevice: uploaded })).toThrow(/rootOnDevice must be i32 \[1\], got f32 \[2, /);
    } finally {
      b.free(uploaded, onDevice, root);
    }
  });

  it("holds back the taps of auto's plain decode steps (run a step ahead) and commits them in one batch before the next draft, which equals the reference drafter over the whole context", async () => {
    const { drafter: wrapper, commits, drafts } = recordingDrafter((await engine.drafter(`dflash:${drafter}`)) as DflashDrafter, engine.backend);
    const maxNew = 48;
    const expected = greedyDecode(reference.model, PROMPT, { maxNew, eos: [] }).tokens;
    // the plain steps' launches: held ones, and those queued while another was not read yet
    const runner = (engine as unknown as { runner: { decodesAhead: number; launchDecode(held?: boolean): void } }).runner;
    const launch = runner.launchDecode.bind(runner);
    let held = 0;
    let ahead = 0;
    runner.launchDecode = (h = false) => {
      if (h) held++;
      if (runner.decodesAhead > 0) ahead++;
      launch(h);
    };
    let r;
    try {
      r = await engine.complete(PROMPT, { maxNew, eos: [], spec: 'ddtree', drafter: wrapper, budget: 'auto', trace: true });
    } finally {
      delete (runner as { launchDecode?: unknown }).launchDecode;
    }
    expect(r.tokens).toEqual(expected);
    // the random drafter's trees are not accepted: auto backs off into plain decode steps, and
    // their rows arrive together (a commit of more rows than a step accepts)
    const plain = r.steps.filter((s) => s.budget === 0).length;
    const skipped = r.steps.filter((s) => s.budget === 0 && s.draftTop1.length === 0).length;
    expect(skipped).toBeGreaterThan(8);
    expect(held).toBe(plain);
    expect(ahead).toBeGreaterThan(skipped / 2);
    expect(Math.max(...commits.slice(1))).toBeGreaterThan(BLOCK);
    expect(drafts.length).toBeGreaterThanOrEqual(2);
    expectReferenceDrafts(drafts);
  });

  it('holds back the rows of a drafter of one tap (an odd count: the held step writes its row paired with itself), and its drafts equal the reference drafter\'s', async () => {
    const tiny = parseModelConfig(presetConfigJson('tiny'), 'tiny');
    const json = dflashConfigJson(tiny, { blockSize: BLOCK, heads: 6, kvHeads: 2, headDim: 24, intermediate: 96, targetLayerIds: [0] });
    const oneTap = join(dir, 'tiny-dflash-one-tap');
    await writeDflashDirectory(oneTap, json, randomDflashWeights(parseDflashConfig(json), 23));
    const ref = (await loadDflashModel(oneTap, reference.model)).model;
    expect(ref.config.targetLayerIds).toEqual([0]);
    const { drafter: wrapper, commits, drafts } = recordingDrafter((await engine.drafter(`dflash:${oneTap}`)) as DflashDrafter, engine.backend);
    const maxNew = 48;
    const r = await engine.complete(PROMPT, { maxNew, eos: [], spec: 'ddtree', drafter: wrapper, budget: 'auto', trace: true });
    expect(r.tokens).toEqual(greedyDecode(reference.model, PROMPT, { maxNew, eos: [] }).tokens);
    expect(r.steps.filter((s) => s.budget === 0 && s.draftTop1.length === 0).length).toBeGreaterThan(8);
    expect(Math.max(...commits.slice(1))).toBeGreaterThan(BLOCK);
    expectReferenceDrafts(drafts, ref);
  });

  it("holds back no more rows than one commit may bring (an engine of 9-row passes), and stays exact with budget 'auto'", async () => {
    const small = await createEngine({ model: target, backend: TEST_BACKEND, cacheTokens: 256, cacheDtype: 'f32', activations: 'f32', prefillChunk: 8, maxBudget: 8, maxDepth: 4 });
    try {
      const maxNew = 48;
      const expected = greedyDecode(reference.model, PROMPT, { maxNew, eos: [] }).tokens;
      const { drafter: slow, commits } = recordingDrafter((await small.drafter(`dflash:${drafter}`)) as DflashDrafter, small.backend);
      const r = await small.complete(PROMPT, { maxNew, eos: [], spec: 'ddtree', drafter: slow, budget: 'auto', trace: true });
      expect(r.tokens).toEqual(expected);
      // waits of more than 9 plain decode steps, whose rows arrive in commits of at most 9
      expect(r.steps.filter((s) => s.budget === 0 && s.draftTop1.length === 0).length).toBeGreaterThan(9);
      expect(Math.max(...commits.slice(1))).toBeLessThanOrEqual(9);
    } finally {
      await small.dispose();
    }
  });

  it('drafts with bf16 activations into its GEMMs on an engine of bf16 activations (the cuda default), and chain and DDTree still equal that engine\'s greedy', async () => {
    const bf16 = await createEngine({ model: target, backend: TEST_BACKEND, cacheTokens: 256, cacheDtype: 'f32', activations: 'bf16', maxBudget: 32 });
    try {
      const d = (await bf16.drafter(`dflash:${drafter}`)) as DflashDrafter;
      expect(d.activations).toBe('bf16');
      const own = (await bf16.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens;
      for (const options of [{ spec: 'chain', budget: BLOCK - 1 }, { spec: 'ddtree', budget: 16 }, { spec: 'ddtree', budget: 'auto' }] as const) {
        const r = await bf16.complete(PROMPT, { maxNew: MAX_NEW, eos: [], drafter: `dflash:${drafter}`, trace: true, ...options });
        expect(r.tokens, JSON.stringify(options)).toEqual(own);
      }
    } finally {
      await bf16.dispose();
    }
  });

  it("defaults the depth to block_size - 1 and drafts exactly with budget 'auto' (its plain decode steps commit their rows too)", async () => {
    const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: `dflash:${drafter}`, trace: true });
    expect(r.tokens).toEqual(greedy);
    expect(r.steps[0].draftTop1).toHaveLength(BLOCK - 1);
    const auto = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: `dflash:${drafter}`, budget: 'auto', trace: true });
    expect(auto.tokens).toEqual(greedy);
    // a greedy generation after it runs untapped graphs and still equals greedy
    expect((await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [] })).tokens).toEqual(greedy);
  });

  it("decodes plainly where a block would pass the drafter's max_position_embeddings or a sliding layer's window, and stays exact", async () => {
    const tiny = parseModelConfig(presetConfigJson('tiny'), 'tiny');
    // 16 positions: the prompt's 8 and a block of 5 fit; from 12 committed tokens on, no block does
    const limits: [string, Record<string, unknown>][] = [
      ['max_position_embeddings', { max_position_embeddings: 16 }],
      ['sliding_window', { layer_types: ['sliding_attention', 'full_attention'], sliding_window: 16 }],
    ];
    for (const [what, fields] of limits) {
      const limited = join(dir, `tiny-dflash-${what}`);
      const json = { ...dflashConfigJson(tiny, { blockSize: BLOCK, heads: 6, kvHeads: 2, headDim: 24, intermediate: 96 }), ...fields };
      await writeDflashDirectory(limited, json, randomDflashWeights(parseDflashConfig(json), 22));
      const r = await engine.complete(PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: `dflash:${limited}`, budget: 4, trace: true });
      expect(r.tokens, what).toEqual(greedy);
      // a step's context is the prompt and the tokens before its root: a draft while it fits, none after
      let committed = PROMPT.length;
      for (const step of r.steps) {
        expect(step.draftTop1.length, `${what}, after ${committed} committed`).toBe(committed + BLOCK <= 16 ? BLOCK - 1 : 0);
        committed += step.accepted + 1;
      }
      expect(r.steps.at(-1)!.treeSize, what).toBe(1);
    }
  });

  it('refuses a drafter that does not fit the target with the pairing check, and a depth past the block', async () => {
    const small = parseModelConfig(presetConfigJson('small'), 'small');
    const other = join(dir, 'small-dflash');
    const json = dflashConfigJson(small);
    await writeDflashDirectory(other, json, randomDflashWeights(parseDflashConfig(json), 3));
    const refused = engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: `dflash:${other}` });
    await expect(refused).rejects.toBeInstanceOf(EngineError);
    await expect(refused).rejects.toMatchObject({ code: 'KDTREE_ENGINE_DRAFTER', message: expect.stringContaining(`${other} does not fit the target model: hidden_size ${small.hiddenSize} != the target's 64`) });
    await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'chain', drafter: `dflash:${drafter}`, depth: BLOCK })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ARGUMENT', field: 'depth' });
    // a DFlash directory given as a draft model, or as the model to run, names the spec it needs
    await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: `model:${drafter}` })).rejects.toMatchObject({
      code: 'KDTREE_ENGINE_DRAFTER',
      message: expect.stringContaining(`drafter model:${drafter}: ${drafter} is a DFlash drafter (${drafter}/config.json: architectures ["DFlashDraftModel"]), not a model to decode or draft with as one: pass it as a drafter, dflash:${drafter}`),
    });
    await expect(createEngine({ model: drafter, backend: TEST_BACKEND })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_MODEL', field: 'architectures' });
    // its weights alone, without the config.json beside them
    const lone = join(dir, 'lone');
    mkdirSync(lone);
    copyFileSync(join(drafter, 'model.safetensors'), join(lone, 'w.safetensors'));
    await expect(engine.complete(PROMPT, { maxNew: 4, spec: 'ddtree', drafter: `dflash:${lone}/w.safetensors` })).rejects.toMatchObject({
      code: 'KDTREE_ENGINE_DRAFTER',
      message: `drafter dflash:${lone}/w.safetensors: no config.json beside its weights; a DFlash drafter is its directory (config.json + safetensors) or the bundle \`kdtree import\` makes of it`,
    });
    // the engine is still usable
    expect((await engine.complete(PROMPT, { maxNew: 6, eos: [], spec: 'chain', drafter: `dflash:${drafter}`, budget: 4 })).tokens).toEqual(greedy.slice(0, 6));
  });
});

// the drafters of the PyTorch fixtures (packages/reference/fixtures/dflash, checked there against
// z-lab's model.py): YaRN RoPE and a nested block_size (yarn-b8-nested), rope-b4 over a YaRN target
describe(`the DFlash fixtures' drafters on the engine (${TEST_BACKEND})`, () => {
  const ROOT = join(import.meta.dirname, '..', '..', 'reference', 'fixtures');
  for (const fixture of ['yarn-b8-nested', 'rope-b4']) {
    it(`${fixture}: DDTree with dflash:DIR equals greedy, each step's draftTop1 the reference's`, async () => {
      const drafterDir = join(ROOT, 'dflash', fixture);
      const golden = JSON.parse(readFileSync(join(drafterDir, 'golden.json'), 'utf8')) as { target: string };
      const target = join(ROOT, 'hf', golden.target);
      const { model } = await loadModel(target);
      const ref = (await loadDflashModel(drafterDir, model)).model;
      const prompt = PROMPT.map((t) => t % model.config.vocabSize);
      const greedyTokens = greedyDecode(model, prompt, { maxNew: 16, eos: [] }).tokens;
      const e = await createEngine({ model: target, backend: TEST_BACKEND, cacheTokens: 128, cacheDtype: 'f32', activations: 'f32', maxBudget: 16 });
      try {
        for (const budget of [2, 16]) {
          const r = await e.complete(prompt, { maxNew: 16, eos: [], spec: 'ddtree', drafter: `dflash:${drafterDir}`, budget, trace: true });
          expect(r.tokens, `budget ${budget}`).toEqual(greedyTokens);
          const expected = dflashDecode(model, ref, prompt, { maxNew: 16, budget, eos: [] });
          expect(r.steps.map((s) => s.draftTop1), `budget ${budget}`).toEqual(expected.draftTop1PerStep);
        }
      } finally {
        await e.dispose();
      }
    });
  }
});
