/**
 * A whole DeepSeek-V3 / Kimi K2 model on the device, and its forward pass as queued ops:
 *
 *   x = embed[ids]                                              [T, hidden] f32, the residual stream
 *   per layer:  x += attn(rms_norm(x));  x += mlp_or_moe(rms_norm(x))
 *   logits = lm_head(rms_norm(x))                               for the rows asked for
 *
 * Each residual add is fused into the next rms_norm (same bits as add then norm), so a layer costs
 * no add of its own. Nothing in a pass reads back to the host: a step is a fixed list of ops over
 * fixed buffers, which is what lets it be captured once as a graph and replayed.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { isMoeLayer, ropeTables, softmaxScale, type ModelConfig } from '@kdtree/reference';
import { EngineError } from './errors.js';
import { MlaAttention, Mlp, Moe, type AttentionConstants, type Pass } from './layers.js';
import { applyLinear, linearBytes, linearTensors, loadLinear, view, type DeviceLinear } from './linear.js';
import type { WeightReader } from './model-source.js';
import { Workspace } from './workspace.js';

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

/** Device bytes of every weight of the model, by part (the memory estimate, and load progress). */
export function weightBytes(source: WeightReader, c: ModelConfig): { part: string; bytes: number }[] {
  const parts = [{ part: 'embeddings', bytes: c.vocabSize * c.hiddenSize * 2 }];
  for (let l = 0; l < c.numLayers; l++) {
    const mlp = isMoeLayer(c, l) ? Moe.bytes(source, c, l) : Mlp.bytes(source, `model.layers.${l}.mlp.`, c.intermediateSize, c.hiddenSize);
    parts.push({ part: `layer ${l}`, bytes: MlaAttention.bytes(source, c, l) + mlp + 8 * c.hiddenSize });
  }
  const lmHead = c.tieWordEmbeddings ? 'model.embed_tokens.weight' : 'lm_head.weight';
  parts.push({ part: 'lm_head', bytes: linearBytes(source, { names: [lmHead], shapes: [[c.vocabSize, c.hiddenSize]] }) + 4 * c.hiddenSize });
  return parts;
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
  ) {}

  /**
   * Loads every weight (streamed tensor by tensor) and allocates a workspace for passes of up to
   * `rows` tokens. Throws without leaking device memory if anything fails or `signal` aborts.
   */
  static async load(b: KdtreeBackend, source: WeightReader, options: { rows: number; onProgress?: (p: LoadProgress) => void; signal?: AbortSignal }): Promise<DeviceModel> {
    const c = source.config;
    const sizes = weightBytes(source, c);
    const total = sizes.reduce((s, p) => s + p.bytes, 0);
    let done = 0;
    const step = (i: number) => {
      options.signal?.throwIfAborted();
      done += sizes[i].bytes;
      options.onProgress?.({ bytesDone: done, bytesTotal: total, part: sizes[i].part });
    };
    const owned: { free(): void }[] = [];
    const track = <T extends DeviceTensor>(t: T): T => {
      owned.push({ free: () => b.free(t) });
      return t;
    };
    try {
      options.signal?.throwIfAborted();
      const embed = track(b.fromArray('bf16', [c.vocabSize, c.hiddenSize], (await source.readBf16('model.embed_tokens.weight', [c.vocabSize, c.hiddenSize])).bits));
      step(0);
      const layers: Layer[] = [];
      for (let l = 0; l < c.numLayers; l++) {
        const p = `model.layers.${l}.`;
        const inputNorm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32(`${p}input_layernorm.weight`, [c.hiddenSize])));
        const postNorm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32(`${p}post_attention_layernorm.weight`, [c.hiddenSize])));
        const attn = await MlaAttention.load(b, source, c, l);
        owned.push({ free: () => attn.dispose(b) });
        const mlp = isMoeLayer(c, l) ? await Moe.load(b, source, c, l) : await Mlp.load(b, source, `${p}mlp.`, c.intermediateSize, c.hiddenSize);
        owned.push({ free: () => mlp.dispose(b) });
        layers.push({ inputNorm, postNorm, attn, mlp });
        step(l + 1);
      }
      const norm = track(b.fromArray('f32', [c.hiddenSize], await source.readF32('model.norm.weight', [c.hiddenSize])));
      const lmName = c.tieWordEmbeddings ? 'model.embed_tokens.weight' : 'lm_head.weight';
      const lmHead = await loadLinear(b, source, [{ names: [lmName], shapes: [[c.vocabSize, c.hiddenSize]] }]);
      owned.push({ free: () => b.free(...linearTensors(lmHead)) });
      step(c.numLayers + 1);
      const rope = ropeTables(c);
      const constants = { invFreq: track(b.fromArray('f64', [rope.invFreq.length], rope.invFreq)), attentionFactor: rope.attentionFactor, scale: softmaxScale(c) };
      const floatGateUp = layers.some((l) => l.mlp.floatGateUp);
      const workspace = new Workspace(b, c, options.rows, floatGateUp);
      return new DeviceModel(b, c, embed, layers, norm, lmHead, constants, workspace);
    } catch (error) {
      for (const o of owned.reverse()) o.free();
      throw error;
    }
  }

  /**
   * Queues one forward pass of `pass.t` tokens (`ids`, i32 [T]) and, when `logits` is given, the
   * final norm and lm_head of its rows. `taps`: layer -> f32 [T, hidden] receiving the residual
   * stream after that layer (what a drafter of hidden states, or a test, reads). `mark(part)` is
   * called after each stage's ops are queued ('embedding'; per layer 'q L', 'kv L', 'mla L',
   * 'attention L' (o_proj), 'routed L' and 'moe L' (shared experts) or 'mlp L'; 'lm_head'): a
   * profiler records an event there.
   */
  forward(pass: Pass, ids: DeviceTensor, logits?: LogitRows, taps?: ReadonlyMap<number, DeviceTensor>, mark?: (part: string) => void): void {
    const { b, config: c, workspace: ws } = this;
    const { t: T, stream } = pass;
    if (mark !== undefined) pass = { ...pass, mark };
    if (T > ws.rows) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `a pass of ${T} tokens exceeds the workspace of ${ws.rows} rows`, 'tokens');
    const x = ws.get('x', T);
    const h = ws.get('h', T);
    const attnOut = ws.get('attnOut', T);
    const mlpOut = ws.get('mlpOut', T);
    b.native.embedding({ table: this.embed, ids, out: x, stream });
    mark?.('embedding');
    let pending = false; // mlpOut of the previous layer not yet added into x
    for (let l = 0; l < this.layers.length; l++) {
      const layer = this.layers[l];
      b.native.rmsNorm({ x, weight: layer.inputNorm, out: h, eps: c.rmsNormEps, ...(pending ? { residual: mlpOut, sum: x } : {}), stream });
      layer.attn.forward(b, ws, pass, l, this.constants, attnOut);
      mark?.(`attention ${l}`);
      b.native.rmsNorm({ x, weight: layer.postNorm, out: h, eps: c.rmsNormEps, residual: attnOut, sum: x, stream });
      if (layer.mlp instanceof Moe) layer.mlp.forward(b, ws, h, mlpOut, stream, mark && ((part) => mark(`${part} ${l}`)));
      else layer.mlp.forward(b, ws, h, mlpOut, stream);
      mark?.(`${layer.mlp instanceof Moe ? 'moe' : 'mlp'} ${l}`);
      pending = true;
      const tap = taps?.get(l);
      if (tap !== undefined) {
        b.native.add({ a: x, b: mlpOut, out: x, stream });
        b.native.copy({ dst: tap.buffer, dstOffset: tap.offset ?? 0, src: x.buffer, srcOffset: x.offset ?? 0, bytes: T * c.hiddenSize * 4, stream });
        pending = false;
      }
    }
    if (logits === undefined) {
      if (pending) b.native.add({ a: x, b: mlpOut, out: x, stream });
      return;
    }
    const { first, count, out } = logits;
    const xs = ws.rowsOf('x', first, count);
    const hs = ws.rowsOf('h', first, count);
    b.native.rmsNorm({ x: xs, weight: this.norm, out: hs, eps: c.rmsNormEps, ...(pending ? { residual: ws.rowsOf('mlpOut', first, count), sum: xs } : {}), stream });
    applyLinear(b, this.lmHead, hs, view(out, [count, c.vocabSize]), stream);
    mark?.('lm_head');
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
