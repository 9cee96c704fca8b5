/**
 * The layers of a DeepSeek-V3 / Kimi K2 decoder, each owning its weights: it names the tensors it
 * needs, loads them itself (so a tensor-parallel rank would cut its shard here, and nowhere else),
 * and queues the ops of its forward pass on the step's stream.
 *
 *   MLA:  q = q_b(norm(q_a(h))) (or q_proj(h)) -> [T, heads, nope | rope]
 *         c = norm(kv_a_c(h)) [T, rank], k_pe = rope(kv_a_pe(h)) [T, rope] -> latent cache
 *         out = o_proj(attention over the cache in MLA's absorbed form)
 *   MLP:  down(silu(gate(h)) * up(h))
 *   MoE:  router -> routed experts (grouped GEMM, weighted sum) + shared experts
 *
 * Under tensor parallelism (a Shard) each rank keeps a block of the heads (q_b / q_proj and kv_b
 * column-parallel, o_proj row-parallel over the same heads) and of every MLP's intermediate
 * channels (gate / up column-parallel, down row-parallel); q_a, kv_a, their norms and the router
 * are replicated. MLA's latent cache has no head dimension, so each rank keeps all of it and runs
 * its heads over it. o_proj and down then hold partial sums: DeviceModel all-reduces them.
 *
 * The attention's input projections are read as fewer, wider weights, so a decode step runs few
 * kernels (each short one is bound by its launch, not its bytes): q_a and kv_a are one weight
 * [q_a; kv_a] (q_proj and kv_a without q_lora), and q_b (or q_proj) has its rows ordered as every
 * head's nope part, then every head's rope part. mlaInputs and mlaQuery then cut those outputs
 * into what the attention reads: the normed q_a, the latent KV written to the cache, and
 * contiguous q_nope / RoPE'd q_pe.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { qkHeadDim, type ModelConfig } from '@kdtree/reference';
import { modelError } from './errors.js';
import { applyLinear, linearBytes, linearTensors, loadLinear, specReads, view, type DeviceLinear, type LinearSpec } from './linear.js';
import type { WeightReader } from './model-source.js';
import { blockRange, shardBlock, WHOLE, type Block, type Shard, type WeightRead } from './shard.js';
import type { Workspace } from './workspace.js';

/** What one forward pass over T new tokens of one sequence needs beyond the activations. */
export interface Pass {
  t: number;
  stream: number;
  /** i32 [T]: RoPE positions (start + depth for a tree's nodes). */
  positions: DeviceTensor;
  /** i32 [T]: the cache rows the new tokens' latent KV goes to. */
  slots: DeviceTensor;
  /** u8 [T, T]: which new tokens each may attend to (a tree's ancestors); causal when absent. */
  mask?: DeviceTensor;
  /** Committed slots before the new ones, or their bound when `baseOnDevice` holds the value. */
  base: number;
  baseOnDevice?: DeviceTensor;
  /** The sequence's cache rows of each layer. */
  cache: (layer: number) => { c: DeviceTensor; kpe: DeviceTensor };
  /** A profiler's hook, called after each stage's ops are queued (see DeviceModel.forward). */
  mark?: (part: string) => void;
}

/** Constants every attention layer shares: RoPE's inverse frequencies (f64 [rope / 2]) and scales. */
export interface AttentionConstants {
  invFreq: DeviceTensor;
  attentionFactor: number;
  scale: number;
}

const range = (start: number, count: number) => Array.from({ length: count }, (_, i) => start + i);

/** The rows of every head's [nope | rope] block that belong to one part, for the heads of `heads`. */
function headRows(heads: Block, nope: number, rope: number, part: 'nope' | 'rope'): number[] {
  const rows: number[] = [];
  for (let h = heads.start; h < heads.start + heads.count; h++) rows.push(...range(h * (nope + rope) + (part === 'nope' ? 0 : nope), part === 'nope' ? nope : rope));
  return rows;
}

function freeLinears(b: KdtreeBackend, ...ws: (DeviceLinear | undefined)[]): void {
  for (const w of ws) if (w) b.free(...linearTensors(w));
}

/** The INT4 group of a weight, or 1 when it is float (a block of its K then needs no alignment). */
function kUnit(source: WeightReader, name: string): { unit: number; unitName: string } {
  const d = source.int4(name);
  return d === undefined ? { unit: 1, unitName: 'a column' } : { unit: d.group_size, unitName: 'its INT4 group' };
}

export class MlaAttention {
  private constructor(
    private readonly config: ModelConfig,
    /** Heads this rank runs (all of them on one device). */
    private readonly heads: number,
    private readonly w: {
      /** [q_a; kv_a] (q_lora models) or [q_proj (nope rows, rope rows); kv_a]: one GEMM of h. */
      down: DeviceLinear;
      qANorm?: DeviceTensor;
      /** q_b with its rows as every head's nope part, then every head's rope part (q_lora models). */
      qB?: DeviceLinear;
      kvANorm: DeviceTensor;
      /** [heads * (nope + v), rank]: W_kb then W_vb per head, read by the attention kernel as stored. */
      kvB: DeviceTensor;
      o: DeviceLinear;
    },
  ) {}

  private static specs(source: WeightReader, c: ModelConfig, layer: number, shard: Shard) {
    const a = `model.layers.${layer}.self_attn.`;
    const H = c.hiddenSize;
    const nh = c.numHeads;
    const qd = qkHeadDim(c);
    const qIn = c.qLoraRank ?? H;
    const qName = c.qLoraRank === null ? `${a}q_proj.weight` : `${a}q_b_proj.weight`;
    const qShape = [nh * qd, qIn] as const;
    const kvA = `${a}kv_a_proj_with_mqa.weight`;
    const kvAShape = [c.kvLoraRank + c.qkRopeDim, H] as const;
    const kvBName = `${a}kv_b_proj.weight`;
    const kvBShape: [number, number] = [nh * (c.qkNopeDim + c.vHeadDim), c.kvLoraRank];
    const oName = `${a}o_proj.weight`;
    const oShape = [H, nh * c.vHeadDim] as const;
    const heads = shardBlock(shard, nh, { tensor: qName, shape: qShape, dim: 'heads (num_attention_heads)' });
    // o_proj's K is heads x v_head_dim: the same heads, in whole INT4 groups
    const oCols = shardBlock(shard, nh * c.vHeadDim, { tensor: oName, shape: oShape, dim: 'K (heads x v_head_dim)', ...kUnit(source, oName) });
    const kvBRows = { start: heads.start * (c.qkNopeDim + c.vHeadDim), count: heads.count * (c.qkNopeDim + c.vHeadDim) };
    const qRows = [...headRows(heads, c.qkNopeDim, c.qkRopeDim, 'nope'), ...headRows(heads, c.qkNopeDim, c.qkRopeDim, 'rope')];
    const down: LinearSpec =
      c.qLoraRank === null
        ? { names: [qName, kvA], shapes: [qShape, kvAShape], rows: [qRows, undefined] }
        : { names: [`${a}q_a_proj.weight`, kvA], shapes: [[c.qLoraRank, H], kvAShape] };
    return {
      a,
      heads: heads.count,
      down,
      qB: c.qLoraRank === null ? undefined : ({ names: [qName], shapes: [qShape], rows: [qRows] } as LinearSpec),
      kvB: { name: kvBName, shape: kvBShape, rows: shard.world > 1 ? blockRange(kvBRows) : undefined, count: kvBRows.count },
      o: { names: [oName], shapes: [oShape], cols: shard.world > 1 ? oCols : undefined } as LinearSpec,
    };
  }

  /** Columns of the down projection's output: [q_a or q_proj | c | k_pe]. */
  static downWidth(c: ModelConfig, heads = c.numHeads): number {
    return (c.qLoraRank ?? heads * qkHeadDim(c)) + c.kvLoraRank + c.qkRopeDim;
  }

  /** Every read `load` makes for this rank (what `kdtree shard` cuts: cutsOf). */
  static shardPlan(source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): WeightRead[] {
    const s = MlaAttention.specs(source, c, layer, shard);
    const reads: WeightRead[] = [...specReads(s.down)];
    if (s.qB) reads.push({ name: `${s.a}q_a_layernorm.weight`, shape: [c.qLoraRank!] }, ...specReads(s.qB));
    reads.push({ name: `${s.a}kv_a_layernorm.weight`, shape: [c.kvLoraRank] });
    reads.push({ name: s.kvB.name, shape: s.kvB.shape, rows: s.kvB.rows }, ...specReads(s.o));
    return reads;
  }

  static bytes(source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): number {
    const s = MlaAttention.specs(source, c, layer, shard);
    let total = 0;
    for (const spec of [s.down, s.qB, s.o]) if (spec) total += linearBytes(source, spec);
    const k = s.kvB.shape[1];
    return total + s.kvB.count * k * (source.int4(s.kvB.name) ? 4 : 2) + 4 * ((c.qLoraRank ?? 0) + c.kvLoraRank);
  }

  static async load(b: KdtreeBackend, source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): Promise<MlaAttention> {
    const s = MlaAttention.specs(source, c, layer, shard);
    const loaded: Partial<MlaAttention['w']> = {};
    try {
      loaded.down = await loadLinear(b, source, [s.down]);
      if (s.qB) {
        loaded.qANorm = b.fromArray('f32', [c.qLoraRank!], await source.readF32(`${s.a}q_a_layernorm.weight`, [c.qLoraRank!]));
        loaded.qB = await loadLinear(b, source, [s.qB]);
      }
      loaded.kvANorm = b.fromArray('f32', [c.kvLoraRank], await source.readF32(`${s.a}kv_a_layernorm.weight`, [c.kvLoraRank]));
      if (source.int4(s.kvB.name) !== undefined) {
        throw modelError(s.kvB.name, 'is INT4; the attention kernel reads kv_b_proj in bf16 (keep self_attn float, as Kimi K2 does)', source.path);
      }
      loaded.kvB = b.fromArray('bf16', [s.kvB.count, s.kvB.shape[1]], (await source.readBf16(s.kvB.name, s.kvB.shape, s.kvB.rows)).bits);
      loaded.o = await loadLinear(b, source, [s.o]);
      return new MlaAttention(c, s.heads, loaded as MlaAttention['w']);
    } catch (error) {
      freeLinears(b, loaded.down, loaded.qB, loaded.o);
      b.free(...[loaded.qANorm, loaded.kvANorm, loaded.kvB].filter((t): t is DeviceTensor => t !== undefined));
      throw error;
    }
  }

  /**
   * out [T, hidden] = attention of the normed input ws.h over the cache, the new tokens' latent KV
   * written at `pass.slots` (under tensor parallelism: this rank's heads' share of o_proj's sum).
   */
  forward(b: KdtreeBackend, ws: Workspace, pass: Pass, layer: number, k: AttentionConstants, out: DeviceTensor): void {
    const c = this.config;
    const { t: T, stream } = pass;
    const w = this.w;
    const nh = this.heads;
    const h = ws.get('h', T);
    const rope = { positions: pass.positions, invFreq: k.invFreq, attentionFactor: k.attentionFactor, interleave: c.ropeInterleave, stream };
    const down = ws.get('mlaDown', T, [MlaAttention.downWidth(c, nh)]);
    applyLinear(b, w.down, h, down, stream);
    const cache = pass.cache(layer);
    const qIn = w.qB ? ws.get('qaNormed', T) : undefined;
    b.native.mlaInputs({ x: down, ...(qIn ? { qANorm: w.qANorm, qAOut: qIn } : {}), kvANorm: w.kvANorm, cacheC: cache.c, cacheKpe: cache.kpe, slots: pass.slots, eps: c.mlaNormEps, ...rope });
    pass.mark?.(`kv ${layer}`);
    let q = down;
    if (w.qB) {
      q = ws.get('qProj', T, [nh * qkHeadDim(c)]);
      applyLinear(b, w.qB, qIn!, q, stream);
    }
    const qNope = ws.get('qNope', T, [nh * c.qkNopeDim]);
    const qPe = ws.get('qPe', T, [nh * c.qkRopeDim]);
    b.native.mlaQuery({ x: q, qNope: view(qNope, [T, nh, c.qkNopeDim]), qPe: view(qPe, [T, nh, c.qkRopeDim]), ...rope });
    pass.mark?.(`q ${layer}`);
    const attn = ws.get('attn', T, [nh * c.vHeadDim]);
    b.native.mlaAttention({
      qNope: view(qNope, [T, nh, c.qkNopeDim]),
      qPe: view(qPe, [T, nh, c.qkRopeDim]),
      kvB: w.kvB,
      cacheC: cache.c,
      cacheKpe: cache.kpe,
      mask: pass.mask,
      out: view(attn, [T, nh, c.vHeadDim]),
      base: pass.base,
      baseOnDevice: pass.baseOnDevice,
      scale: k.scale,
      stream,
    });
    pass.mark?.(`mla ${layer}`);
    applyLinear(b, w.o, attn, out, stream);
  }

  dispose(b: KdtreeBackend): void {
    const w = this.w;
    freeLinears(b, w.down, w.qB, w.o);
    b.free(...[w.qANorm, w.kvANorm, w.kvB].filter((t): t is DeviceTensor => t !== undefined));
  }
}

/**
 * gate_up and down of one MLP (dense layer, shared experts, or one routed expert): this rank's
 * block of the intermediate channels, the rows of gate and up and the same columns of down (whole
 * INT4 groups of down's K).
 */
function mlpSpecs(source: WeightReader, prefix: string, inter: number, hidden: number, shard: Shard): { gateUp: LinearSpec; down: LinearSpec; inter: number } {
  const downName = `${prefix}down_proj.weight`;
  const block = shardBlock(shard, inter, { tensor: downName, shape: [hidden, inter], dim: 'intermediate size (K)', ...kUnit(source, downName) });
  const rows = shard.world > 1 ? blockRange(block) : undefined;
  return {
    gateUp: { names: [`${prefix}gate_proj.weight`, `${prefix}up_proj.weight`], shapes: [[inter, hidden], [inter, hidden]], rows: [rows, rows] },
    down: { names: [downName], shapes: [[hidden, inter]], cols: shard.world > 1 ? block : undefined },
    inter: block.count,
  };
}

export class Mlp {
  private constructor(
    readonly inter: number,
    private readonly gateUp: DeviceLinear,
    private readonly down: DeviceLinear,
  ) {}

  /** Every read `load` makes for this rank. */
  static shardPlan(source: WeightReader, prefix: string, inter: number, hidden: number, shard: Shard = WHOLE): WeightRead[] {
    const s = mlpSpecs(source, prefix, inter, hidden, shard);
    return [...specReads(s.gateUp), ...specReads(s.down)];
  }

  static bytes(source: WeightReader, prefix: string, inter: number, hidden: number, shard: Shard = WHOLE): number {
    const s = mlpSpecs(source, prefix, inter, hidden, shard);
    return linearBytes(source, s.gateUp) + linearBytes(source, s.down);
  }

  static async load(b: KdtreeBackend, source: WeightReader, prefix: string, inter: number, hidden: number, shard: Shard = WHOLE): Promise<Mlp> {
    const s = mlpSpecs(source, prefix, inter, hidden, shard);
    const gateUp = await loadLinear(b, source, [s.gateUp], { gateUp: true });
    try {
      return new Mlp(s.inter, gateUp, await loadLinear(b, source, [s.down]));
    } catch (error) {
      freeLinears(b, gateUp);
      throw error;
    }
  }

  /** Whether its gate_up is bf16 (the pass then needs [T, 2I] of scratch for silu_mul's input). */
  get floatGateUp(): boolean {
    return this.gateUp.kind === 'bf16';
  }

  forward(b: KdtreeBackend, ws: Workspace, x: DeviceTensor, out: DeviceTensor, stream: number): void {
    const T = x.shape[0];
    const act = ws.get('act', T, [this.inter]);
    applyLinear(b, this.gateUp, x, act, stream, ws.get('gateUp', T, [2 * this.inter]));
    applyLinear(b, this.down, act, out, stream);
  }

  dispose(b: KdtreeBackend): void {
    freeLinears(b, this.gateUp, this.down);
  }
}

export class Moe {
  private constructor(
    private readonly config: ModelConfig,
    /** Each routed expert's intermediate channels on this rank. */
    private readonly inter: number,
    private readonly router: DeviceLinear,
    /** f32 [E]: e_score_correction_bias, which chooses experts but does not weight them. */
    private readonly bias: DeviceTensor,
    /** [E, 2I, H] gate_up (INT4 packed for the SiLU epilogue) and [E, H, I] down. */
    private readonly gateUp: DeviceLinear,
    private readonly down: DeviceLinear,
    private readonly shared: Mlp | undefined,
  ) {}

  private static specs(source: WeightReader, c: ModelConfig, layer: number, shard: Shard) {
    const p = `model.layers.${layer}.mlp.`;
    const experts = Array.from({ length: c.nRoutedExperts }, (_, e) => mlpSpecs(source, `${p}experts.${e}.`, c.moeIntermediateSize, c.hiddenSize, shard));
    return {
      p,
      inter: experts[0].inter,
      router: { names: [`${p}gate.weight`], shapes: [[c.nRoutedExperts, c.hiddenSize]] } as LinearSpec,
      gateUp: experts.map((e) => e.gateUp),
      down: experts.map((e) => e.down),
      sharedInter: c.nSharedExperts * c.moeIntermediateSize,
    };
  }

  /** Every read `load` makes for this rank. */
  static shardPlan(source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): WeightRead[] {
    const s = Moe.specs(source, c, layer, shard);
    const reads = [...specReads(s.router), { name: `${s.p}gate.e_score_correction_bias`, shape: [c.nRoutedExperts] }];
    for (let e = 0; e < c.nRoutedExperts; e++) reads.push(...specReads(s.gateUp[e]), ...specReads(s.down[e]));
    if (c.nSharedExperts > 0) reads.push(...Mlp.shardPlan(source, `${s.p}shared_experts.`, s.sharedInter, c.hiddenSize, shard));
    return reads;
  }

  static bytes(source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): number {
    const s = Moe.specs(source, c, layer, shard);
    let total = linearBytes(source, s.router) + 4 * c.nRoutedExperts;
    total += linearBytes(source, s.gateUp[0], c.nRoutedExperts) + linearBytes(source, s.down[0], c.nRoutedExperts);
    if (c.nSharedExperts > 0) total += Mlp.bytes(source, `${s.p}shared_experts.`, s.sharedInter, c.hiddenSize, shard);
    return total;
  }

  static async load(b: KdtreeBackend, source: WeightReader, c: ModelConfig, layer: number, shard: Shard = WHOLE): Promise<Moe> {
    const s = Moe.specs(source, c, layer, shard);
    const done: DeviceLinear[] = [];
    const tensors: DeviceTensor[] = [];
    try {
      const router = await loadLinear(b, source, [s.router]);
      done.push(router);
      const bias = b.fromArray('f32', [c.nRoutedExperts], await source.readF32(`${s.p}gate.e_score_correction_bias`, [c.nRoutedExperts]));
      tensors.push(bias);
      const gateUp = await loadLinear(b, source, s.gateUp, { gateUp: true });
      done.push(gateUp);
      const down = await loadLinear(b, source, s.down);
      done.push(down);
      if (gateUp.kind !== down.kind) throw modelError(`${s.p}experts.*`, `gate/up are ${gateUp.kind} but down is ${down.kind}: quantize an expert's projections alike`, source.path);
      const shared = c.nSharedExperts > 0 ? await Mlp.load(b, source, `${s.p}shared_experts.`, s.sharedInter, c.hiddenSize, shard) : undefined;
      return new Moe(c, s.inter, router, bias, gateUp, down, shared);
    } catch (error) {
      freeLinears(b, ...done);
      b.free(...tensors);
      throw error;
    }
  }

  get floatGateUp(): boolean {
    return this.shared?.floatGateUp ?? false;
  }

  /** `x`: the normed hidden state the experts read; `routerX`: the same norm in f32 (x itself under f32 activations). */
  forward(b: KdtreeBackend, ws: Workspace, x: DeviceTensor, routerX: DeviceTensor, out: DeviceTensor, stream: number, mark?: (part: string) => void): void {
    const c = this.config;
    const T = x.shape[0];
    const logits = ws.get('routerLogits', T);
    const ids = ws.get('routeIds', T);
    const weights = ws.get('routeWeights', T);
    applyLinear(b, this.router, routerX, logits, stream);
    b.native.router({ logits, bias: this.bias, ids, weights, topk: c.numExpertsPerTok, nGroup: c.nGroup, topkGroup: c.topkGroup, normTopkProb: c.normTopkProb, scaling: c.routedScalingFactor, stream });
    mark?.('router');
    const act = view(ws.moeAct, [T * c.numExpertsPerTok, this.inter]);
    // [gate; up] experts with the SiLU epilogue: each (token, expert) row's silu(gate) * up, then
    // the down projections summed with the routing weights
    const experts = (w: DeviceLinear) => (w.kind === 'int4' ? { qw: w.qw, sc: w.sc, group: w.group } : { w: w.w });
    b.native.moeGemm({ x, ...experts(this.gateUp), ids, y: act, mode: 'gather', epilogue: 'siluMul', stream });
    b.native.moeGemm({ x: act, ...experts(this.down), ids, weights, y: out, mode: 'sum', stream });
    mark?.('routed');
    if (this.shared) {
      const shared = ws.get('sharedOut', T);
      this.shared.forward(b, ws, x, shared, stream);
      b.native.add({ a: out, b: shared, out, stream });
    }
  }

  dispose(b: KdtreeBackend): void {
    freeLinears(b, this.router, this.gateUp, this.down);
    b.free(this.bias);
    this.shared?.dispose(b);
  }
}
