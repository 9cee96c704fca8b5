import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultTargetLayerIds, parseDflashConfig, checkDflashPairing } from './dflash-config.js';
import { dflashDecode, targetTaps } from './dflash-decode.js';
import { dflashConfigJson, dflashFromWeights, randomDflashWeights, writeDflashDirectory } from './dflash-synthetic.js';
import { checkDflashTensors, dflashWeightSpecs, type DflashModel } from './dflash.js';
import { ConfigError, PairingError, ReferenceUsageError } from './errors.js';
import { greedyDecode } from './generate.js';
import { loadDflashModel } from './load.js';
import type { ReferenceModel } from './model.js';
import { GOLDEN_PROMPT } from './synthetic.js';
import { tinyModel } from './test-support/tiny-model.js';

// Kimi K2.5's drafter (z-lab/Kimi-K2.5-DFlash), the fields that matter here
const KIMI = {
  architectures: ['DFlashDraftModel'],
  model_type: 'qwen3',
  hidden_size: 7168,
  intermediate_size: 18432,
  num_hidden_layers: 6,
  num_attention_heads: 64,
  num_key_value_heads: 8,
  head_dim: 128,
  vocab_size: 163840,
  rms_norm_eps: 1e-6,
  rope_theta: 50000,
  rope_scaling: { type: 'yarn', factor: 64, original_max_position_embeddings: 4096, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1 },
  max_position_embeddings: 262144,
  num_target_layers: 61,
  block_size: 8,
  dflash_config: { target_layer_ids: [1, 12, 24, 35, 47, 58], mask_token_id: 163838 },
};

function configError(json: unknown): ConfigError {
  try {
    parseDflashConfig(json, 'drafter/config.json');
  } catch (error) {
    expect(error).toBeInstanceOf(ConfigError);
    return error as ConfigError;
  }
  throw new Error('expected a ConfigError');
}

describe('DFlash config', () => {
  it("reads Kimi K2.5's drafter: 6 layers, GQA 64/8 of 128, block 8, its taps and mask", () => {
    const c = parseDflashConfig(KIMI);
    expect(c).toMatchObject({ numLayers: 6, numHeads: 64, numKvHeads: 8, headDim: 128, blockSize: 8, maskTokenId: 163838, numTargetLayers: 61, slidingWindow: null });
    expect(c.targetLayerIds).toEqual([1, 12, 24, 35, 47, 58]);
    expect(c.rope).toMatchObject({ type: 'yarn', factor: 64, originalMaxPositionEmbeddings: 4096 });
    expect(c.layerTypes).toEqual(Array(6).fill('full_attention'));
  });

  it('derives the target layers as the public build_target_layer_ids does when the config lists none', () => {
    expect(defaultTargetLayerIds(61, 6)).toEqual([1, 12, 24, 35, 47, 58]);
    expect(defaultTargetLayerIds(36, 5)).toEqual([1, 9, 17, 25, 33]); // z-lab/Qwen3-4B-DFlash's
    expect(defaultTargetLayerIds(61, 1)).toEqual([30]);
    const { dflash_config, ...rest } = KIMI;
    expect(parseDflashConfig({ ...rest, dflash_config: { mask_token_id: dflash_config.mask_token_id } }).targetLayerIds).toEqual([1, 12, 24, 35, 47, 58]);
  });

  it('takes block_size at the top level or inside dflash_config, and refuses two different ones', () => {
    const { block_size, ...rest } = KIMI;
    expect(parseDflashConfig({ ...rest, dflash_config: { ...KIMI.dflash_config, block_size: 16 } }).blockSize).toBe(16);
    expect(configError({ ...KIMI, dflash_config: { ...KIMI.dflash_config, block_size: 16 } }).message).toMatch(/block_size: 8 differs from dflash_config.block_size 16/);
    expect(configError(rest).message).toMatch(/block_size: missing/);
    expect(configError({ ...KIMI, block_size: 1 }).message).toMatch(/block_size: expected an integer >= 2/);
    expect(configError({ ...KIMI, max_position_embeddings: 4 }).message).toMatch(/block_size: 8 is past max_position_embeddings \(4\)/);
    expect(parseDflashConfig({ ...KIMI, max_position_embeddings: 8 }).blockSize).toBe(8);
  });

  it('names the field of every bad value', () => {
    expect(configError({ ...KIMI, architectures: ['DeepseekV3ForCausalLM'] }).field).toBe('architectures');
    expect(configError({ ...KIMI, model_type: 'llama' }).message).toMatch(/model_type: DFlash drafters are Qwen3 decoder layers/);
    expect(configError({ ...KIMI, dflash_config: { target_layer_ids: [1, 2] } }).message).toMatch(/mask_token_id: missing/);
    expect(configError({ ...KIMI, dflash_config: { ...KIMI.dflash_config, mask_token_id: 163840 } }).message).toMatch(/mask_token_id: expected a token id in \[0, 163840\)/);
    expect(configError({ ...KIMI, dflash_config: { ...KIMI.dflash_config, target_layer_ids: [1, 61] } }).message).toMatch(/layer 61 is outside the 61 target layers/);
    expect(configError({ ...KIMI, dflash_config: { ...KIMI.dflash_config, target_layer_ids: [] } }).field).toBe('dflash_config.target_layer_ids');
    expect(configError({ ...KIMI, num_key_value_heads: 7 }).message).toMatch(/multiple of num_key_value_heads/);
    expect(configError({ ...KIMI, attention_bias: true }).field).toBe('attention_bias');
    expect(configError({ ...KIMI, layer_types: ['full_attention'] }).message).toMatch(/layer_types: expected a list of 6 layer types/);
    expect(configError({ ...KIMI, rope_scaling: { type: 'dynamic', factor: 2 } }).field).toBe('rope_scaling.rope_type');
  });

  it('reads sliding layers from layer_types or from use_sliding_window + max_window_layers', () => {
    const sliding = parseDflashConfig({ ...KIMI, use_sliding_window: true, sliding_window: 4096, max_window_layers: 4 });
    expect(sliding.layerTypes).toEqual(['full_attention', 'full_attention', 'full_attention', 'full_attention', 'sliding_attention', 'sliding_attention']);
    expect(sliding.slidingWindow).toBe(4096);
    const types = ['sliding_attention', 'full_attention', 'full_attention', 'full_attention', 'full_attention', 'full_attention'];
    expect(parseDflashConfig({ ...KIMI, layer_types: types, sliding_window: 2048 }).slidingWindow).toBe(2048);
    // transformers: use_sliding_window false means no window at all
    expect(parseDflashConfig({ ...KIMI, layer_types: types, sliding_window: 2048, use_sliding_window: false }).slidingWindow).toBeNull();
  });
});

describe('DFlash pairing', () => {
  const target = { hiddenSize: 7168, vocabSize: 163840, numLayers: 61 };
  it('accepts the drafter with the target it was trained for', () => {
    expect(() => checkDflashPairing(parseDflashConfig(KIMI), target)).not.toThrow();
  });

  it('lists every mismatch: hidden size, vocabulary, target layers', () => {
    let error: unknown;
    try {
      checkDflashPairing(parseDflashConfig(KIMI), { hiddenSize: 4096, vocabSize: 151936, numLayers: 36 }, { drafter: 'kimi-dflash', target: 'qwen3-8b' });
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(PairingError);
    const p = error as PairingError;
    expect(p.message).toMatch(/^kimi-dflash does not fit qwen3-8b: /);
    expect(p.problems).toEqual([
      "hidden_size 7168 != the target's 4096 (the drafter reads the target's hidden states)",
      "vocab_size 163840 != the target's 151936 (the drafter uses the target's embed_tokens and lm_head)",
      "mask_token_id 163838 is outside the target's vocabulary of 151936",
      "target_layer_ids [47,58] are outside the target's 36 layers",
      "num_target_layers 61 != the target's 36 layers (it was trained for another target)",
    ]);
  });
});

describe('DFlash drafter on the reference', () => {
  let target: ReferenceModel;
  let drafter: DflashModel;
  let dir: string;
  beforeAll(async () => {
    target = await tinyModel(1);
    const config = parseDflashConfig(dflashConfigJson(target.config, { blockSize: 5, heads: 4, kvHeads: 2, headDim: 16 }), 'tiny drafter');
    drafter = await dflashFromWeights(config, randomDflashWeights(config, 7), target.weights);
    dir = await mkdtemp(join(tmpdir(), 'kdtree-dflash-'));
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it('drafts the same block from a context fed over several rounds as from all of it at once', () => {
    const seq = [...GOLDEN_PROMPT, 3, 9, 27, 81, 17];
    const taps = targetTaps(target, drafter.config.targetLayerIds, seq.length);
    target.forward(seq, target.newCache(seq.length), { logitRows: [0], onLayer: taps.onLayer });
    const W = drafter.contextWidth;
    const rows = (from: number, to: number) => taps.hidden.slice(from * W, to * W);
    const bonus = 42;
    const whole = drafter.draft(drafter.newCache(), rows(0, seq.length), seq.length, bonus);
    const cache = drafter.newCache();
    drafter.draft(cache, rows(0, 8), 8, seq[8]);
    drafter.draft(cache, rows(8, 11), 3, seq[11]);
    const last = drafter.draft(cache, rows(11, seq.length), seq.length - 11, bonus);
    expect(cache.length).toBe(seq.length);
    // one f64 sum per value, in the same key order: the rounds give the same bits
    expect(last.logits).toEqual(whole.logits);
    // and a different context gives different logits (the context is read)
    const other = drafter.draft(drafter.newCache(), rows(0, seq.length - 1), seq.length - 1, bonus);
    expect(other.logits).not.toEqual(whole.logits);
  });

  it('refuses a context of the wrong width, a bonus outside the vocabulary, an empty first round', () => {
    const W = drafter.contextWidth;
    expect(() => drafter.draft(drafter.newCache(), new Float32Array(3 * W - 1), 3, 1)).toThrow(/expected 3 rows x 128 \(2 tapped layers x hidden 64\)/);
    expect(() => drafter.draft(drafter.newCache(), new Float32Array(W), 1, 128)).toThrow(ReferenceUsageError);
    expect(() => drafter.draft(drafter.newCache(), new Float32Array(0), 0, 1)).toThrow(/first DFlash round needs context/);
  });

  it('refuses a round wider than a sliding layer\'s window, naming the layer', async () => {
    const json = { ...dflashConfigJson(target.config, { blockSize: 4 }), layer_types: ['full_attention', 'sliding_attention'], sliding_window: 10 };
    const config = parseDflashConfig(json, 'sliding');
    const sliding = await dflashFromWeights(config, randomDflashWeights(config, 3), target.weights);
    const W = sliding.contextWidth;
    expect(() => sliding.draft(sliding.newCache(), new Float32Array(6 * W), 6, 1)).not.toThrow(); // 6 + 4 positions
    expect(() => sliding.draft(sliding.newCache(), new Float32Array(7 * W), 7, 1)).toThrow(/layer 1 of the drafter is a sliding-window layer \(window 10\) and this round spans 11 positions/);
  });

  it('decodes greedy-exactly with DDTree for budgets 1..200 and depths 1, 2, 4', () => {
    const maxNew = 24;
    const greedy = greedyDecode(target, GOLDEN_PROMPT, { maxNew, eos: [] }).tokens;
    let longest = 0;
    for (const budget of [1, 2, 3, 8, 16, 64, 200]) {
      for (const depth of [1, 2, 4]) {
        const r = dflashDecode(target, drafter, GOLDEN_PROMPT, { maxNew, budget, depth, eos: [] });
        expect(r.tokens, `budget ${budget} depth ${depth}`).toEqual(greedy);
        expect(r.acceptedPerStep.reduce((a, b) => a + b, 1)).toBeGreaterThanOrEqual(maxNew);
        expect(r.draftTop1PerStep).toHaveLength(r.acceptedPerStep.length);
        r.draftTop1PerStep.forEach((top) => expect(top).toHaveLength(depth));
        longest = Math.max(longest, ...r.acceptedPerStep);
      }
    }
    // budgets above the vocabulary (128) cover every depth-1 token: paths of 2+ nodes, so the
    // drafter's context grew by more than one row at a time
    expect(longest).toBeGreaterThanOrEqual(2);
  });

  it('stops at eos and takes depth block_size - 1 by default', () => {
    const greedy = greedyDecode(target, GOLDEN_PROMPT, { maxNew: 12, eos: [] }).tokens;
    const eos = greedy[5];
    const r = dflashDecode(target, drafter, GOLDEN_PROMPT, { maxNew: 12, budget: 8, eos: [eos] });
    expect(r.stoppedBy).toBe('eos');
    expect(r.tokens).toEqual(greedy.slice(0, greedy.indexOf(eos) + 1));
    expect(r.draftTop1PerStep[0]).toHaveLength(4);
    expect(() => dflashDecode(target, drafter, GOLDEN_PROMPT, { maxNew: 4, budget: 8, depth: 5 })).toThrow(/depth must be an integer in \[1, 4\]/);
  });

  it('loads a drafter directory (config.json + safetensors) and drafts as the in-memory one', async () => {
    const json = dflashConfigJson(target.config, { blockSize: 5, heads: 4, kvHeads: 2, headDim: 16, nestedBlockSize: true });
    const config = parseDflashConfig(json);
    await writeDflashDirectory(join(dir, 'd'), json, randomDflashWeights(config, 7));
    const loaded = await loadDflashModel(join(dir, 'd'), target);
    expect(loaded.config.blockSize).toBe(5);
    const W = drafter.contextWidth;
    const context = Float32Array.from({ length: 3 * W }, (_, i) => Math.sin(i));
    expect(loaded.model.draft(loaded.model.newCache(), context, 3, 5).logits).toEqual(drafter.draft(drafter.newCache(), context, 3, 5).logits);
  });

  it('refuses a drafter that does not fit the target, before reading its weights', async () => {
    // trained for a 3-layer target: its taps parse, and do not fit this 2-layer one
    const json = { ...dflashConfigJson(target.config, { targetLayerIds: [0, 2] }), num_target_layers: 3 };
    const config = parseDflashConfig(json);
    await writeDflashDirectory(join(dir, 'bad'), json, randomDflashWeights(config, 1));
    const load = loadDflashModel(join(dir, 'bad'), target);
    await expect(load).rejects.toBeInstanceOf(PairingError);
    await expect(load).rejects.toThrow(/target_layer_ids \[2\] are outside the target's 2 layers; num_target_layers 3 != the target's 2 layers/);
  });
});

describe('DFlash checkpoint tensors', () => {
  it('accepts the names z-lab publishes and a model. prefix, and names what is missing or misshapen', async () => {
    const target = await tinyModel(1);
    const config = parseDflashConfig(dflashConfigJson(target.config, { layers: 1 }), 'tiny drafter');
    const specs = dflashWeightSpecs(config);
    expect(() => checkDflashTensors(config, specs, 'd')).not.toThrow();
    expect(() => checkDflashTensors(config, specs.map((s) => ({ ...s, name: `model.${s.name}` })), 'd')).not.toThrow();
    const missing = specs.filter((s) => !s.name.includes('k_norm') && s.name !== 'norm.weight');
    expect(() => checkDflashTensors(config, missing, 'd')).toThrow("d: tensor 'layers.0.self_attn.k_norm.weight': missing (and 1 more: norm.weight)");
    const wrong = specs.map((s) => (s.name === 'fc.weight' ? { ...s, shape: [64, 64] } : s));
    expect(() => checkDflashTensors(config, wrong, 'd')).toThrow("d: tensor 'fc.weight': has shape [64, 64], the drafter config needs [64, 128]");
    expect(() => checkDflashTensors(config, [{ name: 'lm_head.weight', shape: [128, 64] }], 'd')).toThrow(/not a DFlash drafter checkpoint/);
  });
});
