import { describe, expect, it } from 'vitest';
import { parseModelConfig } from './config.js';
import { dflashDecode } from './dflash-decode.js';
import { dflashFromWeights } from './dflash-synthetic.js';
import { greedyDecode } from './generate.js';
import { argmax } from './tensor-ops.js';
import { modelFromWeights, presetConfigJson, randomWeights } from './synthetic.js';
import { walkDflashConfig, walkDflashWeights, walkStructure, walkWeights } from './walk.js';

const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];

async function walkPair(preset: 'tiny' | 'small', seed: number, blockSize = 8) {
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const walk = walkStructure(config, seed);
  const weights = walkWeights(config, randomWeights(config, seed), walk);
  const model = await modelFromWeights(config, weights);
  const drafter = walkDflashConfig(config, walk, { blockSize });
  const draft = await dflashFromWeights(drafter.config, walkDflashWeights(drafter.config, walk), { embed: weights.get('model.embed_tokens.weight')!, lmHead: weights.get('lm_head.weight')! });
  return { config, walk, model, draft };
}

/** Each emitted token's step along the walk (coordinate difference mod vocab). */
function walkSteps(coordinate: Int32Array, tokens: number[], vocab: number): number[] {
  return tokens.slice(1).map((t, i) => (coordinate[t] - coordinate[tokens[i]] + vocab) % vocab);
}

describe('the walk target and the DFlash drafter built for it', () => {
  it('makes a target whose greedy continuation mostly steps +1 or +2 along the walk, and a random target that does not', async () => {
    const { config, walk, model } = await walkPair('small', 3);
    const { tokens } = greedyDecode(model, PROMPT, { maxNew: 48, eos: [] });
    const steps = walkSteps(walk.coordinate, [PROMPT.at(-1)!, ...tokens], config.vocabSize);
    const ones = steps.filter((s) => s === 1).length;
    const twos = steps.filter((s) => s === 2).length;
    expect(ones + twos).toBeGreaterThanOrEqual(0.9 * steps.length);
    // the random layers decide between the two steps: both occur
    expect(ones).toBeGreaterThan(0.5 * steps.length);
    expect(twos).toBeGreaterThan(0);
    const random = await modelFromWeights(config, randomWeights(config, 3));
    const r = greedyDecode(random, PROMPT, { maxNew: 48, eos: [] }).tokens;
    const randomSteps = walkSteps(walk.coordinate, [PROMPT.at(-1)!, ...r], config.vocabSize);
    expect(randomSteps.filter((s) => s === 1 || s === 2).length).toBeLessThan(0.2 * steps.length);
  });

  it("drafts the walk's +1 path at every depth from the bonus token alone, at any position", async () => {
    for (const preset of ['tiny', 'small'] as const) {
      const { config, walk, draft } = await walkPair(preset, 4);
      const V = config.vocabSize;
      for (const [context, bonus] of [[1, 5], [9, 77], [40, 3]]) {
        const { logits } = draft.draft(draft.newCache(), new Float32Array(context * draft.contextWidth), context, bonus);
        const shifts = Array.from({ length: 7 }, (_, d) => (walk.coordinate[argmax(logits, d * V, V)] - walk.coordinate[bonus] + V) % V);
        expect(shifts, `${preset}, bonus ${bonus} after ${context} context rows`).toEqual([1, 2, 3, 4, 5, 6, 7]);
      }
    }
  });

  it('predicts the target: DDTree with the built drafter is greedy-exact and accepts several tokens a step, more with a larger budget', async () => {
    const { model, draft } = await walkPair('small', 3);
    const greedy = greedyDecode(model, PROMPT, { maxNew: 40, eos: [] }).tokens;
    const mean = (r: { tokens: number[]; acceptedPerStep: number[] }) => r.tokens.length / r.acceptedPerStep.length;
    const small = dflashDecode(model, draft, PROMPT, { maxNew: 40, budget: 7, eos: [] });
    const large = dflashDecode(model, draft, PROMPT, { maxNew: 40, budget: 32, eos: [] });
    expect(small.tokens).toEqual(greedy);
    expect(large.tokens).toEqual(greedy);
    expect(mean(small)).toBeGreaterThan(2.5);
    expect(mean(large)).toBeGreaterThanOrEqual(mean(small));
  });

  it('refuses shapes it cannot build, naming what is wrong', async () => {
    const tinyJson = presetConfigJson('tiny');
    expect(() => walkStructure(parseModelConfig({ ...tinyJson, hidden_size: 16 }, 'narrow'), 1)).toThrow(/hidden >= 18/);
    const { config, walk } = await walkPair('tiny', 1);
    const other = parseModelConfig(presetConfigJson('small'), 'small');
    expect(() => walkWeights(other, randomWeights(other, 1), walk)).toThrow(/made for vocab 128 x hidden 64/);
    expect(() => walkDflashConfig(config, walk, { blockSize: 1 })).toThrow(/blockSize must be an integer in \[2, 16\]/);
    const mismatched = walkDflashConfig(config, walk, { blockSize: 4 }).config;
    expect(() => walkDflashWeights({ ...mismatched, numHeads: 2 }, walk)).toThrow(/needs the config of walkDflashConfigJson/);
  });
});
