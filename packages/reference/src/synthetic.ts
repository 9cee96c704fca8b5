/**
 * Synthetic DeepSeek-V3 / Kimi K2-shaped models for tests, demos and kernel checks: seeded random
 * weights (bf16-representable, scaled so activations stay O(1) and greedy decoding has clear
 * margins), a KDTR bundle with config, golden tokens and golden logits, optionally INT4, and
 * optionally a correlated draft model (target = draft + noise) for speculative decoding.
 */
import { f32ArrayToBf16, bf16ArrayToF32, KdtrWriter } from '@kdtree/format';
import { checkInt4Shape, dequantizeInt4, newQuantizationMetadata, presetRules, qwName, scName, selectTensors, quantizeInt4, type GroupSize, type Int4Matrix, type PresetName } from '@kdtree/quant';
import { parseModelConfig, type ModelConfig } from './config.js';
import { ReferenceUsageError } from './errors.js';
import { greedyDecode, teacherForcedLogits } from './generate.js';
import { ReferenceModel } from './model.js';
import { loadWeights, weightSpecs, type WeightSpec } from './weights.js';

/** HF config.json bodies of the presets (model_type kimi_k2, DeepseekV3ForCausalLM layout). */
export const MODEL_PRESETS = {
  /** CI-fast: 2 layers (dense + MoE), 8 experts, top-2, q_lora, YaRN. */
  tiny: {
    vocab_size: 128, hidden_size: 64, intermediate_size: 128, moe_intermediate_size: 32, num_hidden_layers: 2, first_k_dense_replace: 1,
    num_attention_heads: 2, q_lora_rank: 32, kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16,
    n_routed_experts: 8, num_experts_per_tok: 2, n_shared_experts: 1,
    rope: { factor: 4, original_max_position_embeddings: 128 },
  },
  /** A few seconds per generation: 4 layers, 16 experts, top-4. */
  small: {
    vocab_size: 512, hidden_size: 256, intermediate_size: 512, moe_intermediate_size: 64, num_hidden_layers: 4, first_k_dense_replace: 1,
    num_attention_heads: 4, q_lora_rank: 128, kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32,
    n_routed_experts: 16, num_experts_per_tok: 4, n_shared_experts: 1,
    rope: { factor: 8, original_max_position_embeddings: 256 },
  },
  /**
   * Kimi K2's ratios, shrunk: hidden 7168 / 16 = 448, 64 / 16 = 4 heads, q_lora 1536 / 16 = 96,
   * kv_lora 512 / 16 = 32, head dims 128/64/128 / 4, moe_intermediate = hidden x 2048/7168,
   * intermediate = hidden x 18432/7168, top-8 of 64 experts + 1 shared, first layer dense, YaRN
   * factor 64 over 4096 / 64 original positions, routed_scaling_factor 2.827.
   */
  'k2-mini': {
    vocab_size: 8192, hidden_size: 448, intermediate_size: 1152, moe_intermediate_size: 128, num_hidden_layers: 4, first_k_dense_replace: 1,
    num_attention_heads: 4, q_lora_rank: 96, kv_lora_rank: 32, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32,
    n_routed_experts: 64, num_experts_per_tok: 8, n_shared_experts: 1,
    rope: { factor: 64, original_max_position_embeddings: 64 },
  },
  /**
   * Tensor parallelism up to 8 ranks, CI-fast: 8 heads, a vocabulary of 8 x 32, and every MLP's
   * intermediate size 8 x 32, so each rank keeps one whole INT4 group of 32 of every down_proj.
   */
  tp8: {
    vocab_size: 256, hidden_size: 64, intermediate_size: 256, moe_intermediate_size: 256, num_hidden_layers: 2, first_k_dense_replace: 1,
    num_attention_heads: 8, q_lora_rank: 32, kv_lora_rank: 32, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8,
    n_routed_experts: 4, num_experts_per_tok: 2, n_shared_experts: 1,
    rope: { factor: 4, original_max_position_embeddings: 128 },
  },
} as const;

export type ModelPreset = keyof typeof MODEL_PRESETS;
export const MODEL_PRESET_NAMES = Object.keys(MODEL_PRESETS) as ModelPreset[];

/** The fixed prompt of every golden record. */
export const GOLDEN_PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];
export const GOLDEN_MAX_NEW = 16;

export function presetConfigJson(preset: ModelPreset): Record<string, unknown> {
  const p = MODEL_PRESETS[preset];
  if (p === undefined) throw new ReferenceUsageError(`unknown preset '${String(preset)}' (presets: ${MODEL_PRESET_NAMES.join(', ')})`);
  const { rope, ...rest } = p;
  return {
    architectures: ['DeepseekV3ForCausalLM'],
    model_type: 'kimi_k2',
    ...rest,
    num_key_value_heads: p.num_attention_heads,
    n_group: 1,
    topk_group: 1,
    norm_topk_prob: true,
    routed_scaling_factor: 2.827,
    scoring_func: 'sigmoid',
    topk_method: 'noaux_tc',
    hidden_act: 'silu',
    rms_norm_eps: 1e-5,
    rope_theta: 50000,
    max_position_embeddings: rope.factor * rope.original_max_position_embeddings,
    rope_scaling: { type: 'yarn', factor: rope.factor, original_max_position_embeddings: rope.original_max_position_embeddings, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1 },
    tie_word_embeddings: false,
    bos_token_id: 0,
    eos_token_id: null,
    torch_dtype: 'bfloat16',
  };
}

/**
 * `n` token ids below `vocab` from a 32-bit LCG (x = 1103515245 x + 12345 mod 2^32) seeded with
 * `seed`: the engine benchmark's prompts, which the recorded outputs its policy tests replay were
 * decoded from, so every caller must draw the same ids.
 */
export function lcgTokens(n: number, seed: number, vocab: number): number[] {
  let x = seed >>> 0;
  return Array.from({ length: n }, () => (x = (Math.imul(x, 1103515245) + 12345) >>> 0) % vocab);
}

/**
 * A deterministic generator that uses only integer and IEEE add/multiply operations (no
 * Math.log/cos, whose last bits may differ between engines), so a seed gives the same weights
 * everywhere: xorshift128+ uniforms; normals by the sum of 12 uniforms minus 6.
 */
export class SeededRandom {
  private s0: number;
  private s1: number;
  private s2: number;
  private s3: number;

  constructor(seed: number) {
    let x = (seed >>> 0) ^ 0x9e3779b9;
    const next = () => {
      x = (x + 0x6d2b79f5) >>> 0;
      let z = x;
      z = Math.imul(z ^ (z >>> 15), z | 1);
      z ^= z + Math.imul(z ^ (z >>> 7), z | 61);
      return (z ^ (z >>> 14)) >>> 0;
    };
    this.s0 = next();
    this.s1 = next();
    this.s2 = next();
    this.s3 = next() || 1;
  }

  /** Uniform in [0, 1). xoshiro128+ */
  uniform(): number {
    const result = (this.s0 + this.s3) >>> 0;
    const t = this.s1 << 9;
    this.s2 ^= this.s0;
    this.s3 ^= this.s1;
    this.s1 ^= this.s2;
    this.s0 ^= this.s3;
    this.s2 ^= t;
    this.s3 = (this.s3 << 11) | (this.s3 >>> 21);
    return result / 4294967296;
  }

  normal(): number {
    let s = 0;
    for (let i = 0; i < 12; i++) s += this.uniform();
    return s - 6;
  }
}

/** Rounds to bf16-representable values (what a bf16 checkpoint can hold). */
export function toBf16Values(x: Float32Array): Float32Array {
  return bf16ArrayToF32(f32ArrayToBf16(x));
}

/** How each tensor is initialized: scale of a standard normal, plus an offset. */
function initFor(spec: WeightSpec): { scale: number; offset: number; uniform?: boolean } {
  const n = spec.name;
  if (n.endsWith('embed_tokens.weight')) return { scale: 1, offset: 0 };
  if (n.endsWith('layernorm.weight') || n.endsWith('norm.weight')) return { scale: 0.1, offset: 1 };
  if (n.endsWith('e_score_correction_bias')) return { scale: 0.15, offset: 0, uniform: true };
  const fanIn = spec.shape[1];
  if (n === 'lm_head.weight') return { scale: 4 / Math.sqrt(fanIn), offset: 0 };
  if (n.endsWith('mlp.gate.weight')) return { scale: 2 / Math.sqrt(fanIn), offset: 0 };
  return { scale: 1 / Math.sqrt(fanIn), offset: 0 };
}

/** Seeded random weights for a config, bf16-representable, by canonical tensor name. */
export function randomWeights(config: ModelConfig, seed: number): Map<string, Float32Array> {
  const rng = new SeededRandom(seed);
  const out = new Map<string, Float32Array>();
  for (const spec of weightSpecs(config)) {
    const { scale, offset, uniform } = initFor(spec);
    const n = spec.shape.reduce((a, b) => a * b, 1);
    const x = new Float32Array(n);
    for (let i = 0; i < n; i++) x[i] = offset + scale * (uniform ? rng.uniform() : rng.normal());
    out.set(spec.name, toBf16Values(x));
  }
  return out;
}

/**
 * target = base + noise x N(0, std of each tensor): a model correlated with `base`. Tensors named
 * in `keep` stay as they are.
 */
export function perturbWeights(base: Map<string, Float32Array>, noise: number, seed: number, keep: ReadonlySet<string> = new Set()): Map<string, Float32Array> {
  const rng = new SeededRandom(seed);
  const out = new Map<string, Float32Array>();
  for (const [name, w] of base) {
    if (keep.has(name)) {
      out.set(name, w);
      continue;
    }
    let ss = 0;
    for (const v of w) ss += v * v;
    const std = Math.sqrt(ss / Math.max(1, w.length));
    const x = new Float32Array(w.length);
    for (let i = 0; i < w.length; i++) x[i] = w[i] + noise * std * rng.normal();
    out.set(name, toBf16Values(x));
  }
  return out;
}

export async function modelFromWeights(config: ModelConfig, weights: Map<string, Float32Array>): Promise<ReferenceModel> {
  return new ReferenceModel(config, await loadWeights(config, async (name) => weights.get(name)!));
}

/**
 * The tensors a quantization preset selects in this config, after checking each one's K divides
 * into groups of 32 and words of 8 (a clear error naming the tensor otherwise).
 */
export function checkQuantizable(config: ModelConfig, quant: PresetName, groupSize: GroupSize = 32): Map<string, GroupSize> {
  const specs = weightSpecs(config);
  const { selected } = selectTensors(specs, presetRules(quant, groupSize));
  for (const name of selected.keys()) {
    const [rows, cols] = specs.find((s) => s.name === name)!.shape;
    checkInt4Shape(rows, cols, groupSize, name);
  }
  return selected;
}

export interface GoldenRecord {
  prompt: number[];
  tokens: number[];
  max_new: number;
  /** What the tokens were computed from. */
  computed_on: string;
  /** For INT4 bundles: the greedy tokens of the float weights before quantization. */
  float_tokens?: number[];
  reference: string;
}

export interface SyntheticModelOptions {
  preset: ModelPreset;
  seed: number;
  /** Quantize with this selection preset (minmax, group 32, bf16 scales). */
  quant?: PresetName;
  /** Weights to write instead of fresh random ones (a draft's target). */
  weights?: Map<string, Float32Array>;
  /** What the weights are, for the provenance record (default 'random'; 'walk': walkWeights). */
  structure?: 'random' | 'walk';
  /**
   * More metadata entries for the bundle (a tokenizer, say): written beside `config`, `golden`,
   * `provenance` and `quantization`, whose keys they may not take.
   */
  extraMetadata?: Readonly<Record<string, unknown>>;
  onProgress?: (step: string) => void;
}

/** The metadata keys writeSyntheticModel writes itself. */
const OWN_METADATA_KEYS = ['config', 'golden', 'provenance', 'quantization'];

/**
 * Writes a synthetic model bundle: config, weights (BF16, or INT4 .qw/.sc for the selected
 * tensors), golden greedy tokens for GOLDEN_PROMPT and golden teacher-forced logits
 * (`golden.logits`, F32 [prompt + new, vocab]). Returns the golden record.
 */
export async function writeSyntheticModel(path: string, options: SyntheticModelOptions, referenceVersion: string): Promise<GoldenRecord> {
  const extra = options.extraMetadata ?? {};
  const taken = Object.keys(extra).filter((k) => OWN_METADATA_KEYS.includes(k));
  if (taken.length > 0) throw new ReferenceUsageError(`extraMetadata: key '${taken[0]}' is written by writeSyntheticModel itself (its own keys: ${OWN_METADATA_KEYS.join(', ')})`);
  const configJson = presetConfigJson(options.preset);
  const config = parseModelConfig(configJson, `preset ${options.preset}`);
  const weights = options.weights ?? randomWeights(config, options.seed);
  const specs = weightSpecs(config);
  const progress = options.onProgress ?? (() => {});
  const quantized = new Map<string, Int4Matrix>();
  let effective = weights;
  if (options.quant !== undefined) {
    progress(`quantizing (${options.quant})`);
    const selected = checkQuantizable(config, options.quant);
    effective = new Map(weights);
    for (const [name, groupSize] of selected) {
      const [rows, cols] = specs.find((s) => s.name === name)!.shape;
      const m = quantizeInt4(weights.get(name)!, rows, cols, { groupSize, rule: 'minmax', scaleDtype: 'BF16', name });
      quantized.set(name, m);
      effective.set(name, dequantizeInt4(m));
    }
  }
  progress('golden decoding');
  const model = await modelFromWeights(config, effective);
  const { tokens } = greedyDecode(model, GOLDEN_PROMPT, { maxNew: GOLDEN_MAX_NEW, eos: [] });
  const golden: GoldenRecord = {
    prompt: GOLDEN_PROMPT,
    tokens,
    max_new: GOLDEN_MAX_NEW,
    computed_on: options.quant ? 'dequantized INT4 weights (w = q * scale), as stored' : 'the bf16 weights, as stored',
    reference: referenceVersion,
  };
  if (options.quant) golden.float_tokens = greedyDecode(await modelFromWeights(config, weights), GOLDEN_PROMPT, { maxNew: GOLDEN_MAX_NEW, eos: [] }).tokens;
  const logits = teacherForcedLogits(model, [...GOLDEN_PROMPT, ...tokens]);
  progress('writing');
  const quantization = newQuantizationMetadata({ preset: options.quant });
  const writer = await KdtrWriter.create(path, {
    metadata: {
      config: configJson,
      golden,
      provenance: { tool: `kdtree gen-model (${referenceVersion})`, preset: options.preset, seed: options.seed, structure: options.structure ?? 'random', created: new Date().toISOString() },
      ...extra,
    },
  });
  try {
    for (const spec of specs) {
      const m = quantized.get(spec.name);
      if (m === undefined) {
        await writer.add({ name: spec.name, dtype: 'BF16', shape: spec.shape }, f32ArrayToBf16(weights.get(spec.name)!));
        continue;
      }
      await writer.add({ name: qwName(spec.name), dtype: 'I32', shape: [m.rows, m.cols / 8] }, m.packed);
      await writer.add({ name: scName(spec.name), dtype: 'BF16', shape: [m.rows, m.cols / m.groupSize] }, m.scales);
      quantization.tensors[spec.name] = { shape: [m.rows, m.cols], group_size: m.groupSize, scale_dtype: 'BF16', scheme: 'minmax', qw: qwName(spec.name), sc: scName(spec.name) };
    }
    await writer.add({ name: 'golden.logits', dtype: 'F32', shape: [GOLDEN_PROMPT.length + tokens.length, config.vocabSize] }, logits);
    if (quantized.size > 0) writer.metadata = { ...writer.metadata, quantization };
    await writer.close();
  } catch (error) {
    await writer.abort();
    throw error;
  }
  return golden;
}
