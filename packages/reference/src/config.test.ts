import { describe, expect, it } from 'vitest';
import { parseModelConfig } from './config.js';
import { ConfigError } from './errors.js';

const K2 = {
  model_type: 'kimi_k2', vocab_size: 163840, hidden_size: 7168, intermediate_size: 18432, moe_intermediate_size: 2048,
  num_hidden_layers: 61, num_attention_heads: 64, num_key_value_heads: 64, n_routed_experts: 384, num_experts_per_tok: 8,
  n_shared_experts: 1, first_k_dense_replace: 1, q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64,
  v_head_dim: 128, n_group: 1, topk_group: 1, norm_topk_prob: true, routed_scaling_factor: 2.827, rms_norm_eps: 1e-5,
  max_position_embeddings: 262144, rope_theta: 50000,
  rope_scaling: { type: 'yarn', factor: 64, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1, original_max_position_embeddings: 4096 },
  eos_token_id: 163586,
};

describe('model config', () => {
  it('reads the Kimi K2 facts', () => {
    const c = parseModelConfig(K2);
    expect(c).toMatchObject({ hiddenSize: 7168, numHeads: 64, nRoutedExperts: 384, numExpertsPerTok: 8, kvLoraRank: 512, qLoraRank: 1536, weightPrefix: '', eosTokenIds: [163586] });
    expect(c.rope).toMatchObject({ type: 'yarn', theta: 50000, factor: 64, betaFast: 32, betaSlow: 1, mscale: 1, mscaleAllDim: 1, originalMaxPositionEmbeddings: 4096 });
    expect(c.mlaNormEps).toBe(1e-6);
  });

  it('reads transformers 5 rope_parameters like the legacy rope_scaling + rope_theta', () => {
    const { rope_scaling: rs, rope_theta: theta, ...rest } = K2;
    const v5 = parseModelConfig({ ...rest, rope_parameters: { rope_type: 'yarn', rope_theta: theta, ...rs, type: undefined } });
    expect(v5.rope).toEqual(parseModelConfig(K2).rope);
  });

  it('unwraps the Kimi K2.5 / K2.6 text_config wrapper, with the language_model. tensor prefix', () => {
    const c = parseModelConfig({ model_type: 'kimi_k25', architectures: ['KimiK25ForConditionalGeneration'], text_config: K2 });
    expect(c.weightPrefix).toBe('language_model.');
    expect(c.numLayers).toBe(61);
  });

  it("fills transformers' defaults for absent fields", () => {
    const c = parseModelConfig({ model_type: 'deepseek_v3' });
    expect(c).toMatchObject({ vocabSize: 129280, numHeads: 128, nRoutedExperts: 256, nGroup: 8, topkGroup: 4, firstKDenseReplace: 3, routedScalingFactor: 2.5, rmsNormEps: 1e-6, ropeInterleave: true });
    expect(c.rope).toEqual({ type: 'default', theta: 10000 });
  });

  it('names the field of every bad value', () => {
    const bad: [Record<string, unknown>, RegExp][] = [
      [{ ...K2, hidden_size: -1 }, /hidden_size: expected an integer >= 1, got -1/],
      [{ ...K2, n_group: 5 }, /n_group: n_routed_experts \(384\) must be a multiple of n_group \(5\)/],
      [{ ...K2, topk_group: 2 }, /topk_group \(2\) must not exceed n_group \(1\)/],
      [{ ...K2, qk_rope_head_dim: 63 }, /qk_rope_head_dim: must be even/],
      [{ ...K2, scoring_func: 'softmax' }, /scoring_func: only the sigmoid router/],
      [{ ...K2, rope_scaling: { type: 'yarn' } }, /rope_scaling\.factor: yarn needs a positive factor/],
      [{ ...K2, rope_scaling: { type: 'dynamic', factor: 2 } }, /rope_scaling\.rope_type: only "yarn" and "default"/],
      [{ ...K2, model_type: 'llama' }, /model_type: expected one of/],
      [{ ...K2, num_key_value_heads: 8 }, /num_key_value_heads/],
      [{ ...K2, num_experts_per_tok: 400 }, /num_experts_per_tok/],
      [{ model_type: 'kimi_k25', text_config: { ...K2, kv_lora_rank: 'x' } }, /text_config\.kv_lora_rank/],
    ];
    for (const [json, message] of bad) {
      expect(() => parseModelConfig(json, 'cfg.json')).toThrow(ConfigError);
      expect(() => parseModelConfig(json, 'cfg.json')).toThrow(message);
    }
  });
});
