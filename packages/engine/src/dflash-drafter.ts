/**
 * A DFlash drafter (z-lab's DFlashDraftModel) on the engine's backend: one forward of a small
 * non-causal model over the target's hidden states drafts every depth of a block at once. The f32
 * golden is @kdtree/reference's DflashModel; this is the same arithmetic as queued ops.
 *
 *   commit (the target's hidden states of newly committed tokens, [rows, hidden] per tapped layer):
 *     ctx = hidden_norm(fc(concat(taps)))         fc as one GEMM per tapped layer's block of K, summed
 *     per layer: k = rope(k_norm(k_proj(ctx))), v = v_proj(ctx) -> the drafter's context cache at
 *                positions [length, length + rows); length += rows
 *   draft (the root = the last emitted token, not committed yet):
 *     x = target.embed_tokens([root, mask x (B - 1)])               at positions length..length+B-1
 *     per layer: h = input_norm(x); q = rope(q_norm(q_proj(h))); k, v of h as above (block only)
 *                x += o_proj(gqa_attention(q, [context cache; block k/v]))   non-causal
 *                x += down(silu(gate(h')) * up(h')), h' = post_norm(x)
 *     out[d - 1] = target.lm_head(norm(x)[d])                       depths d = 1..depth
 *
 * The cache holds only committed context: the block's keys live in scratch buffers and are gone
 * after the forward, which is the public implementation's crop back to the committed length each
 * round. Weights stay bf16 as the checkpoint stores them (the engine's bf16 GEMM); activations,
 * the cache and every sum are f32.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { bf16ArrayToF32, f32ArrayToBf16, openTensors, typedView, type AnyTensorStore } from '@kdtree/format';
import { floatToF32 } from '@kdtree/quant';
import { checkDflashPairing, checkDflashTensors, dflashWeightPrefix, parseDflashConfig, PairingError, ropeTablesFor, type DflashConfig } from '@kdtree/reference';
import type { Drafter, DraftRequest } from './drafters.js';
import { EngineError, modelError } from './errors.js';
import { applyLinear, linearTensors, loadLinear, view, type DeviceLinear, type LinearSource } from './linear.js';
import type { DeviceModel } from './model.js';
import { configFor, pickCols, type HostBf16 } from './model-source.js';

interface DflashLayer {
  inputNorm: DeviceTensor;
  postNorm: DeviceTensor;
  qNorm: DeviceTensor;
  kNorm: DeviceTensor;
  q: DeviceLinear;
  k: DeviceLinear;
  v: DeviceLinear;
  o: DeviceLinear;
  gateUp: DeviceLinear;
  down: DeviceLinear;
  /** f32 [capacity, kv_heads, head_dim]: the context's keys (normed, rotated) and values. */
  kCache: DeviceTensor;
  vCache: DeviceTensor;
}

/** A drafter checkpoint's tensors as the engine's loaders read them (bf16 bits, f32 for norms). */
class DrafterTensors implements LinearSource {
  constructor(
    readonly path: string,
    private readonly store: AnyTensorStore,
    private readonly prefix: string,
  ) {}

  int4(): undefined {
    return undefined;
  }

  private async floats(name: string, shape: readonly number[]): Promise<{ bits?: Uint16Array; f32?: Float32Array }> {
    const full = this.prefix + name;
    const info = this.store.get(full);
    if (info.shape.length !== shape.length || info.shape.some((d, i) => d !== shape[i])) throw modelError(full, `has shape [${info.shape.join(', ')}], the drafter config needs [${shape.join(', ')}]`, this.path);
    const bytes = await this.store.read(full);
    if (info.dtype === 'BF16') return { bits: typedView('BF16', bytes) };
    if (info.dtype === 'F16' || info.dtype === 'F32') return { f32: floatToF32(info.dtype, bytes, full) };
    throw modelError(full, `is ${info.dtype}; a DFlash drafter's weights are float (BF16, F16 or F32)`, this.path);
  }

  async readF32(name: string, shape: readonly number[]): Promise<Float32Array> {
    const { bits, f32 } = await this.floats(name, shape);
    return f32 ?? bf16ArrayToF32(bits!);
  }

  async readBf16(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: { start: number; count: number }): Promise<HostBf16> {
    if (rows !== undefined) throw modelError(this.prefix + name, 'a drafter weight is read whole or by columns', this.path);
    const { bits: raw, f32 } = await this.floats(name, shape);
    const bits = raw ?? f32ArrayToBf16(f32!);
    if (cols === undefined) return { rows: shape[0], cols: shape[1], bits };
    return { rows: shape[0], cols: cols.count, bits: pickCols(bits, shape[1], cols.start, cols.count) };
  }

  async readInt4(name: string): Promise<never> {
    throw modelError(this.prefix + name, 'is not INT4 (a DFlash drafter is float)', this.path);
  }
}

export class DflashDrafter implements Drafter {
  readonly vocabSize: number;
  /** block_size - 1: one forward drafts every depth. */
  readonly maxDepth: number;
  readonly defaultDepth: number;
  readonly targetLayers: readonly number[];
  /** Context positions in the drafter's cache (the target's committed tokens it has seen). */
  private length = 0;
  private readonly owned: DeviceTensor[] = [];
  private readonly scale: number;
  private readonly attentionFactor: number;
  private readonly invFreq: DeviceTensor;
  /** f32 scratch: [max(commit rows, block size), width] for the context side, [block size, width] for the block's. */
  private readonly buf: Record<'ctx' | 'part' | 'normed' | 'tap' | 'x' | 'h' | 'o' | 'q' | 'qn' | 'kRaw' | 'kb' | 'vb' | 'attn' | 'gateUp' | 'act' | 'mlp', DeviceTensor>;
  private readonly ids: DeviceTensor;
  private readonly positions: DeviceTensor;

  private constructor(
    private readonly b: KdtreeBackend,
    readonly config: DflashConfig,
    readonly name: string,
    private readonly target: DeviceModel,
    private readonly fc: DeviceLinear[],
    private readonly hiddenNorm: DeviceTensor,
    private readonly layers: DflashLayer[],
    private readonly norm: DeviceTensor,
    /** Context positions the cache holds (the target's KV capacity). */
    readonly capacity: number,
    /** Rows one commit may bring (the target's largest pass). */
    readonly maxRows: number,
  ) {
    const c = config;
    this.vocabSize = c.vocabSize;
    this.maxDepth = c.blockSize - 1;
    this.defaultDepth = this.maxDepth;
    this.targetLayers = c.targetLayerIds;
    const rope = ropeTablesFor(c.rope, c.maxPositionEmbeddings, c.headDim);
    this.scale = c.headDim ** -0.5;
    this.attentionFactor = rope.attentionFactor;
    const rows = Math.max(maxRows, c.blockSize);
    const H = c.hiddenSize;
    const qw = c.numHeads * c.headDim;
    const kw = c.numKvHeads * c.headDim;
    const f32 = (width: number, n = rows) => this.own(b.empty('f32', [n, width]));
    try {
      this.invFreq = this.own(b.fromArray('f64', [rope.invFreq.length], rope.invFreq));
      // a commit's rows for the context side, the block's B rows for the rest
      const B = c.blockSize;
      this.buf = {
        ctx: f32(H), part: f32(H), normed: f32(H), tap: f32(H), kRaw: f32(kw),
        x: f32(H, B), h: f32(H, B), o: f32(H, B), q: f32(qw, B), qn: f32(qw, B), kb: f32(kw, B), vb: f32(kw, B), attn: f32(qw, B),
        gateUp: f32(2 * c.intermediateSize, B), act: f32(c.intermediateSize, B), mlp: f32(H, B),
      };
      this.ids = this.own(b.zeros('i32', [c.blockSize]));
      this.positions = this.own(b.zeros('i32', [rows]));
    } catch (error) {
      // the weights are the loader's to free (it still holds them)
      b.free(...this.owned);
      throw error;
    }
  }

  /**
   * Loads a drafter (a KDTR bundle from `kdtree import`, or a directory / safetensors file with its
   * config.json) for `target`, which lends it embed_tokens, lm_head and (for a tap of its last
   * layer) its final norm. Throws KDTREE_ENGINE_DRAFTER with checkDflashPairing's message when the
   * drafter does not fit the target.
   */
  static async load(b: KdtreeBackend, path: string, target: DeviceModel, options: { capacity: number; maxRows: number; name?: string }): Promise<DflashDrafter> {
    const store = await openTensors(path);
    const owned: { free(): void }[] = [];
    try {
      const { json, source } = await configFor(store, path);
      const config = parseDflashConfig(json, source);
      try {
        checkDflashPairing(config, target.config, { drafter: path, target: 'the target model' });
      } catch (error) {
        if (error instanceof PairingError) throw new EngineError('KDTREE_ENGINE_DRAFTER', error.message, 'drafter', { cause: error });
        throw error;
      }
      checkDflashTensors(config, [...store.tensors], path);
      const prefix = dflashWeightPrefix(store) ?? '';
      const src = new DrafterTensors(path, store, prefix);
      const c = config;
      const H = c.hiddenSize;
      const D = c.headDim;
      const linear = async (names: string[], shapes: [number, number][], cols?: { start: number; count: number }, gateUp = false) => {
        const w = await loadLinear(b, src, [{ names, shapes, cols }], { gateUp });
        owned.push({ free: () => b.free(...linearTensors(w)) });
        return w;
      };
      const vector = async (name: string, n: number) => {
        const t = b.fromArray('f32', [n], await src.readF32(name, [n]));
        owned.push({ free: () => b.free(t) });
        return t;
      };
      const taps = c.targetLayerIds.length;
      const fc: DeviceLinear[] = [];
      // fc's K is the tapped layers' states side by side: one GEMM per layer's block of K, summed,
      // so the engine hands over each layer's tap as it is, never a concatenated copy
      for (let j = 0; j < taps; j++) fc.push(await linear(['fc.weight'], [[H, taps * H]], { start: j * H, count: H }));
      const hiddenNorm = await vector('hidden_norm.weight', H);
      const layers: DflashLayer[] = [];
      for (let l = 0; l < c.numLayers; l++) {
        const p = `layers.${l}.`;
        const a = `${p}self_attn.`;
        const kvShape: [number, number] = [c.numKvHeads * D, H];
        const cache = () => {
          const t = b.zeros('f32', [options.capacity, c.numKvHeads, D]);
          owned.push({ free: () => b.free(t) });
          return t;
        };
        layers.push({
          inputNorm: await vector(`${p}input_layernorm.weight`, H),
          postNorm: await vector(`${p}post_attention_layernorm.weight`, H),
          qNorm: await vector(`${a}q_norm.weight`, D),
          kNorm: await vector(`${a}k_norm.weight`, D),
          q: await linear([`${a}q_proj.weight`], [[c.numHeads * D, H]]),
          k: await linear([`${a}k_proj.weight`], [kvShape]),
          v: await linear([`${a}v_proj.weight`], [kvShape]),
          o: await linear([`${a}o_proj.weight`], [[H, c.numHeads * D]]),
          gateUp: await linear([`${p}mlp.gate_proj.weight`, `${p}mlp.up_proj.weight`], [[c.intermediateSize, H], [c.intermediateSize, H]], undefined, true),
          down: await linear([`${p}mlp.down_proj.weight`], [[H, c.intermediateSize]]),
          kCache: cache(),
          vCache: cache(),
        });
      }
      const norm = await vector('norm.weight', H);
      return new DflashDrafter(b, config, options.name ?? `dflash:${path}`, target, fc, hiddenNorm, layers, norm, options.capacity, options.maxRows);
    } catch (error) {
      for (const o of owned.reverse()) o.free();
      throw error;
    } finally {
      await store.close();
    }
  }

  private own(t: DeviceTensor): DeviceTensor {
    this.owned.push(t);
    return t;
  }

  /** Committed context positions the drafter holds. */
  get contextLength(): number {
    return this.length;
  }

  begin(): void {
    this.length = 0;
  }

  /**
   * The target's hidden states of the next `rows` committed tokens: `hidden[j]` f32 [rows, hidden]
   * after layer targetLayers[j] (the residual stream; for the target's last layer the drafter
   * applies the target's final norm, as transformers' hidden_states holds it). Their keys and
   * values join the context cache.
   */
  commit(hidden: readonly DeviceTensor[], rows: number): void {
    const b = this.b;
    const c = this.config;
    const H = c.hiddenSize;
    if (hidden.length !== this.targetLayers.length) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `the DFlash drafter taps ${this.targetLayers.length} layers, the commit brought ${hidden.length}`, 'hidden');
    if (!Number.isInteger(rows) || rows < 1 || rows > this.maxRows) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `a commit brings 1..${this.maxRows} rows, got ${rows}`, 'rows');
    if (this.length + rows > this.capacity) throw new EngineError('KDTREE_ENGINE_CAPACITY', `the DFlash drafter's context cache holds ${this.capacity} positions; ${this.length} + ${rows} do not fit`, 'cacheTokens');
    const last = this.target.config.numLayers - 1;
    const ctx = view(this.buf.ctx, [rows, H]);
    const part = view(this.buf.part, [rows, H]);
    hidden.forEach((tap, j) => {
      let x = view(tap, [rows, H]);
      if (this.targetLayers[j] === last) {
        // the last layer's entry of output_hidden_states is the model's normed output
        const normed = view(this.buf.tap, [rows, H]);
        b.native.rmsNorm({ x, weight: this.target.finalNorm, out: normed, eps: this.target.config.rmsNormEps, stream: 0 });
        x = normed;
      }
      applyLinear(b, this.fc[j], x, j === 0 ? ctx : part, 0);
      if (j > 0) b.native.add({ a: ctx, b: part, out: ctx, stream: 0 });
    });
    const normed = view(this.buf.normed, [rows, H]);
    b.native.rmsNorm({ x: ctx, weight: this.hiddenNorm, out: normed, eps: c.rmsNormEps, stream: 0 });
    const positions = view(this.positions, [rows]);
    b.native.arange({ out: positions, start: this.length, stream: 0 });
    const width = c.numKvHeads * c.headDim;
    for (const layer of this.layers) {
      const k = view(layer.kCache, [rows, width], this.length * width);
      this.keys(layer, normed, rows, positions, k);
      applyLinear(b, layer.v, normed, view(layer.vCache, [rows, width], this.length * width), 0);
    }
    this.length += rows;
  }

  /** k = rope(k_norm(k_proj(x))) for `rows` rows into `out` [rows, kv_heads * head_dim]. */
  private keys(layer: DflashLayer, x: DeviceTensor, rows: number, positions: DeviceTensor, out: DeviceTensor): void {
    const b = this.b;
    const { numKvHeads: nkv, headDim: D, rmsNormEps: eps } = this.config;
    const raw = view(this.buf.kRaw, [rows, nkv * D]);
    applyLinear(b, layer.k, x, raw, 0);
    b.native.rmsNorm({ x: view(raw, [rows * nkv, D]), weight: layer.kNorm, out: view(out, [rows * nkv, D]), eps, stream: 0 });
    b.native.rope({ x: view(out, [rows, nkv, D]), positions, invFreq: this.invFreq, attentionFactor: this.attentionFactor, interleave: false, stream: 0 });
  }

  draft({ tokens, depth, out }: DraftRequest): void {
    const b = this.b;
    const c = this.config;
    const { hiddenSize: H, blockSize: B, numHeads: nq, numKvHeads: nkv, headDim: D, rmsNormEps: eps } = c;
    if (!Number.isInteger(depth) || depth < 1 || depth > this.maxDepth) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `depth must be in [1, ${this.maxDepth}] (block_size ${B}), got ${depth}`, 'depth');
    // every committed token's hidden states must have arrived: the root is the one token after them
    if (tokens.length - 1 !== this.length) {
      throw new EngineError('KDTREE_ENGINE_ARGUMENT', `the DFlash drafter holds the hidden states of ${this.length} tokens, but the sequence has ${tokens.length - 1} committed before its root: commit() each step's accepted rows`, 'hidden');
    }
    if (this.length + B > c.maxPositionEmbeddings) throw new EngineError('KDTREE_ENGINE_CAPACITY', `the block at positions ${this.length}.. passes the drafter's max_position_embeddings ${c.maxPositionEmbeddings}`, 'tokens');
    b.native.upload(this.ids.buffer, Int32Array.from({ length: B }, (_, i) => (i === 0 ? tokens[tokens.length - 1] : c.maskTokenId)));
    const positions = view(this.positions, [B]);
    b.native.arange({ out: positions, start: this.length, stream: 0 });
    const x = view(this.buf.x, [B, H]);
    const h = view(this.buf.h, [B, H]);
    const o = view(this.buf.o, [B, H]);
    const mlp = view(this.buf.mlp, [B, H]);
    const q = view(this.buf.q, [B, nq * D]);
    const qn = view(this.buf.qn, [B, nq * D]);
    const kb = view(this.buf.kb, [B, nkv * D]);
    const vb = view(this.buf.vb, [B, nkv * D]);
    const attn = view(this.buf.attn, [B, nq * D]);
    const gateUp = view(this.buf.gateUp, [B, 2 * c.intermediateSize]);
    const act = view(this.buf.act, [B, c.intermediateSize]);
    b.native.embedding({ table: this.target.embedTokens, ids: this.ids, out: x, stream: 0 });
    for (const layer of this.layers) {
      b.native.rmsNorm({ x, weight: layer.inputNorm, out: h, eps, stream: 0 });
      applyLinear(b, layer.q, h, q, 0);
      b.native.rmsNorm({ x: view(q, [B * nq, D]), weight: layer.qNorm, out: view(qn, [B * nq, D]), eps, stream: 0 });
      b.native.rope({ x: view(qn, [B, nq, D]), positions, invFreq: this.invFreq, attentionFactor: this.attentionFactor, interleave: false, stream: 0 });
      this.keys(layer, h, B, positions, kb);
      applyLinear(b, layer.v, h, vb, 0);
      b.native.gqaAttention({
        q: view(qn, [B, nq, D]),
        kCache: layer.kCache,
        vCache: layer.vCache,
        k: view(kb, [B, nkv, D]),
        v: view(vb, [B, nkv, D]),
        out: view(attn, [B, nq, D]),
        contextLength: this.length,
        scale: this.scale,
        stream: 0,
      });
      applyLinear(b, layer.o, attn, o, 0);
      // x += o, fused into the post-attention norm
      b.native.rmsNorm({ x, weight: layer.postNorm, out: h, eps, residual: o, sum: x, stream: 0 });
      applyLinear(b, layer.gateUp, h, act, 0, gateUp);
      applyLinear(b, layer.down, act, mlp, 0);
      b.native.add({ a: x, b: mlp, out: x, stream: 0 });
    }
    // depths 1..depth are block rows 1..depth
    const rows = view(this.buf.x, [depth, H], H);
    const normed = view(this.buf.h, [depth, H]);
    b.native.rmsNorm({ x: rows, weight: this.norm, out: normed, eps, stream: 0 });
    applyLinear(b, this.target.lmHeadWeight, normed, view(out, [depth, c.vocabSize]), 0);
  }

  dispose(): void {
    const b = this.b;
    for (const w of this.fc) b.free(...linearTensors(w));
    this.fc.length = 0;
    for (const l of this.layers) {
      for (const w of [l.q, l.k, l.v, l.o, l.gateUp, l.down]) b.free(...linearTensors(w));
      b.free(l.inputNorm, l.postNorm, l.qNorm, l.kNorm, l.kCache, l.vCache);
    }
    this.layers.length = 0;
    b.free(this.hiddenNorm, this.norm);
    b.free(...this.owned);
    this.owned.length = 0;
  }
}
