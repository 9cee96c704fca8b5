/**
 * What a model needs on the device before anything is allocated: weights, the latent KV cache,
 * the activations of the largest pass, the step buffers (a tree verify's logits are [nodes,
 * vocab] f32) and the largest staging copy a weight passes through while it is packed. Compared
 * with the device's free memory so a model that does not fit fails at once with both numbers.
 */
import type { KdtreeBackend } from '@kdtree/cuda';
import type { DflashConfig, ModelConfig } from '@kdtree/reference';
import { EngineError } from './errors.js';
import { KvCache, type CacheDtype } from './kv-cache.js';
import { weightBytes } from './model.js';
import type { WeightReader } from './model-source.js';
import { WHOLE, type Shard } from './shard.js';
import { Workspace } from './workspace.js';

export interface MemoryEstimate {
  weights: number;
  cache: number;
  workspace: number;
  /** The largest weight's checkpoint-layout copy, alive while it is packed. */
  staging: number;
  total: number;
}

/** Device memory of a loaded model, or of one rank's shard of it (`rows`: its workspace; `nodes`: its largest tree). */
export function estimateMemory(source: WeightReader, options: { capacity: number; cacheDtype: CacheDtype; rows: number; nodes: number; depth: number; shard?: Shard }): MemoryEstimate {
  const c: ModelConfig = source.config;
  const shard = options.shard ?? WHOLE;
  const parts = weightBytes(source, c, shard);
  const weights = parts.reduce((s, p) => s + p.bytes, 0);
  const cache = KvCache.bytes(c, options.capacity, options.cacheDtype);
  // bf16 experts would need [gate | up] scratch; the workspace is sized for the worst case
  const workspace = Workspace.bytes(c, options.rows, true, shard.world) + 4 * c.vocabSize * (options.nodes + options.depth + 1) + options.nodes * (options.nodes + 24);
  const moeLayer = parts.slice(1, -1).reduce((m, p) => Math.max(m, p.bytes), 0);
  const staging = Math.max(c.vocabSize * c.hiddenSize * 2, moeLayer / 2);
  return { weights, cache, workspace, staging, total: weights + cache + workspace + staging };
}

/**
 * Device memory of a DFlash drafter (DflashDrafter): its bf16 weights (fc over the tapped layers,
 * per layer q/k/v/o and the MLP; embed_tokens and lm_head are the target's), the f32 context cache
 * (keys and values of `capacity` positions per layer) and its f32 scratch (commits of up to
 * `maxRows` rows, the block's rows) and the engine's buffers for it: the target's taps (f32
 * [maxRows, hidden]) and the `heldRows` rows it holds back (f32 [heldRows, hidden]), per distinct
 * tapped layer. The largest weight's bf16 copy is staged while it loads.
 */
export function estimateDflashMemory(c: DflashConfig, options: { capacity: number; maxRows: number; heldRows?: number }): MemoryEstimate {
  const H = c.hiddenSize;
  const q = c.numHeads * c.headDim;
  const kv = c.numKvHeads * c.headDim;
  const I = c.intermediateSize;
  const layer = H * q * 2 + H * kv * 2 + 3 * H * I;
  const fc = c.targetLayerIds.length * H * H;
  const weights = 2 * (fc + c.numLayers * layer) + 4 * (H * (2 * c.numLayers + 2) + 2 * c.headDim * c.numLayers);
  const cache = 4 * 2 * c.numLayers * options.capacity * kv;
  const rows = Math.max(options.maxRows, c.blockSize);
  // the engine's buffers for it: the target's taps (a pass's rows) and the rows held back, per distinct tapped layer
  const tapped = (options.maxRows + (options.heldRows ?? 0)) * new Set(c.targetLayerIds).size * H;
  const workspace = 4 * (rows * (4 * H + 3 * kv) + c.blockSize * (4 * H + 3 * q + 2 * kv + 3 * I) + tapped);
  const staging = 2 * Math.max(fc / c.targetLayerIds.length, 2 * H * I);
  return { weights, cache, workspace, staging, total: weights + cache + workspace + staging };
}

/** Bytes the backend can still allocate: the GPU's free memory, or the host's for the cpu twin. */
export function freeMemory(b: KdtreeBackend): number {
  return b.native.memoryInfo().free;
}

const gib = (n: number) => `${(n / 2 ** 30).toFixed(2)} GiB`;

export function checkFits(b: KdtreeBackend, estimate: MemoryEstimate, what: string): void {
  const free = freeMemory(b);
  // the backends' per-stream work space (the GEMMs' partial sums, the MoE sort) on top
  const margin = b.kind === 'cuda' ? 512 * 2 ** 20 : 64 * 2 ** 20;
  if (estimate.total + margin > free) {
    throw new EngineError(
      'KDTREE_ENGINE_MEMORY',
      `${what} needs ${gib(estimate.total + margin)} (weights ${gib(estimate.weights)}, KV cache ${gib(estimate.cache)}, activations ${gib(estimate.workspace)}, staging ${gib(estimate.staging)}, work space ${gib(margin)}) but the ${b.kind} device has ${gib(free)} free; use a smaller --cache-tokens or more devices`,
      'model',
    );
  }
}
