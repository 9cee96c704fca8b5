/**
 * A DFlash drafter that predicts its target, on the engine: the walk target of @kdtree/reference
 * (INT4 routed experts, as the demo makes it) and the drafter built for it. Chain and DDTree emit
 * greedy's tokens at every budget, accept several tokens a step (a drafter of random weights
 * accepts none), and each step's draftTop1 is the reference's dflashDecode's for the same budget.
 */
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  dflashDecode,
  GOLDEN_PROMPT,
  greedyDecode,
  loadDflashModel,
  loadModel,
  parseModelConfig,
  presetConfigJson,
  randomWeights,
  walkDflashConfig,
  walkDflashWeights,
  walkStructure,
  walkWeights,
  writeDflashDirectory,
  writeSyntheticModel,
  type DflashModel,
  type ReferenceModel,
} from '@kdtree/reference';
import { createEngine, type Engine } from './index.js';
import { tempDir, TEST_BACKEND } from './test-support/models.js';

const MAX_NEW = 40;
const BLOCK = 6;

describe(`a DFlash drafter built for a walk target, on the engine (${TEST_BACKEND})`, () => {
  const dir = tempDir('kdtree-dflash-walk-');
  const target = join(dir, 'small-walk.kdtr');
  const drafterDir = join(dir, 'small-walk-dflash');
  let engine: Engine;
  let reference: { model: ReferenceModel; drafter: DflashModel };
  let greedy: number[];

  beforeAll(async () => {
    const config = parseModelConfig(presetConfigJson('small'), 'small');
    const walk = walkStructure(config, 5);
    await writeSyntheticModel(target, { preset: 'small', seed: 5, quant: 'kimi-k2', structure: 'walk', weights: walkWeights(config, randomWeights(config, 5), walk) }, 'engine tests');
    const drafter = walkDflashConfig(config, walk, { blockSize: BLOCK });
    await writeDflashDirectory(drafterDir, drafter.json, walkDflashWeights(drafter.config, walk));
    const { model } = await loadModel(target);
    reference = { model, drafter: (await loadDflashModel(drafterDir, model)).model };
    greedy = greedyDecode(model, GOLDEN_PROMPT, { maxNew: MAX_NEW, eos: [] }).tokens;
    engine = await createEngine({ model: target, backend: TEST_BACKEND, cacheTokens: 256, maxBudget: 64 });
  });
  afterAll(async () => {
    await engine?.dispose();
  });

  it('emits greedy\'s tokens with chain and DDTree at every budget, and accepts several tokens a step', async () => {
    const accepted: Record<string, number> = {};
    for (const [spec, budget] of [['chain', BLOCK - 1], ['ddtree', 1], ['ddtree', BLOCK - 1], ['ddtree', 16], ['ddtree', 64]] as const) {
      const r = await engine.complete(GOLDEN_PROMPT, { maxNew: MAX_NEW, eos: [], spec, drafter: `dflash:${drafterDir}`, budget });
      expect(r.tokens, `${spec}, budget ${budget}`).toEqual(greedy);
      accepted[`${spec} ${budget}`] = r.stats.meanAcceptedLength;
    }
    // one draft node can add at most one token a step; the built drafter's chain adds more than one
    expect(accepted['ddtree 1']).toBeLessThanOrEqual(2);
    expect(accepted[`chain ${BLOCK - 1}`]).toBeGreaterThan(2.2);
    // the tree's extra nodes are the +2 branches the chain cannot follow
    expect(accepted['ddtree 16']).toBeGreaterThanOrEqual(accepted[`chain ${BLOCK - 1}`]);
  });

  it("drafts the reference's tokens at every depth of every step (DDTree, budget 16)", async () => {
    const r = await engine.complete(GOLDEN_PROMPT, { maxNew: MAX_NEW, eos: [], spec: 'ddtree', drafter: `dflash:${drafterDir}`, budget: 16, trace: true });
    const ref = dflashDecode(reference.model, reference.drafter, GOLDEN_PROMPT, { maxNew: MAX_NEW, budget: 16, eos: [] });
    expect(ref.tokens).toEqual(greedy);
    expect(r.steps.map((s) => s.draftTop1)).toEqual(ref.draftTop1PerStep);
    expect(r.steps.map((s) => s.accepted + 1)).toEqual(ref.acceptedPerStep);
  });
});
