/**
 * The config of a DFlash drafter (z-lab's DFlashDraftModel: Qwen3 decoder layers over the
 * target's hidden states), read from its config.json, and the check that it fits a target.
 *
 * Spellings seen in public checkpoints: `block_size` at the top level (the first revisions) or
 * inside `dflash_config` (newer ones); `dflash_config.{target_layer_ids, mask_token_id}`; RoPE as
 * `rope_theta` + `rope_scaling` or transformers 5's `rope_parameters`; `layer_types` with
 * `sliding_window`, or `use_sliding_window` + `max_window_layers` from which transformers'
 * Qwen3Config derives them. Absent fields take Qwen3Config's defaults.
 */
import { isObject, parseRope, Reader, type ModelConfig, type RopeConfig } from './config.js';
import { ConfigError, PairingError } from './errors.js';

export const DFLASH_ARCHITECTURE = 'DFlashDraftModel';

export type DflashLayerType = 'full_attention' | 'sliding_attention';

export interface DflashConfig {
  vocabSize: number;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  rmsNormEps: number;
  rope: RopeConfig;
  maxPositionEmbeddings: number;
  /** Tokens per drafted block: the bonus token and block_size - 1 masks (depths 1..block_size - 1). */
  blockSize: number;
  /** Target layers whose outputs form the context (hidden-state index = id + 1; 0 is the embeddings). */
  targetLayerIds: number[];
  /** The target's layer count the drafter was trained with (null when the config does not say). */
  numTargetLayers: number | null;
  maskTokenId: number;
  layerTypes: DflashLayerType[];
  /** Window of the sliding layers (null: none is sliding). */
  slidingWindow: number | null;
}

/** transformers' Qwen3Config defaults (what an absent field means). */
const QWEN3_DEFAULTS = {
  vocab_size: 151936,
  hidden_size: 4096,
  intermediate_size: 22016,
  num_hidden_layers: 32,
  num_attention_heads: 32,
  rms_norm_eps: 1e-6,
  rope_theta: 10000,
  max_position_embeddings: 32768,
  max_window_layers: 28,
};

/** transformers' build_target_layer_ids, the drafter's fallback when the config lists no layers. */
export function defaultTargetLayerIds(numTargetLayers: number, numDraftLayers: number): number[] {
  if (numDraftLayers === 1) return [Math.floor(numTargetLayers / 2)];
  const start = 1;
  const span = numTargetLayers - 3 - start;
  // Python's round() rounds half to even
  const round = (x: number) => {
    const f = Math.floor(x);
    const d = x - f;
    return d > 0.5 || (d === 0.5 && f % 2 === 1) ? f + 1 : f;
  };
  return Array.from({ length: numDraftLayers }, (_, i) => round(start + (i * span) / (numDraftLayers - 1)));
}

/** Whether a parsed config.json is a DFlash drafter's (architectures names DFlashDraftModel). */
export function isDflashConfig(json: unknown): boolean {
  return isObject(json) && Array.isArray(json.architectures) && json.architectures.includes(DFLASH_ARCHITECTURE);
}

function intList(r: Reader, field: string, value: unknown): number[] {
  if (!Array.isArray(value) || value.length === 0 || !value.every((v) => Number.isInteger(v) && v >= 0)) {
    r.fail(field, `expected a non-empty list of layer indices >= 0, got ${JSON.stringify(value)?.slice(0, 80)}`);
  }
  return value as number[];
}

function layerTypes(r: Reader, json: Record<string, unknown>, numLayers: number): { types: DflashLayerType[]; window: number | null } {
  const useSliding = json.use_sliding_window;
  let window: number | null = null;
  const raw = json.sliding_window;
  if (raw !== undefined && raw !== null) {
    if (!Number.isInteger(raw) || (raw as number) < 1) r.fail('sliding_window', `expected a positive integer or null, got ${JSON.stringify(raw)}`);
    window = raw as number;
  }
  // Qwen3Config: sliding_window applies only with use_sliding_window (when that field is given)
  if (useSliding === false) window = null;
  const given = json.layer_types;
  let types: DflashLayerType[];
  if (given === undefined || given === null) {
    const first = r.int('max_window_layers', 0);
    types = Array.from({ length: numLayers }, (_, i) => (window !== null && i >= first ? 'sliding_attention' : 'full_attention'));
  } else {
    if (!Array.isArray(given) || given.length !== numLayers) r.fail('layer_types', `expected a list of ${numLayers} layer types (one per layer), got ${JSON.stringify(given)?.slice(0, 80)}`);
    for (const [i, t] of (given as unknown[]).entries()) {
      if (t !== 'full_attention' && t !== 'sliding_attention') r.fail(`layer_types[${i}]`, `expected "full_attention" or "sliding_attention", got ${JSON.stringify(t)}`);
    }
    types = given as DflashLayerType[];
  }
  // a sliding layer without a window attends to everything (transformers: sliding_window None)
  if (window === null) types = types.map(() => 'full_attention');
  return { types, window: types.includes('sliding_attention') ? window : null };
}

/** Parses and validates a DFlash drafter's config.json object. `source` names it in errors. */
export function parseDflashConfig(json: unknown, source = 'config.json'): DflashConfig {
  if (!isObject(json)) throw new ConfigError('expected a JSON object', '(root)', source);
  const r = new Reader(json, source, '', QWEN3_DEFAULTS);
  if (!isDflashConfig(json)) r.fail('architectures', `expected a DFlash drafter (["${DFLASH_ARCHITECTURE}"]), got ${JSON.stringify(json.architectures)}`);
  const modelType = json.model_type ?? 'qwen3';
  if (modelType !== 'qwen3') r.fail('model_type', `DFlash drafters are Qwen3 decoder layers ("qwen3"), got ${JSON.stringify(modelType)}`);
  const act = json.hidden_act ?? 'silu';
  if (act !== 'silu') r.fail('hidden_act', `only silu is supported, got ${JSON.stringify(act)}`);
  if (json.attention_bias === true) r.fail('attention_bias', 'attention biases are not supported (DFlash drafters have none)');
  const rawDflash = json.dflash_config ?? {};
  if (!isObject(rawDflash)) r.fail('dflash_config', `expected an object, got ${JSON.stringify(rawDflash)}`);
  const dflash = rawDflash as Record<string, unknown>;

  const hiddenSize = r.int('hidden_size');
  const numHeads = r.int('num_attention_heads');
  const numKvHeads = json.num_key_value_heads === undefined || json.num_key_value_heads === null ? numHeads : r.int('num_key_value_heads');
  if (numHeads % numKvHeads !== 0) r.fail('num_key_value_heads', `num_attention_heads (${numHeads}) must be a multiple of num_key_value_heads (${numKvHeads})`);
  if (json.head_dim === undefined && hiddenSize % numHeads !== 0) r.fail('head_dim', `absent, and hidden_size (${hiddenSize}) is not a multiple of num_attention_heads (${numHeads})`);
  const headDim = json.head_dim === undefined || json.head_dim === null ? hiddenSize / numHeads : r.int('head_dim', 2);
  if (headDim % 2 !== 0) r.fail('head_dim', `must be even (RoPE rotates pairs), got ${headDim}`);
  const partial = json.partial_rotary_factor ?? 1;
  if (partial !== 1) r.fail('partial_rotary_factor', `only 1 (the whole head rotated) is supported, got ${JSON.stringify(partial)}`);
  const vocabSize = r.int('vocab_size', 2);
  const numLayers = r.int('num_hidden_layers');

  const top = json.block_size;
  const nested = dflash.block_size;
  if (top !== undefined && nested !== undefined && top !== nested) r.fail('block_size', `${JSON.stringify(top)} differs from dflash_config.block_size ${JSON.stringify(nested)}`);
  if (top === undefined && nested === undefined) r.fail('block_size', 'missing (neither block_size nor dflash_config.block_size is set)');
  const blockSize = top !== undefined ? r.int('block_size', 2) : new Reader(dflash, source, 'dflash_config.', {}).int('block_size', 2);

  const numTargetLayers = json.num_target_layers === undefined || json.num_target_layers === null ? null : r.int('num_target_layers');
  const targetLayerIds =
    dflash.target_layer_ids !== undefined
      ? intList(r, 'dflash_config.target_layer_ids', dflash.target_layer_ids)
      : json.target_layer_ids !== undefined
        ? intList(r, 'target_layer_ids', json.target_layer_ids)
        : numTargetLayers !== null
          ? defaultTargetLayerIds(numTargetLayers, numLayers)
          : r.fail('dflash_config.target_layer_ids', 'missing, and so is num_target_layers (from which the default layers are derived)');
  if (numTargetLayers !== null) {
    const bad = targetLayerIds.find((id) => id >= numTargetLayers);
    if (bad !== undefined) r.fail('dflash_config.target_layer_ids', `layer ${bad} is outside the ${numTargetLayers} target layers (num_target_layers)`);
  }

  const maskRaw = dflash.mask_token_id ?? json.mask_token_id;
  if (maskRaw === undefined || maskRaw === null) r.fail('dflash_config.mask_token_id', 'missing (the token that fills the block after the bonus token)');
  if (!Number.isInteger(maskRaw) || (maskRaw as number) < 0 || (maskRaw as number) >= vocabSize) {
    r.fail('dflash_config.mask_token_id', `expected a token id in [0, ${vocabSize}), got ${JSON.stringify(maskRaw)}`);
  }
  const maxPositionEmbeddings = r.int('max_position_embeddings');
  // A draft puts the whole block at positions past the context: a block longer than the drafter's
  // RoPE table could never be drafted.
  if (blockSize > maxPositionEmbeddings) r.fail('block_size', `${blockSize} is past max_position_embeddings (${maxPositionEmbeddings}): a block must fit the drafter's positions`);
  const { types, window } = layerTypes(r, json, numLayers);
  return {
    vocabSize,
    hiddenSize,
    intermediateSize: r.int('intermediate_size'),
    numLayers,
    numHeads,
    numKvHeads,
    headDim,
    rmsNormEps: r.num('rms_norm_eps', { positive: true }),
    rope: parseRope(r),
    maxPositionEmbeddings,
    blockSize,
    targetLayerIds,
    numTargetLayers,
    maskTokenId: maskRaw as number,
    layerTypes: types,
    slidingWindow: window,
  };
}

/** What the pairing check needs of a target (a ModelConfig has it). */
export type DflashTarget = Pick<ModelConfig, 'hiddenSize' | 'vocabSize' | 'numLayers'>;

/**
 * Throws a PairingError listing every way `drafter` does not fit `target`: the drafter reads the
 * target's hidden states (hidden_size), embeds with its embed_tokens and projects with its lm_head
 * (vocab_size), and taps layers that must exist (target_layer_ids, num_target_layers).
 */
export function checkDflashPairing(drafter: DflashConfig, target: DflashTarget, names: { drafter?: string; target?: string } = {}): void {
  const problems: string[] = [];
  if (drafter.hiddenSize !== target.hiddenSize) problems.push(`hidden_size ${drafter.hiddenSize} != the target's ${target.hiddenSize} (the drafter reads the target's hidden states)`);
  if (drafter.vocabSize !== target.vocabSize) problems.push(`vocab_size ${drafter.vocabSize} != the target's ${target.vocabSize} (the drafter uses the target's embed_tokens and lm_head)`);
  if (drafter.maskTokenId >= target.vocabSize) problems.push(`mask_token_id ${drafter.maskTokenId} is outside the target's vocabulary of ${target.vocabSize}`);
  const outside = drafter.targetLayerIds.filter((id) => id >= target.numLayers);
  if (outside.length > 0) problems.push(`target_layer_ids ${JSON.stringify(outside)} are outside the target's ${target.numLayers} layers`);
  if (drafter.numTargetLayers !== null && drafter.numTargetLayers !== target.numLayers) problems.push(`num_target_layers ${drafter.numTargetLayers} != the target's ${target.numLayers} layers (it was trained for another target)`);
  if (problems.length > 0) throw new PairingError(problems, names.drafter ?? 'the drafter', names.target ?? 'the target');
}
