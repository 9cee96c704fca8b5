/**
 * Synthetic DFlash drafters for tests and demos: a config.json body fitted to a target, seeded
 * random weights (bf16-representable, scaled so activations stay O(1)), and a HuggingFace-style
 * directory (config.json + model.safetensors, the public checkpoints' tensor names).
 */
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { bf16ArrayToF32, f32ArrayToBf16, makeDirectories, writeSafetensors } from '@kdtree/format';
import type { ModelConfig } from './config.js';
import { DFLASH_ARCHITECTURE, parseDflashConfig, type DflashConfig } from './dflash-config.js';
import { DflashModel, dflashWeightSpecs, loadDflashWeights, type DflashTargetWeights } from './dflash.js';
import { SeededRandom } from './synthetic.js';

export interface DflashShape {
  layers?: number;
  heads?: number;
  kvHeads?: number;
  headDim?: number;
  intermediate?: number;
  blockSize?: number;
  /** Default: two layers spread over the target (its first and its middle one). */
  targetLayerIds?: number[];
  /** Default: vocab_size - 2 (where Kimi K2.5's drafter has it). */
  maskTokenId?: number;
  /** block_size inside dflash_config (newer checkpoints) instead of at the top level. */
  nestedBlockSize?: boolean;
}

/** A DFlashDraftModel config.json body that fits `target`. */
export function dflashConfigJson(target: ModelConfig, shape: DflashShape = {}): Record<string, unknown> {
  const heads = shape.heads ?? 4;
  const layers = shape.layers ?? 2;
  const blockSize = shape.blockSize ?? 4;
  const ids = shape.targetLayerIds ?? [0, Math.floor(target.numLayers / 2)].filter((v, i, a) => a.indexOf(v) === i);
  const dflash: Record<string, unknown> = { target_layer_ids: ids, mask_token_id: shape.maskTokenId ?? target.vocabSize - 2 };
  if (shape.nestedBlockSize) dflash.block_size = blockSize;
  return {
    architectures: [DFLASH_ARCHITECTURE],
    model_type: 'qwen3',
    vocab_size: target.vocabSize,
    hidden_size: target.hiddenSize,
    intermediate_size: shape.intermediate ?? 2 * target.hiddenSize,
    num_hidden_layers: layers,
    num_attention_heads: heads,
    num_key_value_heads: shape.kvHeads ?? Math.max(1, heads / 2),
    head_dim: shape.headDim ?? 32,
    hidden_act: 'silu',
    rms_norm_eps: 1e-6,
    rope_theta: 1000000,
    rope_scaling: null,
    max_position_embeddings: 4096,
    attention_bias: false,
    tie_word_embeddings: false,
    layer_types: Array.from({ length: layers }, () => 'full_attention'),
    sliding_window: null,
    num_target_layers: target.numLayers,
    ...(shape.nestedBlockSize ? {} : { block_size: blockSize }),
    dflash_config: dflash,
    torch_dtype: 'bfloat16',
  };
}

/** Seeded random drafter weights by tensor name, bf16-representable. */
export function randomDflashWeights(config: DflashConfig, seed: number): Map<string, Float32Array> {
  const rng = new SeededRandom(seed);
  const out = new Map<string, Float32Array>();
  for (const spec of dflashWeightSpecs(config)) {
    const n = spec.shape.reduce((a, b) => a * b, 1);
    const x = new Float32Array(n);
    const isNorm = spec.shape.length === 1;
    // head norms wide (attention far from uniform), other norms near 1, projections 1/sqrt(fan-in)
    const spread = /[qk]_norm/.test(spec.name) ? 0.5 : 0.1;
    for (let i = 0; i < n; i++) x[i] = isNorm ? 1 + spread * rng.normal() : rng.normal() / Math.sqrt(spec.shape[1]);
    out.set(spec.name, bf16ArrayToF32(f32ArrayToBf16(x)));
  }
  return out;
}

export async function dflashFromWeights(config: DflashConfig, weights: Map<string, Float32Array>, target: DflashTargetWeights): Promise<DflashModel> {
  return new DflashModel(config, await loadDflashWeights(config, async (name) => weights.get(name)!), target);
}

/** Writes a drafter directory: config.json and model.safetensors (bf16), as z-lab publishes them. */
export async function writeDflashDirectory(dir: string, configJson: Record<string, unknown>, weights: Map<string, Float32Array>): Promise<void> {
  const config = parseDflashConfig(configJson, join(dir, 'config.json'));
  await makeDirectories(dir);
  await writeFile(join(dir, 'config.json'), `${JSON.stringify(configJson, null, 2)}\n`);
  const tensors = dflashWeightSpecs(config).map((s) => ({ name: s.name, dtype: 'BF16' as const, shape: s.shape, data: f32ArrayToBf16(weights.get(s.name)!) }));
  await writeSafetensors(join(dir, 'model.safetensors'), tensors, { metadata: { format: 'pt' } });
}
