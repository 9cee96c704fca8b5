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
 * round. Weights stay bf16 as the checkpoint stores them (the engine's bf16 GEMM); the GEMMs read
 * the engine's activation dtype (bf16 on cuda, f32 on the cpu twin); the residual stream, queries,
 * keys, the cache and every sum are f32.
 *
 * Graphs: a forward is ~17 ops a layer, and a native call costs the host 12-25 us on an H200, so a
 * drafter of Kimi K2.5-DFlash's 6 layers queued op by op would cost the host more than the GPU
 * spends. The drafter therefore keeps the committed length on the device too (positions, cache
 * slots and the attention's context length are read there) and replays each forward as one
 * captured graph: one per depth for draft(), one per row count up to the block size for commit()
 * (a step's accepted rows; a larger commit, a prefill's or one of rows held back while auto
 * decodes without drafting, runs op by op).
 */
import type { DeviceTensor, Graph, KdtreeBackend } from '@kdtree/cuda';
import { bf16ArrayToF32, f32ArrayToBf16, openTensors, typedView, type AnyTensorStore } from '@kdtree/format';
import { floatToF32 } from '@kdtree/quant';
import { checkDflashPairing, checkDflashTensors, ConfigError, configFor, dflashWeightPrefix, parseDflashConfig, PairingError, ropeTablesFor, type DflashConfig } from '@kdtree/reference';
import type { Drafter, DraftRequest } from './drafters.js';
import { EngineError, modelError } from './errors.js';
import { applyLinear, linearTensors, loadLinear, view, type DeviceLinear, type LinearSource } from './linear.js';
import { checkFits, estimateDflashMemory } from './memory.js';
import type { DeviceModel } from './model.js';
import { pickCols, type HostBf16 } from './model-source.js';
import type { ActivationDtype } from './workspace.js';

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
  /** f32 [capacity, kv_heads, head_dim]: the context's keys (normed, rotated) and values, written at the committed slots. */
  kCache: DeviceTensor;
  vCache: DeviceTensor;
}

/** Where a drafter's tensors come from: its checkpoint, or seeded values for a benchmark. */
export type DrafterWeights = LinearSource & { readF32(name: string, shape: readonly number[]): Promise<Float32Array> };

export interface DflashLoadOptions {
  /** Context positions the drafter's cache holds (the target's KV capacity). */
  capacity: number;
  /** Rows one commit may bring (the target's largest pass). */
  maxRows: number;
  /** Rows of taps the engine holds back for it while `auto` decodes without drafting (f32, a buffer per distinct tapped layer): counted in its memory. */
  heldRows?: number;
  name?: string;
  /**
   * The dtype of the activations its GEMMs read (the normed inputs, the attention output, the MLP's
   * activation): bf16 (the engine's default on cuda) halves what the bf16 GEMM does for each of them
   * next to f32's three planes; f32 (the cpu twin's default) is the reference's arithmetic. The
   * residual stream, the queries and keys, the cache and every sum stay f32.
   */
  activations?: ActivationDtype;
}

/** A drafter checkpoint's tensors as the engine's loaders read them (bf16 bits, f32 for norms). */
class DrafterTensors implements DrafterWeights {
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
  /** Scratch (f32, or the activation dtype where a GEMM reads it): [max(commit rows, block size), width] for the context side, [block size, width] for the block's. */
  private readonly buf: Record<'ctx' | 'part' | 'normed' | 'tap' | 'kRaw' | 'kc' | 'vc' | 'x' | 'h' | 'o' | 'q' | 'qn' | 'kb' | 'vb' | 'attn' | 'gateUp' | 'act' | 'mlp', DeviceTensor>;
  private readonly ids: DeviceTensor;
  private readonly positions: DeviceTensor;
  /** i32 [1]: the committed length on the device (kept equal to `length`), which the graphs read. */
  private readonly lengthOnDevice: DeviceTensor;
  /** Captured forwards by what they bake in (depth or rows, and the tensors they read or write). */
  private readonly graphs = new Map<string, Graph>();
  private captureStream = -1;

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
    readonly activations: ActivationDtype,
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
    // what the GEMMs read
    const act = (width: number, n = rows) => this.own(b.empty(activations, [n, width]));
    try {
      this.invFreq = this.own(b.fromArray('f64', [rope.invFreq.length], rope.invFreq));
      // a commit's rows for the context side, the block's B rows for the rest
      const B = c.blockSize;
      this.buf = {
        ctx: f32(H), part: f32(H), normed: act(H), tap: act(H), kRaw: f32(kw), kc: f32(kw), vc: f32(kw),
        x: f32(H, B), h: act(H, B), o: f32(H, B), q: f32(qw, B), qn: f32(qw, B), kb: f32(kw, B), vb: f32(kw, B), attn: act(qw, B),
        gateUp: f32(2 * c.intermediateSize, B), act: act(c.intermediateSize, B), mlp: f32(H, B),
      };
      // the block's ids: the root, then the mask token (set here once: draft() writes only the root)
      this.ids = this.own(b.fromArray('i32', [B], Int32Array.from({ length: B }, () => c.maskTokenId)));
      this.positions = this.own(b.zeros('i32', [rows]));
      this.lengthOnDevice = this.own(b.zeros('i32', [1]));
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
  static async load(b: KdtreeBackend, path: string, target: DeviceModel, options: DflashLoadOptions): Promise<DflashDrafter> {
    const store = await openTensors(path);
    try {
      const { json, source } = await configFor(store, path).catch((error: unknown) => {
        // configFor's hint (--config) is the target's flag: a drafter's config sits beside its weights
        if (!(error instanceof ConfigError && error.field === 'config.json')) throw error;
        throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter dflash:${path}: no config.json beside its weights; a DFlash drafter is its directory (config.json + safetensors) or the bundle \`kdtree import\` makes of it`, 'drafter', { cause: error });
      });
      const config = parseDflashConfig(json, source);
      checkDflashTensors(config, [...store.tensors], path);
      const prefix = dflashWeightPrefix(store) ?? '';
      return await DflashDrafter.fromWeights(b, config, new DrafterTensors(path, store, prefix), target, { name: `dflash:${path}`, ...options });
    } finally {
      await store.close();
    }
  }

  /**
   * A drafter of `config` whose tensors (under the public checkpoint's names, no prefix) come from
   * `weights`: a checkpoint (load) or seeded values (a benchmark at Kimi K2.5-DFlash's size).
   * Throws KDTREE_ENGINE_DRAFTER when it does not fit the target, and KDTREE_ENGINE_MEMORY when it
   * does not fit the device.
   */
  static async fromWeights(b: KdtreeBackend, config: DflashConfig, weights: DrafterWeights, target: DeviceModel, options: DflashLoadOptions): Promise<DflashDrafter> {
    checkPairing(config, target, weights.path);
    checkFits(b, estimateDflashMemory(config, options), `DFlash drafter ${weights.path}`);
    const owned: { free(): void }[] = [];
    try {
      const c = config;
      const H = c.hiddenSize;
      const D = c.headDim;
      const linear = async (names: string[], shapes: [number, number][], cols?: { start: number; count: number }, gateUp = false) => {
        const w = await loadLinear(b, weights, [{ names, shapes, cols }], { gateUp });
        owned.push({ free: () => b.free(...linearTensors(w)) });
        return w;
      };
      const vector = async (name: string, n: number) => {
        const t = b.fromArray('f32', [n], await weights.readF32(name, [n]));
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
      return new DflashDrafter(b, config, options.name ?? `dflash:${weights.path}`, target, fc, hiddenNorm, layers, norm, options.capacity, options.maxRows, options.activations ?? 'f32');
    } catch (error) {
      for (const o of owned.reverse()) o.free();
      throw error;
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
    this.b.native.upload(this.lengthOnDevice.buffer, Int32Array.of(0));
  }

  /** Replays the graph `key` (capturing `queue` on first use) on stream 0. */
  private replay(key: string, queue: (stream: number) => void): void {
    const b = this.b;
    let g = this.graphs.get(key);
    if (g === undefined) {
      if (this.captureStream < 0) this.captureStream = b.native.createStream();
      const stream = this.captureStream;
      g = b.capture(stream, () => queue(stream));
      this.graphs.set(key, g);
    }
    b.native.launchGraph(g, 0);
  }

  /**
   * The target's hidden states of the next `rows` committed tokens: `hidden[j]` f32 [rows, hidden]
   * after layer targetLayers[j] (the residual stream; for the target's last layer the drafter
   * applies the target's final norm, as transformers' hidden_states holds it). Their keys and
   * values join the context cache.
   */
  commit(hidden: readonly DeviceTensor[], rows: number): void {
    const c = this.config;
    if (hidden.length !== this.targetLayers.length) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `the DFlash drafter taps ${this.targetLayers.length} layers, the commit brought ${hidden.length}`, 'hidden');
    if (!Number.isInteger(rows) || rows < 1 || rows > this.maxRows) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `a commit brings 1..${this.maxRows} rows, got ${rows}`, 'rows');
    if (this.length + rows > this.capacity) throw new EngineError('KDTREE_ENGINE_CAPACITY', `the DFlash drafter's context cache holds ${this.capacity} positions; ${this.length} + ${rows} do not fit`, 'cacheTokens');
    const queue = (stream: number) => this.queueCommit(hidden, rows, stream);
    if (rows <= c.blockSize) this.replay(`commit ${rows} ${hidden.map(tensorKey).join(' ')}`, queue);
    else queue(0);
    this.length += rows;
  }

  /** commit()'s ops: the context rows' keys and values into the cache at the committed slots, the length on the device moved on. */
  private queueCommit(hidden: readonly DeviceTensor[], rows: number, stream: number): void {
    const b = this.b;
    const c = this.config;
    const H = c.hiddenSize;
    const last = this.target.config.numLayers - 1;
    const ctx = view(this.buf.ctx, [rows, H]);
    const part = view(this.buf.part, [rows, H]);
    hidden.forEach((tap, j) => {
      let x = view(tap, [rows, H]);
      if (this.targetLayers[j] === last) {
        // the last layer's entry of output_hidden_states is the model's normed output
        const normed = view(this.buf.tap, [rows, H]);
        b.native.rmsNorm({ x, weight: this.target.finalNorm, out: normed, eps: this.target.config.rmsNormEps, stream });
        x = normed;
      }
      applyLinear(b, this.fc[j], x, j === 0 ? ctx : part, stream);
      if (j > 0) b.native.add({ a: ctx, b: part, out: ctx, stream });
    });
    const normed = view(this.buf.normed, [rows, H]);
    b.native.rmsNorm({ x: ctx, weight: this.hiddenNorm, out: normed, eps: c.rmsNormEps, stream });
    // the rows' positions are their cache slots: length .. length + rows - 1
    const positions = view(this.positions, [rows]);
    b.native.arange({ out: positions, startOnDevice: this.lengthOnDevice, stream });
    const width = c.numKvHeads * c.headDim;
    const k = view(this.buf.kc, [rows, width]);
    const v = view(this.buf.vc, [rows, width]);
    for (const layer of this.layers) {
      this.keys(layer, normed, rows, positions, k, stream);
      applyLinear(b, layer.v, normed, v, stream);
      b.native.kvWrite({ c: k, kpe: v, cacheC: view(layer.kCache, [this.capacity, width]), cacheKpe: view(layer.vCache, [this.capacity, width]), slots: positions, stream });
    }
    b.native.arange({ out: this.lengthOnDevice, start: rows, startOnDevice: this.lengthOnDevice, stream });
  }

  /** k = rope(k_norm(k_proj(x))) for `rows` rows into `out` [rows, kv_heads * head_dim]. */
  private keys(layer: DflashLayer, x: DeviceTensor, rows: number, positions: DeviceTensor, out: DeviceTensor, stream: number): void {
    const b = this.b;
    const { numKvHeads: nkv, headDim: D, rmsNormEps: eps } = this.config;
    const raw = view(this.buf.kRaw, [rows, nkv * D]);
    applyLinear(b, layer.k, x, raw, stream);
    b.native.rmsNorm({ x: view(raw, [rows * nkv, D]), weight: layer.kNorm, out: view(out, [rows * nkv, D]), eps, stream });
    b.native.rope({ x: view(out, [rows, nkv, D]), positions, invFreq: this.invFreq, attentionFactor: this.attentionFactor, interleave: false, stream });
  }

  draft({ tokens, depth, out, rootOnDevice }: DraftRequest): boolean {
    const b = this.b;
    const c = this.config;
    const B = c.blockSize;
    if (!Number.isInteger(depth) || depth < 1 || depth > this.maxDepth) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `depth must be in [1, ${this.maxDepth}] (block_size ${B}), got ${depth}`, 'depth');
    // every committed token's hidden states must have arrived: the root is the one token after them
    if (tokens.length - 1 !== this.length) {
      throw new EngineError('KDTREE_ENGINE_ARGUMENT', `the DFlash drafter holds the hidden states of ${this.length} tokens, but the sequence has ${tokens.length - 1} committed before its root: commit() each step's accepted rows`, 'hidden');
    }
    // a block past the positions the drafter was made for, or one whose keys a sliding-window
    // layer's window no longer covers (the public implementation's eager and flash paths differ
    // there, so there is no one answer to match): it proposes nothing, and the engine decodes those
    // steps plainly (the output is greedy's either way; the context rows still commit)
    if (this.length + B > Math.min(c.maxPositionEmbeddings, c.slidingWindow ?? Infinity)) return false;
    if (rootOnDevice !== undefined) {
      if (rootOnDevice.dtype !== 'i32' || rootOnDevice.shape.reduce((x, y) => x * y, 1) !== 1) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `rootOnDevice must be i32 [1], got ${rootOnDevice.dtype} [${rootOnDevice.shape.join(', ')}]`, 'rootOnDevice');
      // the root copied on the device, inside the draft's graph: nothing here waits for the stream
      this.replay(`draft ${depth} ${tensorKey(out)} root ${tensorKey(rootOnDevice)}`, (stream) => {
        b.native.copy({ dst: this.ids.buffer, dstOffset: this.ids.offset ?? 0, src: rootOnDevice.buffer, srcOffset: rootOnDevice.offset ?? 0, bytes: 4, stream });
        this.queueDraft(depth, out, stream);
      });
      return true;
    }
    b.native.upload(this.ids.buffer, Int32Array.of(tokens[tokens.length - 1]), this.ids.offset ?? 0);
    this.replay(`draft ${depth} ${tensorKey(out)}`, (stream) => this.queueDraft(depth, out, stream));
    return true;
  }

  /** draft()'s ops, for the block at the committed length on the device. */
  private queueDraft(depth: number, out: DeviceTensor, stream: number): void {
    const b = this.b;
    const c = this.config;
    const { hiddenSize: H, blockSize: B, numHeads: nq, numKvHeads: nkv, headDim: D, rmsNormEps: eps } = c;
    const positions = view(this.positions, [B]);
    b.native.arange({ out: positions, startOnDevice: this.lengthOnDevice, stream });
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
    b.native.embedding({ table: this.target.embedTokens, ids: this.ids, out: x, stream });
    for (const layer of this.layers) {
      b.native.rmsNorm({ x, weight: layer.inputNorm, out: h, eps, stream });
      applyLinear(b, layer.q, h, q, stream);
      b.native.rmsNorm({ x: view(q, [B * nq, D]), weight: layer.qNorm, out: view(qn, [B * nq, D]), eps, stream });
      b.native.rope({ x: view(qn, [B, nq, D]), positions, invFreq: this.invFreq, attentionFactor: this.attentionFactor, interleave: false, stream });
      this.keys(layer, h, B, positions, kb, stream);
      applyLinear(b, layer.v, h, vb, stream);
      b.native.gqaAttention({
        q: view(qn, [B, nq, D]),
        kCache: layer.kCache,
        vCache: layer.vCache,
        k: view(kb, [B, nkv, D]),
        v: view(vb, [B, nkv, D]),
        out: view(attn, [B, nq, D]),
        // the bound the host checked; the graph reads the length itself
        contextLength: this.capacity,
        contextLengthOnDevice: this.lengthOnDevice,
        scale: this.scale,
        stream,
      });
      applyLinear(b, layer.o, attn, o, stream);
      // x += o, fused into the post-attention norm
      b.native.rmsNorm({ x, weight: layer.postNorm, out: h, eps, residual: o, sum: x, stream });
      applyLinear(b, layer.gateUp, h, act, stream, gateUp);
      applyLinear(b, layer.down, act, mlp, stream);
      b.native.add({ a: x, b: mlp, out: x, stream });
    }
    // depths 1..depth are block rows 1..depth
    const rows = view(this.buf.x, [depth, H], H);
    const normed = view(this.buf.h, [depth, H]);
    b.native.rmsNorm({ x: rows, weight: this.norm, out: normed, eps, stream });
    applyLinear(b, this.target.lmHeadWeight, normed, view(out, [depth, c.vocabSize]), stream);
  }

  dispose(): void {
    const b = this.b;
    for (const g of this.graphs.values()) b.native.freeGraph(g);
    this.graphs.clear();
    if (this.captureStream >= 0) b.native.destroyStream(this.captureStream);
    this.captureStream = -1;
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

const tensorIds = new WeakMap<object, number>();
let nextTensorId = 1;

/** A tensor's identity in a graph's key: its buffer (numbered on first sight), offset and shape. */
function tensorKey(t: DeviceTensor): string {
  let id = tensorIds.get(t.buffer);
  if (id === undefined) tensorIds.set(t.buffer, (id = nextTensorId++));
  return `${id}+${t.offset ?? 0}[${t.shape.join('x')}]`;
}

/** Refuses (KDTREE_ENGINE_DRAFTER, every mismatch named) a drafter that does not fit `target`. */
function checkPairing(config: DflashConfig, target: DeviceModel, drafter: string): void {
  try {
    checkDflashPairing(config, target.config, { drafter, target: 'the target model' });
  } catch (error) {
    if (error instanceof PairingError) throw new EngineError('KDTREE_ENGINE_DRAFTER', error.message, 'drafter', { cause: error });
    throw error;
  }
}
