/**
 * A synthetic target whose greedy continuation a small drafter can predict, and the DFlash drafter
 * built to predict it.
 *
 * Random weights give a target whose next token no model smaller than the target can foretell, so
 * acceptance figures on them say nothing. The walk target keeps every random layer and adds a
 * structure a drafter can learn, the way a language model's bigram statistics are learnable:
 *
 * - Each token t has a walk coordinate c(t) (a seeded permutation of the vocabulary) and a code:
 *   P Fourier pairs (cos, sin)(2 pi f_j c / V) written into fixed dimensions of its embedding.
 *   Shifting the coordinate by m rotates pair j by 2 pi f_j m / V: a linear map of the code.
 * - lm_head row v reads the code of c(v) - 1 (weight WALK_STEPS[0]) and c(v) - 2 (a little less),
 *   so a hidden state carrying t's code scores the tokens at coordinates c(t) + 1 and c(t) + 2
 *   highest. The layers' outputs (scaled by `layerScale`) are context-dependent noise on top: they
 *   decide between the two steps, and now and then send the walk elsewhere.
 * - The embedding's dimension 0 flags a real token, dimension 1 the DFlash mask token (whose
 *   embedding holds nothing else, and which lm_head never scores: a walk reaching its coordinate
 *   goes elsewhere), and the other dimensions keep half their random values.
 *
 * The drafter (one Qwen3 layer, built, not trained) predicts depth k as the code of c(bonus)
 * shifted by k - 1 (the +1 steps before the last); the target's lm_head adds the last step.
 * Query head k of each KV head attends to the bonus token only from block position k: the keys
 * are zero except at the bonus (k_proj reads the token flag), and the query of head k is the
 * least-norm trigonometric polynomial of the offset that scores +SCORE at offset k and -SCORE at
 * every other offset in the block. rope_theta < 1 puts every RoPE
 * frequency between 1 and 10 radians a position, which is what makes neighbouring offsets
 * separable. The value is the bonus token's code (v_proj reads the code dimensions), and o_proj
 * of head k applies depth k's shift. fc is zero, so the target's hidden states add nothing (the
 * walk needs only the last token); the taps and the context cache still run.
 *
 * The codes use Math.cos and Math.sin, so unlike SeededRandom's weights a walk's last bits may
 * differ between JavaScript engines; its bf16 rounding hides that in practice.
 */
import type { ModelConfig } from './config.js';
import { ReferenceUsageError } from './errors.js';
import { ropeTablesFor } from './rope.js';
import { SeededRandom, toBf16Values } from './synthetic.js';
import { parseDflashConfig, type DflashConfig } from './dflash-config.js';
import { dflashConfigJson } from './dflash-synthetic.js';
import { dflashWeightSpecs } from './dflash.js';

/**
 * The tensors that carry the walk: a draft model made by perturbing a walk target's weights keeps
 * them as they are (noise on the mask token's embedding would reach every drafted depth).
 */
export const WALK_TENSORS: ReadonlySet<string> = new Set(['model.embed_tokens.weight', 'lm_head.weight', 'model.norm.weight']);

/** The lm_head's two steps: coordinate +1 (weight 1) and +2 (weight WALK_STEPS[1]). */
export const WALK_STEPS = [1, 0.92] as const;

/**
 * The drafter's depth k is the code shifted by k - 1 (the +1 steps), minus this much of the code
 * shifted by k: the +1 step then leads the +2 step by 1 - (WALK_STEPS[1] - SHARPEN) in the logits
 * instead of 1 - WALK_STEPS[1], which the code's sidelobes could overturn.
 */
const SHARPEN = 0.25;

/** The drafter's head size: each KV head carries 64 of the code's pairs. */
const DRAFT_HEAD_DIM = 128;
/** Attention logits of a head's chosen offset (+) and every other block offset (-). */
const SCORE = 40;
/** RoPE pairs of a head that its query uses; the rest hold the masks' keys (walkDflashWeights). */
const QUERY_PAIRS = 48;
/** rope_theta of the drafter: RoPE frequencies theta^(-2i/d) from 1 to 1/theta radians a position. */
const DRAFT_ROPE_THETA = 0.1;
/** Amplitude of the token flag (dimension 0) and the mask flag (dimension 1) in the embeddings. */
const FLAG = 1;
/** The code's values are cos and sin times this (a code's rms is CODE_SCALE / sqrt 2). */
const CODE_SCALE = 1.5;
/** The other embedding dimensions keep their random values times this. */
const REST_SCALE = 0.5;

export interface WalkStructure {
  vocabSize: number;
  hiddenSize: number;
  /** Fourier pairs of the code (64 per drafter KV head). */
  pairs: number;
  /** [pairs] integer frequencies in [1, vocab / 2). */
  frequencies: Int32Array;
  /** [vocab] token -> walk coordinate (a permutation). */
  coordinate: Int32Array;
  /** The factor on every layer's output projection (o_proj, down_proj): the noise on the walk. */
  layerScale: number;
}

/** The hidden dimension of pair j's cos (and sin = cos + half of its chunk) in the embedding. */
function codeDims(pairs: number, j: number): { cos: number; sin: number } {
  const chunk = Math.floor(j / 64);
  const inChunk = Math.min(64, pairs - chunk * 64);
  const cos = 2 + chunk * DRAFT_HEAD_DIM + (j % 64);
  return { cos, sin: cos + inChunk };
}

/** The walk's parameters for a target config, from a seed. */
export function walkStructure(config: ModelConfig, seed: number, layerScale = 0.5): WalkStructure {
  const V = config.vocabSize;
  const H = config.hiddenSize;
  // two flag dimensions, then whole 128-dimension chunks where they fit (at most two)
  const pairs = H >= 2 + 2 * DRAFT_HEAD_DIM ? 128 : Math.min(64, Math.floor((H - 2) / 2));
  if (pairs < 8 || V < 16) throw new ReferenceUsageError(`a walk target needs hidden >= 18 and vocab >= 16, got hidden ${H}, vocab ${V}`);
  const rng = new SeededRandom(seed ^ 0x5a17);
  const pick = (n: number) => Math.min(n - 1, Math.floor(rng.uniform() * n));
  // distinct frequencies, avoiding 0 and V/2 (whose sin is zero at every coordinate); of a few
  // draws, the one whose codes are least alike at any shift (the largest sidelobe of
  // sum_j cos(2 pi f_j d / V) over d != 0), since sidelobes are what can outrank the walk's step
  const draw = (): Int32Array => {
    const used = new Set<number>();
    const f = new Int32Array(pairs);
    for (let j = 0; j < pairs; j++) {
      let x: number;
      do x = 1 + pick(Math.floor(V / 2) - 1);
      while (used.has(x) && used.size < Math.floor(V / 2) - 1);
      used.add(x);
      f[j] = x;
    }
    return f;
  };
  const draws = Math.max(1, Math.min(16, Math.floor(4e7 / (V * pairs))));
  let frequencies = draw();
  let best = maxSidelobe(frequencies, V);
  for (let i = 1; i < draws; i++) {
    const f = draw();
    const side = maxSidelobe(f, V);
    if (side < best) [frequencies, best] = [f, side];
  }
  const coordinate = Int32Array.from({ length: V }, (_, i) => i);
  for (let i = V - 1; i > 0; i--) {
    const j = pick(i + 1);
    [coordinate[i], coordinate[j]] = [coordinate[j], coordinate[i]];
  }
  return { vocabSize: V, hiddenSize: H, pairs, frequencies, coordinate, layerScale };
}

/** The angle of a code pair of frequency f at walk coordinate (or shift) m: 2 pi f m / V, reduced exactly. */
function phase(f: number, m: number, V: number): number {
  return (2 * Math.PI * ((f * m) % V)) / V;
}

/** The largest |sum_j cos(2 pi f_j d / V)| over shifts d in [1, V / 2] (it is even in d). */
function maxSidelobe(frequencies: Int32Array, V: number): number {
  let max = 0;
  for (let d = 1; d <= V / 2; d++) {
    let sum = 0;
    for (const f of frequencies) sum += Math.cos(phase(f, d, V));
    max = Math.max(max, Math.abs(sum));
  }
  return max;
}

/** Adds the code of walk coordinate `c`, times `scale`, into the hidden-sized row of `out` at `offset`. */
function writeCode(w: WalkStructure, c: number, out: Float32Array, offset: number, scale: number): void {
  for (let j = 0; j < w.pairs; j++) {
    const angle = phase(w.frequencies[j], c, w.vocabSize);
    const { cos, sin } = codeDims(w.pairs, j);
    out[offset + cos] += scale * Math.cos(angle);
    out[offset + sin] += scale * Math.sin(angle);
  }
}

/**
 * The walk target's weights from random ones (randomWeights of the same config): embed_tokens,
 * lm_head and the final norm replaced, every o_proj and down_proj scaled by `layerScale`. The mask
 * token (`maskTokenId`, the DFlash drafter's) embeds as the mask flag alone and is never predicted.
 */
export function walkWeights(config: ModelConfig, random: Map<string, Float32Array>, w: WalkStructure, maskTokenId = config.vocabSize - 2): Map<string, Float32Array> {
  const { vocabSize: V, hiddenSize: H } = config;
  if (w.vocabSize !== V || w.hiddenSize !== H) throw new ReferenceUsageError(`the walk was made for vocab ${w.vocabSize} x hidden ${w.hiddenSize}, the model has ${V} x ${H}`);
  const out = new Map<string, Float32Array>();
  for (const [name, x] of random) {
    if (/(o_proj|down_proj)\.weight$/.test(name)) out.set(name, toBf16Values(x.map((v) => v * w.layerScale)));
    else out.set(name, x);
  }
  const embed = new Float32Array(V * H);
  const randomEmbed = random.get('model.embed_tokens.weight')!;
  const lmHead = new Float32Array(V * H);
  const codeEnd = codeDims(w.pairs, w.pairs - 1).sin + 1;
  for (let t = 0; t < V; t++) {
    const row = t * H;
    if (t === maskTokenId) {
      embed[row + 1] = FLAG;
      continue;
    }
    embed[row] = FLAG;
    for (let d = codeEnd; d < H; d++) embed[row + d] = REST_SCALE * randomEmbed[row + d];
    writeCode(w, w.coordinate[t], embed, row, CODE_SCALE);
    // lm_head: the code of the coordinates one and two steps back
    const c = w.coordinate[t];
    for (let s = 0; s < WALK_STEPS.length; s++) writeCode(w, (c - (s + 1) + 2 * V) % V, lmHead, row, WALK_STEPS[s]);
  }
  out.set('model.embed_tokens.weight', toBf16Values(embed));
  out.set('lm_head.weight', toBf16Values(lmHead));
  out.set('model.norm.weight', new Float32Array(H).fill(1));
  return out;
}

/** The drafter config.json body for a walk target: one layer, block `blockSize`. */
export function walkDflashConfigJson(target: ModelConfig, w: WalkStructure, options: { blockSize?: number; targetLayerIds?: number[]; maskTokenId?: number } = {}): Record<string, unknown> {
  const blockSize = options.blockSize ?? 8;
  if (!Number.isInteger(blockSize) || blockSize < 2 || blockSize > 16) throw new ReferenceUsageError(`blockSize must be an integer in [2, 16], got ${blockSize}`);
  const kvHeads = Math.ceil(w.pairs / 64);
  const shape = { layers: 1, heads: kvHeads * blockSize, kvHeads, headDim: DRAFT_HEAD_DIM, intermediate: 32, blockSize, targetLayerIds: options.targetLayerIds ?? [0, target.numLayers - 1], maskTokenId: options.maskTokenId };
  return { ...dflashConfigJson(target, shape), rope_theta: DRAFT_ROPE_THETA, max_position_embeddings: target.maxPositionEmbeddings };
}

/**
 * The query of offset `target` within the block: the least-norm vector of pair components whose
 * RoPE'd dot product with a key of (1, 0) in every pair is +1 at offset `target` and -1 at every
 * other offset in 1..blockSize-1 (normal equations over the block's offsets), scaled to rms 1.
 * Returns it with the dot product it then has at `target` per unit key.
 */
function offsetQuery(invFreq: Float64Array, blockSize: number, target: number): { q: Float64Array; unit: number } {
  const half = invFreq.length;
  const offsets = Array.from({ length: blockSize - 1 }, (_, i) => i + 1);
  const phi = offsets.map((d) => {
    const v = new Float64Array(2 * half);
    for (let i = 0; i < half; i++) {
      v[i] = Math.cos(d * invFreq[i]);
      v[i + half] = -Math.sin(d * invFreq[i]);
    }
    return v;
  });
  const n = offsets.length;
  const a = phi.map((r, i) => [...phi.map((s) => r.reduce((acc, x, k) => acc + x * s[k], 0)), offsets[i] === target ? 1 : -1]);
  for (let c = 0; c < n; c++) {
    let p = c;
    for (let r = c + 1; r < n; r++) if (Math.abs(a[r][c]) > Math.abs(a[p][c])) p = r;
    [a[c], a[p]] = [a[p], a[c]];
    for (let r = 0; r < n; r++) {
      if (r === c) continue;
      const f = a[r][c] / a[c][c];
      for (let k = c; k <= n; k++) a[r][k] -= f * a[c][k];
    }
  }
  const q = new Float64Array(2 * half);
  phi.forEach((row, i) => row.forEach((v, k) => (q[k] += (a[i][n] / a[i][i]) * v)));
  const rms = Math.sqrt(q.reduce((s, v) => s + v * v, 0) / q.length);
  return { q: q.map((v) => v / rms), unit: 1 / rms };
}

/** The drafter's weights for a walk target (see the module comment), bf16-representable. */
export function walkDflashWeights(config: DflashConfig, w: WalkStructure): Map<string, Float32Array> {
  const { hiddenSize: H, headDim: D, numHeads: nq, numKvHeads: nkv, blockSize: B } = config;
  if (D !== DRAFT_HEAD_DIM || nkv !== Math.ceil(w.pairs / 64) || nq !== nkv * B || config.numLayers !== 1 || H !== w.hiddenSize || config.vocabSize !== w.vocabSize) {
    throw new ReferenceUsageError('walkDflashWeights needs the config of walkDflashConfigJson for the same walk');
  }
  const out = new Map<string, Float32Array>();
  for (const spec of dflashWeightSpecs(config)) out.set(spec.name, new Float32Array(spec.shape.reduce((a, b) => a * b, 1)));
  const set = (name: string, values: Float32Array) => out.set(name, toBf16Values(values));
  for (const name of ['hidden_norm.weight', 'layers.0.input_layernorm.weight', 'layers.0.post_attention_layernorm.weight', 'norm.weight', 'layers.0.self_attn.q_norm.weight']) {
    out.set(name, new Float32Array(out.get(name)!.length).fill(1));
  }
  const half = D / 2;
  const rope = ropeTablesFor(config.rope, config.maxPositionEmbeddings, D);
  // keys: (1, 0) in each of the first QUERY_PAIRS pairs at the bonus token (k_proj reads the token
  // flag), and in the other pairs at a mask (k_proj reads the mask flag there). The queries are zero
  // in those other pairs, so a mask scores 0 however k_norm amplifies what little token flag a noisy
  // mask embedding has; the context keys are zero (fc is zero). After k_norm a bonus key holds
  // kScale * sqrt(D / QUERY_PAIRS) in each query pair, and q_norm scales a query of rms 1 over its
  // 2 QUERY_PAIRS values by sqrt(D / (2 QUERY_PAIRS)): with the softmax's 1 / sqrt D, the score at
  // its offset is unit * kScale * sqrt D / (QUERY_PAIRS * sqrt 2)
  const queries = Array.from({ length: B }, (_, k) => (k === 0 ? undefined : offsetQuery(rope.invFreq.subarray(0, QUERY_PAIRS), B, k)));
  const minUnit = Math.min(...queries.slice(1).map((x) => x!.unit));
  const kScale = (SCORE * QUERY_PAIRS * Math.SQRT2) / (minUnit * Math.sqrt(D));
  out.set('layers.0.self_attn.k_norm.weight', toBf16Values(new Float32Array(D).fill(kScale)));
  const kProj = new Float32Array(nkv * D * H);
  for (let g = 0; g < nkv; g++) for (let i = 0; i < half; i++) kProj[(g * D + i) * H + (i < QUERY_PAIRS ? 0 : 1)] = 1;
  set('layers.0.self_attn.k_proj.weight', kProj);
  // queries read the mask flag (dimension 1): head k of each group is offset k's query
  const qProj = new Float32Array(nq * D * H);
  for (let g = 0; g < nkv; g++) {
    for (let k = 1; k < B; k++) {
      const q = queries[k]!.q;
      for (let i = 0; i < QUERY_PAIRS; i++) {
        qProj[((g * B + k) * D + i) * H + 1] = q[i];
        qProj[((g * B + k) * D + half + i) * H + 1] = q[QUERY_PAIRS + i];
      }
    }
  }
  set('layers.0.self_attn.q_proj.weight', qProj);
  // values: KV head g carries code pairs 64g .. 64g + 63 (cos then sin, as in the embedding)
  const vProj = new Float32Array(nkv * D * H);
  for (let j = 0; j < w.pairs; j++) {
    const g = Math.floor(j / 64);
    const { cos, sin } = codeDims(w.pairs, j);
    const base = 2 + g * D;
    vProj[(g * D + cos - base) * H + cos] = 1;
    vProj[(g * D + sin - base) * H + sin] = 1;
  }
  set('layers.0.self_attn.v_proj.weight', vProj);
  // o_proj of head k: the code shifted by k - 1, so the target's lm_head (which adds the last
  // step) ranks the all-+1 path's token first at every depth and its +2 step second. A chain of
  // top-1 tokens stays consistent (it is accepted while the target steps +1), and DDTree's second
  // choices are the +2 branches. Not the marginal's mode: a chain of modes would need its +2 step
  // at one given depth. The gain matches the target's own (its final norm leaves a code amplitude
  // of CODE_SCALE / rms(embedding)).
  const oProj = new Float32Array(H * nq * D);
  const gain = oProjGain(w, H);
  for (let k = 1; k < B; k++) {
    for (let j = 0; j < w.pairs; j++) {
      // the pair's rotation by k - 1 steps, less SHARPEN x its rotation by k
      const turn = (m: number) => phase(w.frequencies[j], m, w.vocabSize);
      const c = Math.cos(turn(k - 1)) - SHARPEN * Math.cos(turn(k));
      const s = Math.sin(turn(k - 1)) - SHARPEN * Math.sin(turn(k));
      const g = Math.floor(j / 64);
      const { cos, sin } = codeDims(w.pairs, j);
      const base = 2 + g * D;
      const col = (dim: number) => (g * B + k) * D + (dim - base);
      // [cos'; sin'] = gain * [[c, -s], [s, c]] [cos; sin]
      oProj[cos * nq * D + col(cos)] = gain * c;
      oProj[cos * nq * D + col(sin)] = -gain * s;
      oProj[sin * nq * D + col(cos)] = gain * s;
      oProj[sin * nq * D + col(sin)] = gain * c;
    }
  }
  set('layers.0.self_attn.o_proj.weight', oProj);
  return out;
}

/**
 * o_proj's gain: the drafter's value is the code over rms(bonus embedding); after its final norm
 * (the mask flag plus the shifted code) the code should have the amplitude the target's final norm
 * gives it, CODE_SCALE / rms(embedding), so both put the same temperature on their logits.
 */
function oProjGain(w: WalkStructure, H: number): number {
  const codeSq = w.pairs * CODE_SCALE * CODE_SCALE; // |code|^2 of an embedding
  const restSq = (H - 2 - 2 * w.pairs) * REST_SCALE * REST_SCALE; // random N(0, 1) dimensions
  const embedRms = Math.sqrt((FLAG * FLAG + codeSq + restSq) / H);
  // the value's code amplitude (v_proj after input_norm) and the target's after its final norm
  const amplitude = CODE_SCALE / embedRms;
  // x = mask flag + gain * amplitude * code; after the norm the code's amplitude is
  // gain * amplitude / rms(x), so rms(x) = gain, with rms(x)^2 = (FLAG^2 + gain^2 amplitude^2 pairs) / H
  const share = (amplitude * amplitude * w.pairs) / H;
  return FLAG / Math.sqrt(H * (1 - share));
}

/** parseDflashConfig of walkDflashConfigJson (for callers that need both). */
export function walkDflashConfig(target: ModelConfig, w: WalkStructure, options?: Parameters<typeof walkDflashConfigJson>[2]): { json: Record<string, unknown>; config: DflashConfig } {
  const json = walkDflashConfigJson(target, w, options);
  return { json, config: parseDflashConfig(json, 'walk drafter') };
}
