/**
 * Rotary position embedding as transformers computes it for DeepseekV3 (modeling_rope_utils):
 * default RoPE, or YaRN with its inverse-frequency blend and attention factor. RoPE covers only
 * the qk_rope_head_dim part of each head; with `rope_interleave` the rotated pairs are (2i, 2i+1).
 */
import type { ModelConfig, RopeConfig } from './config.js';
import { qkHeadDim } from './config.js';

export interface RopeTables {
  /** [rope_dim / 2] inverse frequencies. */
  invFreq: Float64Array;
  /** cos and sin are multiplied by this (YaRN's attention factor; 1 for default RoPE and Kimi K2). */
  attentionFactor: number;
}

function getMscale(scale: number, mscale = 1): number {
  return scale <= 1 ? 1 : 0.1 * mscale * Math.log(scale) + 1;
}

export function ropeTables(config: ModelConfig): RopeTables {
  return ropeTablesFor(config.rope, config.maxPositionEmbeddings, config.qkRopeDim);
}

/** The tables for `dim` rotated dimensions of a head (DFlash's Qwen3 layers rotate the whole head). */
export function ropeTablesFor(rope: RopeConfig, maxPositionEmbeddings: number, dim: number): RopeTables {
  const base = rope.theta;
  const half = dim / 2;
  const posFreqs = Float64Array.from({ length: half }, (_, i) => base ** ((2 * i) / dim));
  if (rope.type === 'default') return { invFreq: posFreqs.map((p) => 1 / p), attentionFactor: 1 };

  // transformers: with original_max_position_embeddings, the factor is max_pos / original.
  const factor = rope.originalMaxPositionEmbeddings !== null ? maxPositionEmbeddings / rope.originalMaxPositionEmbeddings : rope.factor;
  const original = rope.originalMaxPositionEmbeddings ?? maxPositionEmbeddings;
  const attentionFactor =
    rope.attentionFactor ?? (rope.mscale && rope.mscaleAllDim ? getMscale(factor, rope.mscale) / getMscale(factor, rope.mscaleAllDim) : getMscale(factor));
  const correctionDim = (rotations: number) => (dim * Math.log(original / (rotations * 2 * Math.PI))) / (2 * Math.log(base));
  let low = correctionDim(rope.betaFast);
  let high = correctionDim(rope.betaSlow);
  if (rope.truncate) {
    low = Math.floor(low);
    high = Math.ceil(high);
  }
  low = Math.max(low, 0);
  high = Math.min(high, dim - 1);
  if (low === high) high += 0.001; // transformers: prevent a singular ramp
  const invFreq = new Float64Array(half);
  for (let i = 0; i < half; i++) {
    const ramp = Math.min(1, Math.max(0, (i - low) / (high - low)));
    const extrapolation = 1 - ramp; // high-frequency dims keep their original frequency
    invFreq[i] = (1 / (factor * posFreqs[i])) * (1 - extrapolation) + (1 / posFreqs[i]) * extrapolation;
  }
  return { invFreq, attentionFactor };
}

/**
 * The attention softmax scale: qk_head_dim^-0.5, times mscale^2 for YaRN with mscale_all_dim,
 * where mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (transformers' DeepseekV3Attention).
 */
export function softmaxScale(config: ModelConfig): number {
  let scale = qkHeadDim(config) ** -0.5;
  if (config.rope.type === 'yarn' && config.rope.mscaleAllDim) {
    const m = getMscale(config.rope.factor, config.rope.mscaleAllDim);
    scale *= m * m;
  }
  return scale;
}

/**
 * Rotates `x[offset .. offset + dim)` in place for `position`. Interleaved: pairs (2i, 2i+1);
 * otherwise pairs (i, i + dim/2). transformers de-interleaves before rotating; the dot products
 * between rotated queries and keys are the same.
 */
export function applyRope(x: Float32Array, offset: number, position: number, tables: RopeTables, interleave: boolean): void {
  const half = tables.invFreq.length;
  const f = tables.attentionFactor;
  for (let i = 0; i < half; i++) {
    const angle = position * tables.invFreq[i];
    const c = Math.cos(angle) * f;
    const s = Math.sin(angle) * f;
    const a = interleave ? offset + 2 * i : offset + i;
    const b = interleave ? a + 1 : a + half;
    const x0 = x[a];
    const x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x1 * c + x0 * s;
  }
}
