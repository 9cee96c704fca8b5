/**
 * The golden forward pass of DeepSeek-V3 / Kimi K2 (transformers' DeepseekV3ForCausalLM), in f32
 * storage with f64 arithmetic:
 *
 *   h = embed[tokens]
 *   per layer:  h += MLA(rmsnorm(h));  h += MLP or MoE(rmsnorm(h))
 *   logits = lm_head(rmsnorm(h))
 *
 * Attention runs over the latent KV cache in MLA's absorbed form: score = (W_kb^T q_nope) . c +
 * q_pe . k_pe, output = W_vb (sum p c). It equals transformers' expanded form (K = W_kb c,
 * V = W_vb c per head) up to rounding, and is the form the CUDA kernels compute.
 *
 * New tokens are written at slots [cache.length, cache.length + T) and attend to every committed
 * slot and to the new tokens `attends(i, j)` allows (default: causal, j <= i). A DDTree verify
 * passes tree positions and the ancestor relation instead.
 */
import { qkHeadDim, type ModelConfig } from './config.js';
import { ReferenceUsageError } from './errors.js';
import { LatentKvCache } from './kv-cache.js';
import { applyRope, ropeTables, softmaxScale, type RopeTables } from './rope.js';
import { route } from './router.js';
import { matmulT, rmsNorm, silu } from './tensor-ops.js';
import type { AttentionWeights, MlpWeights, ModelWeights, MoeWeights } from './weights.js';

export interface ForwardOptions {
  /** Position of each new token (default: cache.length + i). */
  positions?: readonly number[];
  /** May new token i attend to new token j? (default: j <= i) */
  attends?: (i: number, j: number) => boolean;
  /** Compute logits only for these rows of the new tokens (default: all). */
  logitRows?: readonly number[];
  /** Called after each layer with the residual stream [T, hidden] (read it, do not keep it). */
  onLayer?: (layer: number, hidden: Float32Array) => void;
}

export class ReferenceModel {
  readonly rope: RopeTables;
  readonly scale: number;

  constructor(
    readonly config: ModelConfig,
    readonly weights: ModelWeights,
  ) {
    this.rope = ropeTables(config);
    this.scale = softmaxScale(config);
  }

  newCache(capacity = 4096): LatentKvCache {
    return new LatentKvCache(this.config, capacity);
  }

  /**
   * Runs `tokens` through the model, appending their latent KV to `cache`, and returns logits
   * [rows, vocab] for `logitRows` (all new tokens by default).
   */
  forward(tokens: readonly number[], cache: LatentKvCache, options: ForwardOptions = {}): Float32Array {
    const c = this.config;
    const T = tokens.length;
    const H = c.hiddenSize;
    if (T === 0) throw new ReferenceUsageError('forward needs at least one token');
    for (const t of tokens) {
      if (!Number.isInteger(t) || t < 0 || t >= c.vocabSize) throw new ReferenceUsageError(`token ${t} is outside the vocabulary [0, ${c.vocabSize})`);
    }
    const positions = options.positions ?? tokens.map((_, i) => cache.length + i);
    if (positions.length !== T) throw new ReferenceUsageError(`${positions.length} positions for ${T} tokens`);
    cache.reserve(T);
    const x = new Float32Array(T * H);
    for (let t = 0; t < T; t++) x.set(this.weights.embed.subarray(tokens[t] * H, (tokens[t] + 1) * H), t * H);
    for (let l = 0; l < c.numLayers; l++) {
      const w = this.weights.layers[l];
      const h = rmsNorm(x, T, H, w.inputNorm, c.rmsNormEps);
      addInto(x, this.attention(l, w.attn, h, T, positions, cache, options.attends));
      const h2 = rmsNorm(x, T, H, w.postNorm, c.rmsNormEps);
      addInto(x, w.mlp.kind === 'moe' ? this.moe(w.mlp.moe, h2, T) : mlp(w.mlp.dense, h2, T));
      options.onLayer?.(l, x);
    }
    cache.length += T;
    const rows = options.logitRows ?? tokens.map((_, i) => i);
    const final = new Float32Array(rows.length * H);
    rows.forEach((r, i) => final.set(x.subarray(r * H, (r + 1) * H), i * H));
    const normed = rmsNorm(final, rows.length, H, this.weights.norm, c.rmsNormEps);
    return matmulT(normed, rows.length, H, this.weights.lmHead, c.vocabSize);
  }

  private attention(layer: number, w: AttentionWeights, h: Float32Array, T: number, positions: readonly number[], cache: LatentKvCache, attends?: (i: number, j: number) => boolean): Float32Array {
    const c = this.config;
    const H = c.hiddenSize;
    const nh = c.numHeads;
    const qd = qkHeadDim(c);
    const { kvLoraRank: R, qkNopeDim: nope, qkRopeDim: rd, vHeadDim: vd } = c;
    // q: [T, heads * (nope + rope)]
    const q = w.q
      ? matmulT(h, T, H, w.q.w, w.q.out)
      : matmulT(rmsNorm(matmulT(h, T, H, w.qA!.w, w.qA!.out), T, w.qA!.out, w.qANorm!, c.mlaNormEps), T, w.qA!.out, w.qB!.w, w.qB!.out);
    // kv_a: [T, R + rope] -> normalized latent and RoPE'd shared key, into the cache
    const kvA = matmulT(h, T, H, w.kvA.w, w.kvA.out);
    const lc = cache.layers[layer];
    const base = cache.length;
    for (let t = 0; t < T; t++) {
      const slot = base + t;
      rmsNorm(kvA, 1, R, w.kvANorm, c.mlaNormEps, lc.c.subarray(slot * R, slot * R + R), t * (R + rd), R + rd);
      lc.kpe.set(kvA.subarray(t * (R + rd) + R, (t + 1) * (R + rd)), slot * rd);
      applyRope(lc.kpe, slot * rd, positions[t], this.rope, c.ropeInterleave);
      for (let head = 0; head < nh; head++) applyRope(q, t * nh * qd + head * qd + nope, positions[t], this.rope, c.ropeInterleave);
    }
    const out = latentAttention({ q, kvB: w.kvB.w, cacheC: lc.c, cacheKpe: lc.kpe, base, tokens: T, heads: nh, nope, rope: rd, v: vd, rank: R, scale: this.scale, attends });
    return matmulT(out, T, nh * vd, w.o.w, w.o.out);
  }

  private moe(moe: MoeWeights, h: Float32Array, T: number): Float32Array {
    const c = this.config;
    const H = c.hiddenSize;
    const logits = matmulT(h, T, H, moe.router, c.nRoutedExperts);
    const out = new Float32Array(T * H);
    const acc = new Float64Array(H);
    for (let t = 0; t < T; t++) {
      const row = h.subarray(t * H, (t + 1) * H);
      const { experts, weights } = route(c, logits.subarray(t * c.nRoutedExperts, (t + 1) * c.nRoutedExperts), moe.bias);
      acc.fill(0);
      experts.forEach((e, i) => {
        const y = mlp(moe.experts[e], row, 1);
        for (let j = 0; j < H; j++) acc[j] += weights[i] * y[j];
      });
      if (moe.shared) {
        const y = mlp(moe.shared, row, 1);
        for (let j = 0; j < H; j++) acc[j] += y[j];
      }
      for (let j = 0; j < H; j++) out[t * H + j] = acc[j];
    }
    return out;
  }
}

export interface LatentAttentionArgs {
  /** [T, heads, nope + rope], RoPE already applied to the rope part */
  q: Float32Array;
  /** kv_b_proj.weight [heads * (nope + v), rank]: per head W_kb (nope rows) then W_vb (v rows) */
  kvB: Float32Array;
  /** latent cache [slots, rank] and RoPE'd shared keys [slots, rope]; the T new tokens at [base, base + T) */
  cacheC: Float32Array;
  cacheKpe: Float32Array;
  base: number;
  tokens: number;
  heads: number;
  nope: number;
  rope: number;
  v: number;
  rank: number;
  scale: number;
  attends?: (i: number, j: number) => boolean;
}

/**
 * MLA attention in the absorbed form over the latent cache; returns [T, heads * v]. Each new
 * token attends to the committed slots [0, base) and to the new tokens `attends` allows (causal
 * by default), in slot order.
 */
export function latentAttention(a: LatentAttentionArgs): Float32Array {
  const { q, kvB, cacheC, cacheKpe, base, tokens: T, heads: nh, nope, rope: rd, v: vd, rank: R, scale, attends } = a;
  const qd = nope + rd;
  const out = new Float32Array(T * nh * vd);
  const qLatent = new Float64Array(R);
  const context = new Float64Array(R);
  for (let t = 0; t < T; t++) {
    const keys: number[] = [];
    for (let s = 0; s < base; s++) keys.push(s);
    for (let j = 0; j < T; j++) if (attends ? attends(t, j) : j <= t) keys.push(base + j);
    const scores = new Float64Array(keys.length);
    for (let head = 0; head < nh; head++) {
      const qo = t * nh * qd + head * qd;
      const kb = head * (nope + vd) * R; // W_kb rows of this head: [nope, R]
      qLatent.fill(0);
      for (let n = 0; n < nope; n++) {
        const qn = q[qo + n];
        const row = kb + n * R;
        for (let r = 0; r < R; r++) qLatent[r] += qn * kvB[row + r];
      }
      let max = -Infinity;
      for (let k = 0; k < keys.length; k++) {
        const s = keys[k];
        let dot = 0;
        for (let r = 0; r < R; r++) dot += qLatent[r] * cacheC[s * R + r];
        for (let i = 0; i < rd; i++) dot += q[qo + nope + i] * cacheKpe[s * rd + i];
        scores[k] = dot * scale;
        if (scores[k] > max) max = scores[k];
      }
      let sum = 0;
      for (let k = 0; k < keys.length; k++) sum += scores[k] = Math.exp(scores[k] - max);
      context.fill(0);
      for (let k = 0; k < keys.length; k++) {
        const p = scores[k] / sum;
        const s = keys[k];
        for (let r = 0; r < R; r++) context[r] += p * cacheC[s * R + r];
      }
      const vb = kb + nope * R; // W_vb rows of this head: [v, R]
      for (let v = 0; v < vd; v++) {
        let acc = 0;
        for (let r = 0; r < R; r++) acc += kvB[vb + v * R + r] * context[r];
        out[t * nh * vd + head * vd + v] = acc;
      }
    }
  }
  return out;
}

/** down(silu(gate(x)) * up(x)) */
export function mlp(w: MlpWeights, x: Float32Array, rows: number): Float32Array {
  const H = w.gate.in;
  const I = w.gate.out;
  const g = matmulT(x, rows, H, w.gate.w, I);
  const u = matmulT(x, rows, H, w.up.w, I);
  for (let i = 0; i < g.length; i++) g[i] = silu(g[i]) * u[i];
  return matmulT(g, rows, I, w.down.w, w.down.out);
}

function addInto(x: Float32Array, y: Float32Array): void {
  for (let i = 0; i < x.length; i++) x[i] += y[i];
}
