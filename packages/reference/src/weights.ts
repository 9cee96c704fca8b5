/**
 * The weights of a DeepSeek-V3 / Kimi K2 model, as f32 arrays with their shapes, loaded from any
 * tensor store (KDTR bundle, safetensors checkpoint, HF directory). INT4 weights (`.qw`/`.sc`)
 * are dequantized exactly (w = q * scale). Names follow the HF checkpoints (per-expert tensors).
 */
import type { TensorStore } from '@kdtree/format';
import { readWeightF32, validateQuantizedStore, type QuantizationMetadata } from '@kdtree/quant';
import { isMoeLayer, qkHeadDim, type ModelConfig } from './config.js';
import { WeightError } from './errors.js';

/** An nn.Linear weight: [out, in], row-major. */
export interface Linear {
  w: Float32Array;
  out: number;
  in: number;
}

export interface MlpWeights {
  gate: Linear;
  up: Linear;
  down: Linear;
}

export interface AttentionWeights {
  /** With q_lora_rank: q = q_b(norm(q_a(x))). */
  qA?: Linear;
  qANorm?: Float32Array;
  qB?: Linear;
  /** Without q_lora_rank: q = q_proj(x). */
  q?: Linear;
  /** [kv_lora_rank + qk_rope_head_dim, hidden] */
  kvA: Linear;
  kvANorm: Float32Array;
  /** [heads * (qk_nope + v_head), kv_lora_rank] */
  kvB: Linear;
  /** [hidden, heads * v_head] */
  o: Linear;
}

export interface MoeWeights {
  /** Router weight [n_routed_experts, hidden]. */
  router: Float32Array;
  /** e_score_correction_bias [n_routed_experts]: used to choose experts, not to weight them. */
  bias: Float32Array;
  experts: MlpWeights[];
  shared?: MlpWeights;
}

export interface LayerWeights {
  inputNorm: Float32Array;
  postNorm: Float32Array;
  attn: AttentionWeights;
  mlp: { kind: 'dense'; dense: MlpWeights } | { kind: 'moe'; moe: MoeWeights };
}

export interface ModelWeights {
  /** [vocab, hidden] */
  embed: Float32Array;
  layers: LayerWeights[];
  /** [hidden] */
  norm: Float32Array;
  /** [vocab, hidden] (the embedding when tie_word_embeddings) */
  lmHead: Float32Array;
}

export interface WeightSpec {
  name: string;
  shape: number[];
}

/** Every tensor a model of this config has, with its shape (names without the wrapper prefix). */
export function weightSpecs(config: ModelConfig): WeightSpec[] {
  const H = config.hiddenSize;
  const nh = config.numHeads;
  const specs: WeightSpec[] = [{ name: 'model.embed_tokens.weight', shape: [config.vocabSize, H] }];
  const mlp = (p: string, inter: number) => [
    { name: `${p}gate_proj.weight`, shape: [inter, H] },
    { name: `${p}up_proj.weight`, shape: [inter, H] },
    { name: `${p}down_proj.weight`, shape: [H, inter] },
  ];
  for (let l = 0; l < config.numLayers; l++) {
    const p = `model.layers.${l}.`;
    specs.push({ name: `${p}input_layernorm.weight`, shape: [H] }, { name: `${p}post_attention_layernorm.weight`, shape: [H] });
    const a = `${p}self_attn.`;
    if (config.qLoraRank === null) specs.push({ name: `${a}q_proj.weight`, shape: [nh * qkHeadDim(config), H] });
    else {
      specs.push(
        { name: `${a}q_a_proj.weight`, shape: [config.qLoraRank, H] },
        { name: `${a}q_a_layernorm.weight`, shape: [config.qLoraRank] },
        { name: `${a}q_b_proj.weight`, shape: [nh * qkHeadDim(config), config.qLoraRank] },
      );
    }
    specs.push(
      { name: `${a}kv_a_proj_with_mqa.weight`, shape: [config.kvLoraRank + config.qkRopeDim, H] },
      { name: `${a}kv_a_layernorm.weight`, shape: [config.kvLoraRank] },
      { name: `${a}kv_b_proj.weight`, shape: [nh * (config.qkNopeDim + config.vHeadDim), config.kvLoraRank] },
      { name: `${a}o_proj.weight`, shape: [H, nh * config.vHeadDim] },
    );
    if (!isMoeLayer(config, l)) {
      specs.push(...mlp(`${p}mlp.`, config.intermediateSize));
    } else {
      specs.push({ name: `${p}mlp.gate.weight`, shape: [config.nRoutedExperts, H] }, { name: `${p}mlp.gate.e_score_correction_bias`, shape: [config.nRoutedExperts] });
      for (let e = 0; e < config.nRoutedExperts; e++) specs.push(...mlp(`${p}mlp.experts.${e}.`, config.moeIntermediateSize));
      if (config.nSharedExperts > 0) specs.push(...mlp(`${p}mlp.shared_experts.`, config.moeIntermediateSize * config.nSharedExperts));
    }
  }
  specs.push({ name: 'model.norm.weight', shape: [H] });
  if (!config.tieWordEmbeddings) specs.push({ name: 'lm_head.weight', shape: [config.vocabSize, H] });
  return specs;
}

/** A source of f32 weights by canonical name (a store, or arrays in memory). */
export type WeightSource = (name: string, shape: number[]) => Promise<Float32Array>;

/**
 * Reads weights from a tensor store, dequantizing INT4 ones, checking every shape. `quantization`
 * describes INT4 weights the store's own metadata does not (a compressed-tensors checkpoint read
 * in place).
 */
export function storeWeightSource(store: TensorStore, config: ModelConfig, quantization?: QuantizationMetadata): WeightSource {
  // The store's own INT4 parts are checked as a whole before any is read: a descriptor without its
  // parts, or a .qw/.sc tensor without a descriptor, is an error even if this model never reads it.
  const meta = quantization ?? validateQuantizedStore(store);
  const prefix = config.weightPrefix || (store.has(`language_model.model.embed_tokens.weight`) ? 'language_model.' : '');
  return async (name, shape) => {
    const full = prefix + name;
    if (!store.has(full) && meta?.tensors[full] === undefined) {
      throw new WeightError(`missing (config ${config.modelType} with ${config.numLayers} layers, ${config.nRoutedExperts} experts needs it)`, full, store.path);
    }
    return readShapedF32(store, full, shape, meta, 'the config');
  };
}

/** Reads `name` as f32 (INT4 dequantized), after checking its shape is `shape`, which `needs` wants. */
export async function readShapedF32(store: TensorStore, name: string, shape: readonly number[], meta: QuantizationMetadata | undefined, needs: string): Promise<Float32Array> {
  const { data, shape: actual } = await readWeightF32(store, name, meta);
  if (actual.length !== shape.length || actual.some((d, i) => d !== shape[i])) {
    throw new WeightError(`has shape [${actual.join(', ')}], ${needs} needs [${shape.join(', ')}]`, name, store.path);
  }
  return data;
}

/** Readers over `specs`: each tensor through `source` with its spec's shape, as an array, a Linear or an MLP. */
export function specReader(specs: readonly WeightSpec[], source: WeightSource) {
  const shapes = new Map(specs.map((s) => [s.name, s.shape]));
  const get = (name: string) => source(name, shapes.get(name)!);
  const linear = async (name: string): Promise<Linear> => {
    const [out, inDim] = shapes.get(name)!;
    return { w: await get(name), out, in: inDim };
  };
  const mlp = async (p: string): Promise<MlpWeights> => ({ gate: await linear(`${p}gate_proj.weight`), up: await linear(`${p}up_proj.weight`), down: await linear(`${p}down_proj.weight`) });
  return { get, linear, mlp };
}

/** Loads every weight of the model through `source`. */
export async function loadWeights(config: ModelConfig, source: WeightSource): Promise<ModelWeights> {
  const { get, linear, mlp } = specReader(weightSpecs(config), source);
  const layers: LayerWeights[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    const p = `model.layers.${l}.`;
    const a = `${p}self_attn.`;
    const attn: AttentionWeights =
      config.qLoraRank === null
        ? { q: await linear(`${a}q_proj.weight`), kvA: await linear(`${a}kv_a_proj_with_mqa.weight`), kvANorm: await get(`${a}kv_a_layernorm.weight`), kvB: await linear(`${a}kv_b_proj.weight`), o: await linear(`${a}o_proj.weight`) }
        : {
            qA: await linear(`${a}q_a_proj.weight`),
            qANorm: await get(`${a}q_a_layernorm.weight`),
            qB: await linear(`${a}q_b_proj.weight`),
            kvA: await linear(`${a}kv_a_proj_with_mqa.weight`),
            kvANorm: await get(`${a}kv_a_layernorm.weight`),
            kvB: await linear(`${a}kv_b_proj.weight`),
            o: await linear(`${a}o_proj.weight`),
          };
    let block: LayerWeights['mlp'];
    if (!isMoeLayer(config, l)) block = { kind: 'dense', dense: await mlp(`${p}mlp.`) };
    else {
      const experts: MlpWeights[] = [];
      for (let e = 0; e < config.nRoutedExperts; e++) experts.push(await mlp(`${p}mlp.experts.${e}.`));
      block = {
        kind: 'moe',
        moe: {
          router: await get(`${p}mlp.gate.weight`),
          bias: await get(`${p}mlp.gate.e_score_correction_bias`),
          experts,
          shared: config.nSharedExperts > 0 ? await mlp(`${p}mlp.shared_experts.`) : undefined,
        },
      };
    }
    layers.push({ inputNorm: await get(`${p}input_layernorm.weight`), postNorm: await get(`${p}post_attention_layernorm.weight`), attn, mlp: block });
  }
  const embed = await get('model.embed_tokens.weight');
  return { embed, layers, norm: await get('model.norm.weight'), lmHead: config.tieWordEmbeddings ? embed : await get('lm_head.weight') };
}
