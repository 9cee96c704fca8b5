/**
 * A whole DeepSeek-V3 / Kimi K2 model on the device, and its forward pass as queued ops:
 *
 *   x = embed[ids]                                              [T, hidden] f32, the residual stream
 *   per layer:  x += attn(rms_norm(x));  x += mlp_or_moe(rms_norm(x))
 *   logits = lm_head(rms_norm(x))                               for the rows asked for
 *
 * Each residual add is fused into the next rms_norm (same bits as add then norm), so a layer costs
 * no add of its own. Under tensor parallelism (a Shard and a Collective) the attention and MLP
 * outputs are all-reduced before they are added, and lm_head's vocabulary blocks all-gathered;
 * embeddings, norms and the residual stream are replicated, identical bits on every rank. Nothing in a pass reads back to the host: a step is a fixed list of ops over
 * fixed buffers, which is what lets it be captured once as a graph and replayed.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { isMoeLayer, ropeTables, softmaxScale, type ModelConfig } from '@kdtree/reference';
import type { Collective } from './collective.js';
import { EngineError, throwIfAborted } from './errors.js';
import { MlaAttention, Mlp, Moe, type AttentionConstants, type Pass } from './layers.js';
import { applyLinear, linearBytes, linearTensors, loadLinear, specReads, view, type DeviceLinear } from './linear.js';
import type { WeightReader } from './model-source.js';
import { blockRange, cutsOf, shardBlock, WHOLE, type Shard, type TensorCut, type WeightRead } from './shard.js';
import { Workspace, type ActivationDtype } from './workspace.js';

export interface LoadProgress {
  /** Device bytes of weights loaded so far, and in all. */
  bytesDone: number;
  bytesTotal: number;
  /** What was just loaded ('layer 3', 'lm_head'). */
  part: string;
}

interface Layer {
  inputNorm: DeviceTensor;
  postNorm: DeviceTensor;
  attn: MlaAttention;
  mlp: Mlp | Moe;
}

/** Which rows of a pass get logits, and where they go (f32 [count, vocab]). */
export interface LogitRows {
  first: number;
  count: number;
  out: DeviceTensor;
}

/** lm_head: column-parallel, each rank its block of the vocabulary's rows. */
function lmHeadSpec(c: ModelConfig, shard: Shard) {
  const name = c.tieWordEmbeddings ? 'model.embed_tokens.weight' : 'lm_head.weight';
  const shape = [c.vocabSize, c.hiddenSize] as const;
  const block = shardBlock(shard, c.vocabSize, { tensor: name, shape, dim: 'vocabulary' });
  return { names: [name], shapes: [shape], rows: [shard.world > 1 ? blockRange(block) : undefined] };
}

/** Device bytes of every weight of the model (this rank's shard of it), by part (the memory estimate, and load progress). */
export function weightBytes(source: WeightReader, c: ModelConfig, shard: Shard = WHOLE): { part: string; bytes: number }[] {
  const parts = [{ part: 'embeddings', bytes: c.vocabSize * c.hiddenSize * 2 }];
  for (let l = 0; l < c.numLayers; l++) {
    const mlp = isMoeLayer(c, l) ? Moe.bytes(source, c, l, shard) : Mlp.bytes(source, `model.layers.${l}.mlp.`, c.intermediateSize, c.hiddenSize, shard);
    parts.push({ part: `layer ${l}`, bytes: MlaAttention.bytes(source, c, l, shard) + mlp + 8 * c.hiddenSize });
  }
  parts.push({ part: 'lm_head', bytes: linearBytes(source, lmHeadSpec(c, shard)) + 4 * c.hiddenSize });
  return parts;
}

/**
 * What rank `shard` holds of every weight the model reads: the cuts of the reads DeviceModel.load
 * and each layer's load make (the layers' shardPlan), in load order. `kdtree shard` writes these
 * and a shard directory is checked against them, so the two cannot disagree.
 */
export function shardPlan(source: WeightReader, c: ModelConfig, shard: Shard = WHOLE): TensorCut[] {
  const H = [c.hiddenSize];
  const reads: WeightRead[] = [{ name: 'model.embed_tokens.weight', shape: [c.vocabSize, c.hiddenSize] }];
  for (let l = 0; l < c.numLayers; l++) {
    const p = `model.layers.${l}.`;
    reads.push({ name: `${p}input_layernorm.weight`, shape: H }, { name: `${p}post_attention_layernorm.weight`, shape: H });
    reads.push(...MlaAttention.shardPlan(source, c, l, shard));
    reads.push(...(isMoeLayer(c, l) ? Moe.shardPlan(source, c, l, shard) : Mlp.shardPlan(source, `${p}mlp.`, c.intermediateSize, c.hiddenSize, shard)));
  }
  reads.push({ name: 'model.norm.weight', shape: H }, ...specReads(lmHeadSpec(c, shard)));
  return cutsOf(reads);
}

export class DeviceModel {
  private constructor(
    readonly b: KdtreeBackend,
    readonly config: ModelConfig,
    private readonly embed: DeviceTensor,
    private readonly layers: Layer[],
    private readonly norm: DeviceTensor,
    private readonly lmHead: DeviceLinear,
    private readonly constants: AttentionConstants,
    readonly workspace: Workspace,
    /** The tensor-parallel ranks' collectives (absent on one device). */
    readonly collective: Collective | undefined,
  ) {}

  /**
   * Loads every weight (streamed tensor by tensor) and allocates a workspace for passes of up to
   * `rows` tokens. Throws without leaking device memory if anything fails or `signal` aborts.
   * `shard` and `collective`: this rank's slice of a tensor-parallel model, and its peers.
   */
  static async load(b: KdtreeBackend, source: WeightReader, options: { rows: number; activations?: ActivationDtype; shard?: Shard; collective?: Collective; onProgress?: (p: LoadProgress) => void; signal?: AbortSignal }): Promise<DeviceModel> {
    const c = source.config;
    const shard = options.shard ?? WHOLE;
    const collective = options.collective;
    if (shard.world > 1 && (collective === undefined || collective.world !== shard.world || collective.rank !== shard.rank)) {
      throw new EngineError('KDTREE_ENGINE_ARGUMENT', `rank ${shard.rank} of ${shard.world} needs a collective of the same rank and world`, 'collective');
    }
    const sizes = weightBytes(source, c, shard);
    const total = sizes.reduce((s, p) => s + p.bytes, 0);
    let done = 0;
    const step = (i: number) => {
      throwIfAborted(options.signal, 'loading the model');
      done += sizes[i].bytes;
      options.onProgress?.({ bytesDone: done, bytesTotal: total, part: sizes[i].part });
    };
    const owned: { free(): void }[] = [];
    const track = <T extends DeviceTensor>(t: T): T => {
      owned.push({ free: () => b.free(t) });
      return t;
    };
    try {
      throwIfAborted(options.signal, 'loading the model');
      const embed = track(b.fromArray('bf16', [c.vocabSize, c.hiddenSize], (await source.readBf16('model.embed_tokens.weight', [c.vocabSize, c.hiddenSize])).bits));
      step(0);
      const layers: Layer[] = [];
      for (let l = 0; l < c.numLayers; l++) {
        const p = `model.layers.${l}.`;
        const inputNorm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32(`${p}input_layernorm.weight`, [c.hiddenSize])));
        const postNorm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32(`${p}post_attention_layernorm.weight`, [c.hiddenSize])));
        const attn = await MlaAttention.load(b, source, c, l, shard);
        owned.push({ free: () => attn.dispose(b) });
        const mlp = isMoeLayer(c, l) ? await Moe.load(b, source, c, l, shard) : await Mlp.load(b, source, `${p}mlp.`, c.intermediateSize, c.hiddenSize, shard);
        owned.push({ free: () => mlp.dispose(b) });
        layers.push({ inputNorm, postNorm, attn, mlp });
        step(l + 1);
      }
      const norm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32('model.norm.weight', [c.hiddenSize])));
      const lmHead = await loadLinear(b, source, [lmHeadSpec(c, shard)]);
      owned.push({ free: () => b.free(...linearTensors(lmHead)) });
      step(c.numLayers + 1);
      const rope = ropeTables(c);
      const constants = { invFreq: track(b.fromArray('f64', [rope.invFreq.length], rope.invFreq)), attentionFactor: rope.attentionFactor, scale: softmaxScale(c) };
      const floatGateUp = layers.some((l) => l.mlp.floatGateUp);
      const workspace = new Workspace(b, c, options.rows, floatGateUp, shard.world, options.activations);
      // kept at world 1 too: one NCCL rank checks the collective path against the plain one
      return new DeviceModel(b, c, embed, layers, norm, lmHead, constants, workspace, collective);
    } catch (error) {
      for (const o of owned.reverse()) o.free();
      throw error;
    }
  }

  /**
   * Queues one forward pass of `pass.t` tokens (`ids`, i32 [T]) and, when `logits` is given, the
   * final norm and lm_head of its rows. `taps`: layer -> f32 [T, hidden] receiving the residual
   * stream after that layer (what a drafter of hidden states, or a test, reads). `mark(part)` is
   * called after each stage's ops are queued ('embedding'; per layer 'kv L' (the input norm,
   * [q_a; kv_a] and mla_inputs), 'q L' (q_b and mla_query), 'mla L', 'attention L' (o_proj),
   * 'routed L' and 'moe L' (shared experts) or 'mlp L'; 'lm_head'): a profiler records an event
   * there.
   */
  forward(pass: Pass, ids: DeviceTensor, logits?: LogitRows, taps?: ReadonlyMap<number, DeviceTensor>, mark?: (part: string) => void): void {
    const { b, config: c, workspace: ws, collective } = this;
    const { t: T, stream } = pass;
    if (mark !== undefined) pass = { ...pass, mark };
    if (T > ws.rows) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `a pass of ${T} tokens exceeds the workspace of ${ws.rows} rows`, 'tokens');
    const x = ws.get('x', T);
    const h = ws.get('h', T);
    const attnOut = ws.get('attnOut', T);
    const mlpOut = ws.get('mlpOut', T);
    b.native.embedding({ table: this.embed, ids, out: x, stream });
    mark?.('embedding');
    // A layer's output, x + mlpOut, is summed by the next layer's input norm (rmsNorm's residual
    // form) into x, or into the layer's tap where it has one: the tap then holds the residual
    // stream, which that layer's post-attention norm reads and sums on into x. A tap costs no op of
    // its own (no add, and no copy, which in a captured step would be a memcpy node between kernels).
    const tapOf = (l: number) => {
      const tap = taps?.get(l);
      return tap && view(tap, [T, c.hiddenSize]);
    };
    for (let l = 0; l < this.layers.length; l++) {
      const layer = this.layers[l];
      const layerIn = l === 0 ? x : (tapOf(l - 1) ?? x); // where the residual stream into this layer is
      b.native.rmsNorm({ x, weight: layer.inputNorm, out: h, eps: c.rmsNormEps, ...(l > 0 ? { residual: mlpOut, sum: layerIn } : {}), stream });
      layer.attn.forward(b, ws, pass, l, this.constants, attnOut);
      collective?.allReduceSum(attnOut, stream);
      mark?.(`attention ${l}`);
      if (layer.mlp instanceof Moe) {
        // bf16 h for the experts and an f32 copy of the same norm for the router, from one pass
        const hRouter = ws.activations === 'bf16' ? ws.get('hRouter', T) : h;
        b.native.rmsNorm({ x: layerIn, weight: layer.postNorm, eps: c.rmsNormEps, residual: attnOut, sum: x, stream, ...(hRouter === h ? { out: h } : { out: hRouter, outBf16: h }) });
        layer.mlp.forward(b, ws, h, hRouter, mlpOut, stream, mark && ((part) => mark(`${part} ${l}`)));
      } else {
        b.native.rmsNorm({ x: layerIn, weight: layer.postNorm, out: h, eps: c.rmsNormEps, residual: attnOut, sum: x, stream });
        layer.mlp.forward(b, ws, h, mlpOut, stream);
      }
      collective?.allReduceSum(mlpOut, stream);
      mark?.(`${layer.mlp instanceof Moe ? 'moe' : 'mlp'} ${l}`);
    }
    // the last layer's output: into its tap (every row) where it has one, else summed by the final norm
    const lastTap = tapOf(this.layers.length - 1);
    if (logits === undefined || lastTap !== undefined) b.native.add({ a: x, b: mlpOut, out: lastTap ?? x, stream });
    if (logits === undefined) return;
    const { first, count, out } = logits;
    const xs = lastTap === undefined ? ws.rowsOf('x', first, count) : view(lastTap, [count, c.hiddenSize], first * c.hiddenSize);
    const hs = ws.rowsOf('h', first, count);
    b.native.rmsNorm({ x: xs, weight: this.norm, out: hs, eps: c.rmsNormEps, ...(lastTap === undefined ? { residual: ws.rowsOf('mlpOut', first, count), sum: xs } : {}), stream });
    // one rank holds the whole vocabulary: its all-gather would be the identity
    if (collective === undefined || collective.world === 1) applyLinear(b, this.lmHead, hs, view(out, [count, c.vocabSize]), stream);
    else {
      const local = ws.get('lmLocal', count);
      applyLinear(b, this.lmHead, hs, local, stream);
      collective.allGather(local, view(out, [count, c.vocabSize]), stream);
    }
    mark?.('lm_head');
  }

  /**
   * What a DFlash drafter borrows from its target (DflashDrafter): embed_tokens (bf16 [vocab,
   * hidden]) for its block's input, lm_head for its per-depth logits, and the final norm for a tap
   * of the last layer. On one device only: under tensor parallelism lm_head is this rank's block.
   */
  get embedTokens(): DeviceTensor {
    return this.embed;
  }

  get lmHeadWeight(): DeviceLinear {
    return this.lmHead;
  }

  get finalNorm(): DeviceTensor {
    return this.norm;
  }

  dispose(): void {
    const b = this.b;
    this.workspace.dispose();
    for (const l of this.layers) {
      l.attn.dispose(b);
      l.mlp.dispose(b);
      b.free(l.inputNorm, l.postNorm);
    }
    b.free(this.embed, this.norm, this.constants.invFreq, ...linearTensors(this.lmHead));
  }
}
