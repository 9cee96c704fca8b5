/**
 * The activations of one forward pass, allocated once for the most rows a step will run (`rows`:
 * the prefill chunk or the largest tree) and seen at each step as [T, ...] views of their first T
 * rows. Every step runs on one stream in order, so all steps (and the graphs captured from them)
 * share these buffers.
 */
import type { DeviceTensor, Dtype, KdtreeBackend } from '@kdtree/cuda';
import type { ModelConfig } from '@kdtree/reference';
import { view } from './linear.js';

/**
 * Buffer name -> [dtype, width per row]; rows of `moeAct` are (token, expert) pairs. Widths are the
 * whole model's: a tensor-parallel rank uses narrower views of the per-head and intermediate
 * buffers, and `lmLocal` holds its block of the vocabulary's logits before the all-gather.
 */
function layout(c: ModelConfig, hasFloatGateUp: boolean, world: number): Record<string, [Dtype, number]> {
  const mlpInter = Math.max(c.firstKDenseReplace > 0 ? c.intermediateSize : 0, c.nSharedExperts * c.moeIntermediateSize);
  const out: Record<string, [Dtype, number]> = {
    x: ['f32', c.hiddenSize],
    h: ['f32', c.hiddenSize],
    attnOut: ['f32', c.hiddenSize],
    mlpOut: ['f32', c.hiddenSize],
    sharedOut: ['f32', c.hiddenSize],
    qa: ['f32', c.qLoraRank ?? 1],
    qaNormed: ['f32', c.qLoraRank ?? 1],
    qNope: ['f32', c.numHeads * c.qkNopeDim],
    qPe: ['f32', c.numHeads * c.qkRopeDim],
    cRaw: ['f32', c.kvLoraRank],
    c: ['f32', c.kvLoraRank],
    kpe: ['f32', c.qkRopeDim],
    attn: ['f32', c.numHeads * c.vHeadDim],
    act: ['f32', Math.max(1, mlpInter)],
    gateUp: ['f32', hasFloatGateUp ? 2 * mlpInter : 1],
    routerLogits: ['f32', c.nRoutedExperts],
    routeIds: ['i32', c.numExpertsPerTok],
    routeWeights: ['f32', c.numExpertsPerTok],
    lmLocal: ['f32', world > 1 ? c.vocabSize / world : 1],
  };
  return out;
}

export class Workspace {
  private readonly buffers = new Map<string, DeviceTensor>();
  /** [rows * topk, moe_intermediate]: the routed experts' activations, one row per (token, expert). */
  readonly moeAct: DeviceTensor;

  constructor(
    private readonly b: KdtreeBackend,
    readonly config: ModelConfig,
    /** The most tokens one pass runs. */
    readonly rows: number,
    hasFloatGateUp: boolean,
    /** Tensor-parallel ranks (1: one device). */
    world = 1,
  ) {
    try {
      for (const [name, [dtype, width]] of Object.entries(layout(config, hasFloatGateUp, world))) this.buffers.set(name, b.empty(dtype, [rows, width]));
      const pairs = rows * config.numExpertsPerTok;
      this.moeAct = b.empty('f32', [pairs, config.moeIntermediateSize]);
    } catch (error) {
      this.dispose();
      throw error;
    }
  }

  /** Device bytes of a workspace of this shape (the memory estimate). */
  static bytes(config: ModelConfig, rows: number, hasFloatGateUp: boolean, world = 1): number {
    let total = 0;
    for (const [dtype, width] of Object.values(layout(config, hasFloatGateUp, world))) total += rows * width * (dtype === 'f32' || dtype === 'i32' ? 4 : 2);
    const pairs = rows * config.numExpertsPerTok;
    total += pairs * config.moeIntermediateSize * 4;
    return total;
  }

  /** The first `t` rows of buffer `name`, as [t, width] (or [t, ...inner] when given). */
  get(name: string, t: number, inner?: number[]): DeviceTensor {
    const buf = this.buffers.get(name)!;
    const width = buf.shape[1];
    return view(buf, inner === undefined ? [t, width] : [t, ...inner]);
  }

  /** Rows [first, first + count) of buffer `name`. */
  rowsOf(name: string, first: number, count: number): DeviceTensor {
    const buf = this.buffers.get(name)!;
    const width = buf.shape[1];
    return view(buf, [count, width], first * width);
  }

  dispose(): void {
    this.b.free(...this.buffers.values());
    this.buffers.clear();
    if (this.moeAct) this.b.free(this.moeAct);
  }
}
