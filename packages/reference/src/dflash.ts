/**
 * The golden forward of a DFlash drafter (z-lab's DFlashDraftModel), in f32 storage with f64
 * arithmetic. One forward drafts a whole block: per-depth logits for the B - 1 positions after
 * the bonus token, conditioned on the target's hidden states.
 *
 *   ctx = hidden_norm(fc(concat of the target's hidden states after target_layer_ids))  [n, H]
 *   x   = target.embed_tokens([bonus, mask x (B - 1)])                                 [B, H]
 *   per layer (Qwen3):  h = input_norm(x)
 *     q = rope(q_norm(q_proj(h)))                       per head, at the block's positions
 *     k = rope(k_norm(k_proj([ctx; h]))), v = v_proj([ctx; h])   ctx keys at the context's positions
 *     x += o_proj(softmax(q k^T / sqrt(d)) v)           non-causal: every block row sees every
 *                                                       cached context key, the new context and the block
 *     x += mlp(post_norm(x))
 *   logits = target.lm_head(norm(x)[1:])                                               [B - 1, V]
 *
 * The layer's K/V of the context (never of the block) stay in a DflashCache: a round feeds only
 * the context positions committed since the last one, and the block's keys are dropped after the
 * forward, which is the public implementation's crop back to the committed length. RoPE is
 * non-interleaved (pairs (i, i + d/2)) over the whole head, with YaRN from the config.
 */
import type { TensorStore } from '@kdtree/format';
import type { DflashConfig } from './dflash-config.js';
import { ReferenceUsageError, WeightError } from './errors.js';
import { applyRope, ropeTablesFor, type RopeTables } from './rope.js';
import { matmulT, rmsNorm } from './tensor-ops.js';
import { mlp } from './model.js';
import { readShapedF32, specReader, type Linear, type MlpWeights, type WeightSource, type WeightSpec } from './weights.js';

export interface DflashLayerWeights {
  inputNorm: Float32Array;
  postNorm: Float32Array;
  q: Linear;
  k: Linear;
  v: Linear;
  o: Linear;
  /** [head_dim] RMSNorm weights applied to each query / key head */
  qNorm: Float32Array;
  kNorm: Float32Array;
  mlp: MlpWeights;
}

export interface DflashWeights {
  /** [hidden, taps * hidden] */
  fc: Linear;
  hiddenNorm: Float32Array;
  layers: DflashLayerWeights[];
  norm: Float32Array;
}

/** What the drafter borrows from its target: the token embedding and the output projection. */
export interface DflashTargetWeights {
  /** [vocab, hidden] */
  embed: Float32Array;
  /** [vocab, hidden] */
  lmHead: Float32Array;
}

/** Every tensor of a drafter, with its shape, under the public checkpoints' names. */
export function dflashWeightSpecs(config: DflashConfig): WeightSpec[] {
  const { hiddenSize: H, headDim: D, numHeads: nq, numKvHeads: nkv, intermediateSize: I } = config;
  const specs: WeightSpec[] = [
    { name: 'fc.weight', shape: [H, config.targetLayerIds.length * H] },
    { name: 'hidden_norm.weight', shape: [H] },
  ];
  for (let l = 0; l < config.numLayers; l++) {
    const p = `layers.${l}.`;
    specs.push(
      { name: `${p}input_layernorm.weight`, shape: [H] },
      { name: `${p}post_attention_layernorm.weight`, shape: [H] },
      { name: `${p}self_attn.q_proj.weight`, shape: [nq * D, H] },
      { name: `${p}self_attn.k_proj.weight`, shape: [nkv * D, H] },
      { name: `${p}self_attn.v_proj.weight`, shape: [nkv * D, H] },
      { name: `${p}self_attn.o_proj.weight`, shape: [H, nq * D] },
      { name: `${p}self_attn.q_norm.weight`, shape: [D] },
      { name: `${p}self_attn.k_norm.weight`, shape: [D] },
      { name: `${p}mlp.gate_proj.weight`, shape: [I, H] },
      { name: `${p}mlp.up_proj.weight`, shape: [I, H] },
      { name: `${p}mlp.down_proj.weight`, shape: [H, I] },
    );
  }
  specs.push({ name: 'norm.weight', shape: [H] });
  return specs;
}

/**
 * The name prefix of a drafter's tensors in `store`: '' as z-lab publishes them, 'model.' where a
 * converter wrapped them. Undefined when neither holds fc.weight.
 */
export function dflashWeightPrefix(store: Pick<TensorStore, 'has'>): string | undefined {
  return ['', 'model.'].find((p) => store.has(`${p}fc.weight`));
}

/**
 * Checks a checkpoint's tensor table against the drafter config before anything is read: every
 * tensor present (under one prefix) with its shape. Throws a WeightError naming the first problem
 * and counting the others.
 */
export function checkDflashTensors(config: DflashConfig, tensors: readonly { name: string; shape: readonly number[] }[], source: string): void {
  const byName = new Map(tensors.map((t) => [t.name, t.shape]));
  const prefix = dflashWeightPrefix({ has: (name) => byName.has(name) });
  if (prefix === undefined) throw new WeightError('missing: not a DFlash drafter checkpoint (no fc.weight, the projection of the target hidden states)', 'fc.weight', source);
  const problems: { tensor: string; message: string }[] = [];
  for (const spec of dflashWeightSpecs(config)) {
    const shape = byName.get(prefix + spec.name);
    if (shape === undefined) problems.push({ tensor: prefix + spec.name, message: 'missing' });
    else if (shape.length !== spec.shape.length || shape.some((d, i) => d !== spec.shape[i])) {
      problems.push({ tensor: prefix + spec.name, message: `has shape [${shape.join(', ')}], the drafter config needs [${spec.shape.join(', ')}]` });
    }
  }
  if (problems.length === 0) return;
  const [first] = problems;
  const more = problems.length > 1 ? ` (and ${problems.length - 1} more: ${problems.slice(1, 4).map((p) => p.tensor).join(', ')}${problems.length > 4 ? ', ...' : ''})` : '';
  throw new WeightError(`${first.message}${more}`, first.tensor, source);
}

/** Reads a drafter's weights from a tensor store (bf16 / f16 / f32), checking every shape. */
export function dflashStoreSource(store: TensorStore): WeightSource {
  const prefix = dflashWeightPrefix(store);
  if (prefix === undefined) throw new WeightError('missing: not a DFlash drafter checkpoint (no fc.weight, the projection of the target hidden states)', 'fc.weight', store.path);
  return async (name, shape) => {
    const full = prefix + name;
    if (!store.has(full)) throw new WeightError('missing (the drafter config needs it)', full, store.path);
    return readShapedF32(store, full, shape, undefined, 'the drafter config');
  };
}

export async function loadDflashWeights(config: DflashConfig, source: WeightSource): Promise<DflashWeights> {
  const { get, linear, mlp } = specReader(dflashWeightSpecs(config), source);
  const layers: DflashLayerWeights[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    const p = `layers.${l}.`;
    const a = `${p}self_attn.`;
    layers.push({
      inputNorm: await get(`${p}input_layernorm.weight`),
      postNorm: await get(`${p}post_attention_layernorm.weight`),
      q: await linear(`${a}q_proj.weight`),
      k: await linear(`${a}k_proj.weight`),
      v: await linear(`${a}v_proj.weight`),
      o: await linear(`${a}o_proj.weight`),
      qNorm: await get(`${a}q_norm.weight`),
      kNorm: await get(`${a}k_norm.weight`),
      mlp: await mlp(`${p}mlp.`),
    });
  }
  return { fc: await linear('fc.weight'), hiddenNorm: await get('hidden_norm.weight'), layers, norm: await get('norm.weight') };
}

/**
 * The drafter's context K/V per layer: [positions, kv_heads * head_dim], keys normed and rotated at
 * their position. Holds only committed context; grows as rounds add to it.
 */
export class DflashCache {
  /** Context positions held: [0, length). */
  length = 0;
  private capacity = 0;
  readonly k: Float32Array[];
  readonly v: Float32Array[];

  constructor(
    readonly layers: number,
    readonly width: number,
  ) {
    this.k = Array.from({ length: layers }, () => new Float32Array(0));
    this.v = Array.from({ length: layers }, () => new Float32Array(0));
  }

  /** Room for `count` more positions (the arrays double as they grow). */
  reserve(count: number): void {
    const need = this.length + count;
    if (need <= this.capacity) return;
    const capacity = Math.max(need, 2 * this.capacity, 16);
    for (let l = 0; l < this.layers; l++) {
      const k = new Float32Array(capacity * this.width);
      k.set(this.k[l].subarray(0, this.length * this.width));
      this.k[l] = k;
      const v = new Float32Array(capacity * this.width);
      v.set(this.v[l].subarray(0, this.length * this.width));
      this.v[l] = v;
    }
    this.capacity = capacity;
  }

  /** Drops positions from `length` on (a rewind; a DFlash round itself never needs one). */
  truncate(length: number): void {
    if (!Number.isInteger(length) || length < 0 || length > this.length) throw new ReferenceUsageError(`cannot truncate the DFlash context cache of ${this.length} positions to ${length}`);
    this.length = length;
  }
}

export interface DraftBlock {
  /** [B - 1, vocab] per-depth logits, depth 1 first. */
  logits: Float32Array;
  /** [B, hidden] the drafter's output after its final norm (every block row). */
  hidden: Float32Array;
}

export class DflashModel {
  readonly rope: RopeTables;
  readonly scale: number;

  constructor(
    readonly config: DflashConfig,
    readonly weights: DflashWeights,
    readonly target: DflashTargetWeights,
  ) {
    const { vocabSize: V, hiddenSize: H } = config;
    if (target.embed.length !== V * H || target.lmHead.length !== V * H) {
      throw new ReferenceUsageError(`the target's embed_tokens / lm_head hold ${target.embed.length} / ${target.lmHead.length} values, the drafter needs vocab ${V} x hidden ${H}`);
    }
    this.rope = ropeTablesFor(config.rope, config.maxPositionEmbeddings, config.headDim);
    this.scale = config.headDim ** -0.5;
  }

  newCache(): DflashCache {
    return new DflashCache(this.config.numLayers, this.config.numKvHeads * this.config.headDim);
  }

  /** Width of one context row: the target hidden states after every tapped layer, concatenated. */
  get contextWidth(): number {
    return this.config.targetLayerIds.length * this.config.hiddenSize;
  }

  /**
   * One drafting round. `context` [rows, contextWidth] holds the target's tapped hidden states of
   * the positions committed since the last round, [cache.length, cache.length + rows); the block
   * [bonus, mask x (B - 1)] sits at the positions after them. Their K/V join the cache.
   */
  draft(cache: DflashCache, context: Float32Array, rows: number, bonus: number): DraftBlock {
    const c = this.config;
    const { hiddenSize: H, blockSize: B, vocabSize: V } = c;
    if (!Number.isInteger(rows) || rows < 0) throw new ReferenceUsageError(`context rows must be a non-negative integer, got ${rows}`);
    if (context.length !== rows * this.contextWidth) throw new ReferenceUsageError(`the context holds ${context.length} values, expected ${rows} rows x ${this.contextWidth} (${c.targetLayerIds.length} tapped layers x hidden ${H})`);
    if (!Number.isInteger(bonus) || bonus < 0 || bonus >= V) throw new ReferenceUsageError(`bonus token ${bonus} is outside the vocabulary [0, ${V})`);
    if (cache.length + rows === 0) throw new ReferenceUsageError('the first DFlash round needs context (the prompt\'s hidden states)');
    const past = cache.length;
    const start = past + rows;
    this.checkWindow(start + B);
    const ctx = rmsNorm(matmulT(context, rows, this.contextWidth, this.weights.fc.w, H), rows, H, this.weights.hiddenNorm, c.rmsNormEps);
    const x = new Float32Array(B * H);
    const block = [bonus, ...Array.from({ length: B - 1 }, () => c.maskTokenId)];
    block.forEach((t, i) => x.set(this.target.embed.subarray(t * H, (t + 1) * H), i * H));
    cache.reserve(rows);
    for (let l = 0; l < c.numLayers; l++) {
      const w = this.weights.layers[l];
      const h = rmsNorm(x, B, H, w.inputNorm, c.rmsNormEps);
      // the new context's keys and values go into the cache at [past, start)
      this.keysValues(w, ctx, rows, past, cache.k[l], cache.v[l], past);
      const kBlock = new Float32Array(B * cache.width);
      const vBlock = new Float32Array(B * cache.width);
      this.keysValues(w, h, B, start, kBlock, vBlock, 0);
      addInto(x, this.attention(w, h, start, cache.k[l], cache.v[l], start, kBlock, vBlock));
      addInto(x, mlp(w.mlp, rmsNorm(x, B, H, w.postNorm, c.rmsNormEps), B));
    }
    cache.length = start;
    const hidden = rmsNorm(x, B, H, this.weights.norm, c.rmsNormEps);
    const logits = matmulT(hidden.subarray(H), B - 1, H, this.target.lmHead, V);
    return { logits, hidden };
  }

  /** Sliding layers: supported while the window covers every key (the span of [0, end)). */
  private checkWindow(end: number): void {
    const w = this.config.slidingWindow;
    if (w === null || end <= w) return;
    const layer = this.config.layerTypes.indexOf('sliding_attention');
    throw new ReferenceUsageError(
      `layer ${layer} of the drafter is a sliding-window layer (window ${w}) and this round spans ${end} positions: windowed non-causal attention is not supported (the public implementation's eager path attends to everything, its flash path windows both sides)`,
    );
  }

  /** k = rope(k_norm(k_proj(x))), v = v_proj(x) for `rows` rows at positions first.., into k/v at slot `at`. */
  private keysValues(w: DflashLayerWeights, x: Float32Array, rows: number, first: number, k: Float32Array, v: Float32Array, at: number): void {
    if (rows === 0) return;
    const { hiddenSize: H, headDim: D, numKvHeads: nkv, rmsNormEps: eps } = this.config;
    const width = nkv * D;
    const kr = matmulT(x, rows, H, w.k.w, width);
    rmsNorm(kr, rows * nkv, D, w.kNorm, eps, k.subarray(at * width, (at + rows) * width));
    v.set(matmulT(x, rows, H, w.v.w, width), at * width);
    for (let r = 0; r < rows; r++) {
      for (let head = 0; head < nkv; head++) applyRope(k, (at + r) * width + head * D, first + r, this.rope, false);
    }
  }

  /** Block queries over [cached context (slots [0, ctxLen)); block keys]; returns o_proj(out) [B, H]. */
  private attention(w: DflashLayerWeights, h: Float32Array, start: number, kCtx: Float32Array, vCtx: Float32Array, ctxLen: number, kBlock: Float32Array, vBlock: Float32Array): Float32Array {
    const { hiddenSize: H, headDim: D, numHeads: nq, numKvHeads: nkv, blockSize: B, rmsNormEps: eps } = this.config;
    const q = rmsNorm(matmulT(h, B, H, w.q.w, nq * D), B * nq, D, w.qNorm, eps);
    for (let t = 0; t < B; t++) for (let head = 0; head < nq; head++) applyRope(q, (t * nq + head) * D, start + t, this.rope, false);
    const out = dflashAttention({ q, tokens: B, heads: nq, kvHeads: nkv, headDim: D, scale: this.scale, kCtx, vCtx, contextLength: ctxLen, kBlock, vBlock });
    return matmulT(out, B, nq * D, w.o.w, H);
  }
}

/** The arguments of dflashAttention: keys and values are [rows, kvHeads * headDim] each. */
export interface DflashAttentionArgs {
  /** [tokens, heads * headDim], normed and rotated */
  q: Float32Array;
  tokens: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  scale: number;
  /** The cached context's keys and values: rows [0, contextLength) are read. */
  kCtx: Float32Array;
  vCtx: Float32Array;
  contextLength: number;
  /** The block's own keys and values, [tokens, kvHeads * headDim]. */
  kBlock: Float32Array;
  vBlock: Float32Array;
}

/**
 * A DFlash layer's attention (before o_proj): every block query sees every context key and every
 * block key (non-causal), query head h reading KV head h / (heads / kvHeads) (repeat_kv), in f64.
 * Returns [tokens, heads * headDim]; what the addon's gqaAttention is checked against.
 */
export function dflashAttention(a: DflashAttentionArgs): Float32Array {
  const { q, tokens: B, heads: nq, kvHeads: nkv, headDim: D, kCtx, vCtx, contextLength: ctxLen, kBlock, vBlock } = a;
  const group = nq / nkv; // query heads per KV head (repeat_kv)
  const width = nkv * D;
  const keys = ctxLen + B;
  const scores = new Float64Array(keys);
  const acc = new Float64Array(D);
  const out = new Float32Array(B * nq * D);
  for (let t = 0; t < B; t++) {
    for (let head = 0; head < nq; head++) {
      const qo = (t * nq + head) * D;
      const ko = Math.floor(head / group) * D;
      let max = -Infinity;
      for (let s = 0; s < keys; s++) {
        const [kk, o] = s < ctxLen ? [kCtx, s * width + ko] : [kBlock, (s - ctxLen) * width + ko];
        let dot = 0;
        for (let i = 0; i < D; i++) dot += q[qo + i] * kk[o + i];
        scores[s] = dot * a.scale;
        if (scores[s] > max) max = scores[s];
      }
      let sum = 0;
      for (let s = 0; s < keys; s++) sum += scores[s] = Math.exp(scores[s] - max);
      acc.fill(0);
      for (let s = 0; s < keys; s++) {
        const p = scores[s] / sum;
        const [vv, o] = s < ctxLen ? [vCtx, s * width + ko] : [vBlock, (s - ctxLen) * width + ko];
        for (let i = 0; i < D; i++) acc[i] += p * vv[o + i];
      }
      for (let i = 0; i < D; i++) out[qo + i] = acc[i];
    }
  }
  return out;
}

function addInto(x: Float32Array, y: Float32Array): void {
  for (let i = 0; i < x.length; i++) x[i] += y[i];
}
