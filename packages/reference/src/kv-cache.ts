/**
 * MLA's latent KV cache: per layer and token, the normalized compressed KV (kv_lora_rank values)
 * and the RoPE'd shared key (qk_rope_head_dim values), 576 floats a token for Kimi K2 instead of
 * 64 heads x (192 + 128). Slots are positions in the committed sequence.
 */
import type { ModelConfig } from './config.js';
import { ReferenceUsageError } from './errors.js';

export interface LatentLayerCache {
  /** [capacity, kv_lora_rank] kv_a_layernorm(c_kv) */
  c: Float32Array;
  /** [capacity, qk_rope_head_dim] RoPE(k_pe) at the token's position */
  kpe: Float32Array;
}

export class LatentKvCache {
  /** Committed tokens (slots [0, length)). */
  length = 0;
  readonly layers: LatentLayerCache[];

  constructor(
    readonly config: ModelConfig,
    readonly capacity: number,
  ) {
    if (!Number.isInteger(capacity) || capacity < 1) throw new ReferenceUsageError(`cache capacity must be a positive integer, got ${capacity}`);
    this.layers = Array.from({ length: config.numLayers }, () => ({
      c: new Float32Array(capacity * config.kvLoraRank),
      kpe: new Float32Array(capacity * config.qkRopeDim),
    }));
  }

  /** Throws unless `count` more slots fit after `length`. */
  reserve(count: number): void {
    if (this.length + count > this.capacity) {
      throw new ReferenceUsageError(`KV cache overflow: ${this.length} tokens + ${count} new > capacity ${this.capacity}`);
    }
  }

  /** Copies slot `src` to slot `dst` in every layer (DDTree commit). */
  copySlot(dst: number, src: number): void {
    if (dst === src) return;
    const { kvLoraRank: r, qkRopeDim: d } = this.config;
    for (const l of this.layers) {
      l.c.copyWithin(dst * r, src * r, src * r + r);
      l.kpe.copyWithin(dst * d, src * d, src * d + d);
    }
  }

  truncate(length: number): void {
    if (!Number.isInteger(length) || length < 0 || length > this.capacity) throw new ReferenceUsageError(`cannot truncate the KV cache to ${length}`);
    this.length = length;
  }
}
