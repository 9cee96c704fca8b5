/**
 * Model config for DeepSeek-V3 / Kimi K2.x, read from HuggingFace config.json: `deepseek_v3`,
 * `kimi_k2`, and the Kimi K2.5/K2.6 multimodal wrapper (`text_config`), with RoPE scaling in
 * either spelling (`rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`).
 * Missing fields take transformers' DeepseekV3Config defaults; every field is validated.
 */
import { ConfigError } from './errors.js';

export type RopeConfig =
  | { type: 'default'; theta: number }
  | {
      type: 'yarn';
      theta: number;
      factor: number;
      betaFast: number;
      betaSlow: number;
      mscale: number;
      mscaleAllDim: number;
      originalMaxPositionEmbeddings: number | null;
      attentionFactor: number | null;
      truncate: boolean;
    };

export interface ModelConfig {
  modelType: string;
  vocabSize: number;
  hiddenSize: number;
  intermediateSize: number;
  moeIntermediateSize: number;
  numLayers: number;
  numHeads: number;
  qLoraRank: number | null;
  kvLoraRank: number;
  qkNopeDim: number;
  qkRopeDim: number;
  vHeadDim: number;
  nRoutedExperts: number;
  nSharedExperts: number;
  numExpertsPerTok: number;
  firstKDenseReplace: number;
  moeLayerFreq: number;
  nGroup: number;
  topkGroup: number;
  normTopkProb: boolean;
  routedScalingFactor: number;
  rmsNormEps: number;
  /** eps of q_a_layernorm and kv_a_layernorm: transformers builds them with its default, 1e-6. */
  mlaNormEps: number;
  rope: RopeConfig;
  ropeInterleave: boolean;
  maxPositionEmbeddings: number;
  tieWordEmbeddings: boolean;
  eosTokenIds: number[];
  /** Tensor name prefix: '' for deepseek_v3/kimi_k2, 'language_model.' inside the K2.5 wrapper. */
  weightPrefix: string;
}

/** transformers' DeepseekV3Config defaults (what an absent field means). */
const DEFAULTS = {
  vocab_size: 129280,
  hidden_size: 7168,
  intermediate_size: 18432,
  moe_intermediate_size: 2048,
  num_hidden_layers: 61,
  num_attention_heads: 128,
  n_shared_experts: 1,
  n_routed_experts: 256,
  routed_scaling_factor: 2.5,
  kv_lora_rank: 512,
  q_lora_rank: 1536,
  qk_rope_head_dim: 64,
  v_head_dim: 128,
  qk_nope_head_dim: 128,
  n_group: 8,
  topk_group: 4,
  num_experts_per_tok: 8,
  first_k_dense_replace: 3,
  moe_layer_freq: 1,
  norm_topk_prob: true,
  max_position_embeddings: 4096,
  rms_norm_eps: 1e-6,
  rope_theta: 10000,
  rope_interleave: true,
  tie_word_embeddings: false,
};

export const MLA_NORM_EPS = 1e-6;

const SUPPORTED_TYPES = new Set(['deepseek_v3', 'kimi_k2', 'kimi_k25']);

export function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/** Reads typed fields of one config object; an absent field takes its value from `defaults`. */
export class Reader {
  constructor(
    private readonly json: Record<string, unknown>,
    readonly source: string,
    private readonly prefix: string,
    private readonly defaults: Readonly<Record<string, unknown>> = DEFAULTS,
  ) {}

  fail(field: string, message: string): never {
    throw new ConfigError(message, this.prefix + field, this.source);
  }

  raw(field: string): unknown {
    return this.json[field];
  }

  int(field: string, min = 1): number {
    const v = this.json[field] ?? this.defaults[field];
    if (typeof v !== 'number' || !Number.isInteger(v) || v < min) this.fail(field, `expected an integer >= ${min}, got ${JSON.stringify(v)}`);
    return v;
  }

  optionalInt(field: string): number | null {
    const v = this.json[field] === undefined ? this.defaults[field] : this.json[field];
    if (v === null) return null;
    if (typeof v !== 'number' || !Number.isInteger(v) || v < 1) this.fail(field, `expected a positive integer or null, got ${JSON.stringify(v)}`);
    return v;
  }

  num(field: string, opts: { positive?: boolean } = {}): number {
    const v = this.json[field] ?? this.defaults[field];
    if (typeof v !== 'number' || !Number.isFinite(v) || (opts.positive && v <= 0)) this.fail(field, `expected a ${opts.positive ? 'positive ' : ''}number, got ${JSON.stringify(v)}`);
    return v;
  }

  bool(field: string): boolean {
    const v = this.json[field] ?? this.defaults[field];
    if (typeof v !== 'boolean') this.fail(field, `expected true or false, got ${JSON.stringify(v)}`);
    return v;
  }
}

/** RoPE from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`. */
export function parseRope(r: Reader): RopeConfig {
  const params = r.raw('rope_parameters');
  const scaling = r.raw('rope_scaling');
  let spec: Record<string, unknown> | undefined;
  let theta: number;
  let where: string;
  if (isObject(params)) {
    spec = params;
    where = 'rope_parameters';
    theta = typeof params.rope_theta === 'number' ? params.rope_theta : r.num('rope_theta', { positive: true });
  } else {
    theta = r.num('rope_theta', { positive: true });
    where = 'rope_scaling';
    if (scaling !== undefined && scaling !== null && !isObject(scaling)) r.fail('rope_scaling', `expected an object or null, got ${JSON.stringify(scaling)}`);
    spec = scaling ?? undefined;
  }
  if (!(theta > 0)) r.fail(`${where}.rope_theta`, `expected a positive number, got ${theta}`);
  const type = spec === undefined ? 'default' : (spec.rope_type ?? spec.type ?? 'default');
  if (type === 'default') return { type: 'default', theta };
  if (type !== 'yarn') r.fail(`${where}.rope_type`, `only "yarn" and "default" RoPE are supported, got ${JSON.stringify(type)}`);
  const s = spec!;
  const num = (key: string, fallback: number | null): number | null => {
    const v = s[key];
    if (v === undefined || v === null) return fallback;
    if (typeof v !== 'number' || !Number.isFinite(v)) r.fail(`${where}.${key}`, `expected a number, got ${JSON.stringify(v)}`);
    return v;
  };
  const factor = num('factor', null);
  if (factor === null || factor <= 0) r.fail(`${where}.factor`, `yarn needs a positive factor, got ${JSON.stringify(s.factor)}`);
  const original = num('original_max_position_embeddings', null);
  if (original !== null && original <= 0) r.fail(`${where}.original_max_position_embeddings`, `expected a positive integer, got ${original}`);
  const truncate = s.truncate === undefined ? true : s.truncate;
  if (typeof truncate !== 'boolean') r.fail(`${where}.truncate`, 'expected true or false');
  return {
    type: 'yarn',
    theta,
    factor,
    // transformers: `rope_parameters.get("beta_fast") or 32` (0 or absent -> default)
    betaFast: num('beta_fast', 32) || 32,
    betaSlow: num('beta_slow', 1) || 1,
    mscale: num('mscale', 0) ?? 0,
    mscaleAllDim: num('mscale_all_dim', 0) ?? 0,
    originalMaxPositionEmbeddings: original,
    attentionFactor: num('attention_factor', null),
    truncate,
  };
}

function eosIds(r: Reader): number[] {
  const v = r.raw('eos_token_id');
  if (v === undefined || v === null) return [];
  const list = Array.isArray(v) ? v : [v];
  if (!list.every((x) => Number.isInteger(x) && x >= 0)) r.fail('eos_token_id', `expected a token id or a list of ids, got ${JSON.stringify(v)}`);
  return list as number[];
}

function moeLayerFreq(r: Reader): number {
  const freq = r.int('moe_layer_freq');
  // transformers makes every layer from first_k_dense_replace on a MoE layer; DeepSeek's own code
  // also requires layer % moe_layer_freq == 0. They agree only for 1, the value of every release.
  if (freq !== 1) r.fail('moe_layer_freq', `only 1 is supported (transformers ignores it), got ${freq}`);
  return freq;
}

/** Parses and validates a HuggingFace config.json object. `source` names it in errors. */
export function parseModelConfig(json: unknown, source = 'config.json'): ModelConfig {
  if (!isObject(json)) throw new ConfigError('expected a JSON object', '(root)', source);
  let text = json;
  let prefix = '';
  let weightPrefix = '';
  if (isObject(json.text_config)) {
    // Kimi K2.5 / K2.6: a multimodal wrapper around the DeepSeek-V3 text model
    text = json.text_config;
    prefix = 'text_config.';
    weightPrefix = 'language_model.';
  }
  const r = new Reader(text, source, prefix);
  const modelType = String(text.model_type ?? json.model_type ?? 'deepseek_v3');
  if (!SUPPORTED_TYPES.has(modelType)) r.fail('model_type', `expected one of ${[...SUPPORTED_TYPES].join(', ')}, got ${JSON.stringify(modelType)}`);
  const act = text.hidden_act ?? 'silu';
  if (act !== 'silu') r.fail('hidden_act', `only silu is supported, got ${JSON.stringify(act)}`);
  if (text.attention_bias === true) r.fail('attention_bias', 'attention biases are not supported (DeepSeek-V3 and Kimi K2 have none)');
  const scoring = text.scoring_func ?? 'sigmoid';
  if (scoring !== 'sigmoid') r.fail('scoring_func', `only the sigmoid router of DeepSeek-V3 / Kimi K2 is supported, got ${JSON.stringify(scoring)}`);
  const topkMethod = text.topk_method ?? 'noaux_tc';
  if (topkMethod !== 'noaux_tc') r.fail('topk_method', `only noaux_tc is supported, got ${JSON.stringify(topkMethod)}`);

  const numHeads = r.int('num_attention_heads');
  const kvHeads = text.num_key_value_heads ?? numHeads;
  if (kvHeads !== numHeads) r.fail('num_key_value_heads', `MLA has as many key/value heads as query heads (${numHeads}), got ${JSON.stringify(kvHeads)}`);
  const nRoutedExperts = r.int('n_routed_experts');
  const nGroup = r.int('n_group');
  const topkGroup = r.int('topk_group');
  const numExpertsPerTok = r.int('num_experts_per_tok');
  if (nRoutedExperts % nGroup !== 0) r.fail('n_group', `n_routed_experts (${nRoutedExperts}) must be a multiple of n_group (${nGroup})`);
  if (topkGroup > nGroup) r.fail('topk_group', `topk_group (${topkGroup}) must not exceed n_group (${nGroup})`);
  if (nGroup > 1 && nRoutedExperts / nGroup < 2) r.fail('n_group', `group-limited routing scores each group by its top-2 experts, so groups need >= 2 experts (have ${nRoutedExperts / nGroup})`);
  if (numExpertsPerTok > topkGroup * (nRoutedExperts / nGroup)) {
    r.fail('num_experts_per_tok', `${numExpertsPerTok} experts per token cannot be chosen from ${topkGroup} groups of ${nRoutedExperts / nGroup}`);
  }
  const qkRopeDim = r.int('qk_rope_head_dim', 2);
  if (qkRopeDim % 2 !== 0) r.fail('qk_rope_head_dim', `must be even (RoPE rotates pairs), got ${qkRopeDim}`);
  const maxPositionEmbeddings = r.int('max_position_embeddings');
  const numLayers = r.int('num_hidden_layers');
  const firstKDenseReplace = r.int('first_k_dense_replace', 0);
  const config: ModelConfig = {
    modelType,
    vocabSize: r.int('vocab_size', 2),
    hiddenSize: r.int('hidden_size'),
    intermediateSize: r.int('intermediate_size'),
    moeIntermediateSize: r.int('moe_intermediate_size'),
    numLayers,
    numHeads,
    qLoraRank: r.optionalInt('q_lora_rank'),
    kvLoraRank: r.int('kv_lora_rank'),
    qkNopeDim: r.int('qk_nope_head_dim', 0),
    qkRopeDim,
    vHeadDim: r.int('v_head_dim'),
    nRoutedExperts,
    nSharedExperts: r.int('n_shared_experts', 0),
    numExpertsPerTok,
    firstKDenseReplace: Math.min(firstKDenseReplace, numLayers),
    moeLayerFreq: moeLayerFreq(r),
    nGroup,
    topkGroup,
    normTopkProb: r.bool('norm_topk_prob'),
    routedScalingFactor: r.num('routed_scaling_factor', { positive: true }),
    rmsNormEps: r.num('rms_norm_eps', { positive: true }),
    mlaNormEps: MLA_NORM_EPS,
    rope: parseRope(r),
    ropeInterleave: r.bool('rope_interleave'),
    maxPositionEmbeddings,
    tieWordEmbeddings: typeof json.tie_word_embeddings === 'boolean' && prefix ? json.tie_word_embeddings : r.bool('tie_word_embeddings'),
    eosTokenIds: eosIds(r).length ? eosIds(r) : eosIds(new Reader(json, source, '')),
    weightPrefix,
  };
  return config;
}

/** Whether layer `i` has a mixture-of-experts MLP (transformers: i >= first_k_dense_replace). */
export function isMoeLayer(config: ModelConfig, layer: number): boolean {
  return layer >= config.firstKDenseReplace;
}

export function qkHeadDim(config: ModelConfig): number {
  return config.qkNopeDim + config.qkRopeDim;
}
