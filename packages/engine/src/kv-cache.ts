/**
 * MLA's latent KV cache on the device: per layer and token the normalized compressed KV
 * (kv_lora_rank values) and the RoPE'd shared key (qk_rope_head_dim values), in bf16 or f32.
 * Each sequence slot owns `capacity` consecutive rows of every layer's tensors, so a batch of
 * sequences can later share one step; today a step serves one sequence.
 *
 *   c[layer]:   [sequences * capacity, kv_lora_rank]
 *   kpe[layer]: [sequences * capacity, qk_rope_head_dim]
 *
 * The committed length of each sequence lives on the device too (`length`, i32 [1]), so captured
 * steps read and advance it without a host round trip; `committed` mirrors it on the host.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import type { ModelConfig } from '@kdtree/reference';
import { checkInt } from './errors.js';
import { view } from './linear.js';

export type CacheDtype = 'bf16' | 'f32';

export class KvCache {
  readonly c: DeviceTensor[] = [];
  readonly kpe: DeviceTensor[] = [];
  /** i32 [1] per sequence: its committed length, read and moved on by captured steps. */
  readonly length: DeviceTensor[] = [];
  /** The host's copy of each committed length (kept in step with `length` by the engine). */
  readonly committed: number[];

  constructor(
    private readonly b: KdtreeBackend,
    readonly config: ModelConfig,
    readonly capacity: number,
    readonly dtype: CacheDtype = 'bf16',
    readonly sequences = 1,
  ) {
    checkInt('cacheTokens', capacity, 2, 2 ** 31 / Math.max(1, sequences) - 1);
    checkInt('sequences', sequences, 1, 1024);
    this.committed = new Array<number>(sequences).fill(0);
    try {
      for (let l = 0; l < config.numLayers; l++) {
        this.c.push(b.zeros(dtype, [sequences * capacity, config.kvLoraRank]));
        this.kpe.push(b.zeros(dtype, [sequences * capacity, config.qkRopeDim]));
      }
      for (let s = 0; s < sequences; s++) this.length.push(b.zeros('i32', [1]));
    } catch (error) {
      this.dispose();
      throw error;
    }
  }

  /** Device bytes of a cache of this shape (the memory estimate). */
  static bytes(config: ModelConfig, capacity: number, dtype: CacheDtype, sequences = 1): number {
    return config.numLayers * sequences * capacity * (config.kvLoraRank + config.qkRopeDim) * (dtype === 'bf16' ? 2 : 4);
  }

  /** Layer `layer`'s rows of sequence `seq`: [capacity, rank] and [capacity, rope]. */
  layer(layer: number, seq = 0): { c: DeviceTensor; kpe: DeviceTensor } {
    const { kvLoraRank: r, qkRopeDim: d } = this.config;
    return { c: view(this.c[layer], [this.capacity, r], seq * this.capacity * r), kpe: view(this.kpe[layer], [this.capacity, d], seq * this.capacity * d) };
  }

  /** Every layer's tensors of `seq`, in the order kv_commit takes them. */
  all(seq = 0): DeviceTensor[] {
    const out: DeviceTensor[] = [];
    for (let l = 0; l < this.config.numLayers; l++) {
      const { c, kpe } = this.layer(l, seq);
      out.push(c, kpe);
    }
    return out;
  }

  /** Sets the committed length of `seq` on the host and the device (a new sequence, a crop). */
  setLength(seq: number, length: number): void {
    checkInt('length', length, 0, this.capacity);
    this.committed[seq] = length;
    // on the default stream, where every step runs: ordered after the work queued before it
    this.b.native.upload(this.length[seq].buffer, Int32Array.of(length));
  }

  dispose(): void {
    this.b.free(...this.c, ...this.kpe, ...this.length);
    this.c.length = 0;
    this.kpe.length = 0;
    this.length.length = 0;
  }
}
