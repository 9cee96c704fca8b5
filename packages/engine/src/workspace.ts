/**
 * The activations of one forward pass, allocated once for the most rows a step will run (`rows`:
 * the prefill chunk or the largest tree) and seen at each step as [T, ...] views of their first T
 * rows. Every step runs on one stream in order, so all steps (and the graphs captured from them)
 * share these buffers.
 */
import { DTYPE_BYTES, type DeviceTensor, type Dtype, type KdtreeBackend } from '@kdtree/cuda';
import { qkHeadDim, type ModelConfig } from '@kdtree/reference';
import { view } from './linear.js';

/**
 * The dtype of the activations that only feed GEMMs (the normed hidden state h, q_a's normed
 * output, the attention's output, the MLPs' silu(gate) * up and the routed experts' rows). bf16 is what a bf16 checkpoint
 * computes in, and the GEMMs read it as one plane: f32 x costs them three bf16 planes (three MMAs
 * and three times the x loads per weight fragment), which keeps them well short of the weight
 * stream's bandwidth. The residual stream, q, the latent KV and every sum stay f32.
 */
export type ActivationDtype = 'bf16' | 'f32';

/**
 * Buffer name -> [dtype, width per row]; rows of `moeAct` are (token, expert) pairs. Widths are the
 * whole model's: a tensor-parallel rank uses narrower views of the per-head and intermediate
 * buffers, and `lmLocal` holds its block of the vocabulary's logits before the all-gather.
 */
function layout(c: ModelConfig, hasFloatGateUp: boolean, world: number, act: ActivationDtype): Record<string, [Dtype, number]> {
  const mlpInter = Math.max(c.firstKDenseReplace > 0 ? c.intermediateSize : 0, c.nSharedExperts * c.moeIntermediateSize);
  const out: Record<string, [Dtype, number]> = {
    x: ['f32', c.hiddenSize],
    h: [act, c.hiddenSize],
    // the router's input stays f32 (as transformers' DeepseekV3 computes it): expert choices that
    // hinge on a near tie would otherwise flip with the rounding of h
    hRouter: ['f32', act === 'bf16' && c.nRoutedExperts > 0 ? c.hiddenSize : 1],
    attnOut: ['f32', c.hiddenSize],
    mlpOut: ['f32', c.hiddenSize],
    sharedOut: ['f32', c.hiddenSize],
    // MLA: the down projection [q_a or q_proj | c | k_pe], the normed q_a, q_b's output, the query parts
    mlaDown: ['f32', (c.qLoraRank ?? c.numHeads * qkHeadDim(c)) + c.kvLoraRank + c.qkRopeDim],
    qaNormed: [act, c.qLoraRank ?? 1],
    qProj: ['f32', c.qLoraRank === null ? 1 : c.numHeads * qkHeadDim(c)],
    qNope: ['f32', c.numHeads * c.qkNopeDim],
    qPe: ['f32', c.numHeads * c.qkRopeDim],
    attn: [act, c.numHeads * c.vHeadDim],
    act: [act, Math.max(1, mlpInter)],
    gateUp: [act, hasFloatGateUp ? 2 * mlpInter : 1],
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
    readonly activations: ActivationDtype = 'f32',
  ) {
    try {
      for (const [name, [dtype, width]] of Object.entries(layout(config, hasFloatGateUp, world, activations))) this.buffers.set(name, b.empty(dtype, [rows, width]));
      const pairs = rows * config.numExpertsPerTok;
      this.moeAct = b.empty(activations, [pairs, config.moeIntermediateSize]);
    } catch (error) {
      this.dispose();
      throw error;
    }
  }

  /** Device bytes of a workspace of this shape (the memory estimate). */
  static bytes(config: ModelConfig, rows: number, hasFloatGateUp: boolean, world = 1, activations: ActivationDtype = 'f32'): number {
    let total = 0;
    for (const [dtype, width] of Object.values(layout(config, hasFloatGateUp, world, activations))) total += rows * width * DTYPE_BYTES[dtype];
    const pairs = rows * config.numExpertsPerTok;
    total += pairs * config.moeIntermediateSize * DTYPE_BYTES[activations];
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
