/**
 * DDTree (Ringel & Romano, arXiv:2604.12989): speculative decoding with a draft *tree*. The
 * executable spec that the CUDA kernels and the engine must reproduce.
 *
 * A drafter gives per-depth logits for the L positions after the root token b. The best tree of
 * at most B draft nodes is the B most probable prefixes under q(u) = prod_i q_i(u_i), found
 * best-first with a heap over (cumulative log-prob, parent, depth, rank):
 *
 *   pop the best; it becomes node n (token = rank-th best at its depth, under its parent);
 *   push its next sibling (same parent and depth, rank + 1) and its first child (depth + 1, rank 0)
 *
 * Ties in the heap go to the entry pushed first; ties between tokens to the lower token id. Nodes
 * are numbered in pop order, so parent[i] < i. The target verifies every node in one forward pass
 * (position = start + depth, attending to the committed cache and to its ancestors), then walks
 * from the root along children whose token equals the target's argmax; the argmax at the last
 * accepted node is the bonus token. The accepted path's KV is compacted into place.
 */
import { ReferenceUsageError } from './errors.js';
import type { LatentKvCache } from './kv-cache.js';
import type { ForwardOptions, ReferenceModel } from './model.js';
import { argmax } from './tensor-ops.js';

export interface DraftTree {
  /** Node count: root + draft nodes. */
  size: number;
  /** Token of each node; node 0 is the root (the last accepted token). */
  tokens: Int32Array;
  /** Parent node; -1 for the root. parent[i] < i. */
  parents: Int32Array;
  /** Depth: 0 for the root. */
  depths: Int32Array;
  /** Cumulative draft log-probability (0 at the root). */
  logProbs: Float64Array;
}

/** Per depth: the top-K tokens by log-softmax, descending (ties: lower token id first). */
export function topKLogProbs(draftLogits: Float32Array, depth: number, vocab: number, k: number): { tokens: Int32Array; logProbs: Float64Array } {
  const tokens = new Int32Array(depth * k);
  const logProbs = new Float64Array(depth * k);
  const order = new Int32Array(vocab);
  for (let d = 0; d < depth; d++) {
    const o = d * vocab;
    let max = -Infinity;
    for (let v = 0; v < vocab; v++) max = Math.max(max, draftLogits[o + v]);
    let sum = 0;
    for (let v = 0; v < vocab; v++) sum += Math.exp(draftLogits[o + v] - max);
    const logZ = max + Math.log(sum);
    for (let v = 0; v < vocab; v++) order[v] = v;
    const sorted = Array.from(order).sort((a, b) => draftLogits[o + b] - draftLogits[o + a] || a - b);
    for (let r = 0; r < k; r++) {
      tokens[d * k + r] = sorted[r];
      logProbs[d * k + r] = draftLogits[o + sorted[r]] - logZ;
    }
  }
  return { tokens, logProbs };
}

interface HeapEntry {
  w: number;
  parent: number;
  depth: number;
  rank: number;
  seq: number;
}

/** A binary max-heap on (w desc, seq asc). */
class Heap {
  private readonly items: HeapEntry[] = [];
  get size(): number {
    return this.items.length;
  }
  private better(a: HeapEntry, b: HeapEntry): boolean {
    return a.w > b.w || (a.w === b.w && a.seq < b.seq);
  }
  push(e: HeapEntry): void {
    const a = this.items;
    a.push(e);
    let i = a.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!this.better(a[i], a[p])) break;
      [a[i], a[p]] = [a[p], a[i]];
      i = p;
    }
  }
  pop(): HeapEntry {
    const a = this.items;
    const top = a[0];
    const last = a.pop()!;
    if (a.length > 0) {
      a[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < a.length && this.better(a[l], a[m])) m = l;
        if (r < a.length && this.better(a[r], a[m])) m = r;
        if (m === i) break;
        [a[i], a[m]] = [a[m], a[i]];
        i = m;
      }
    }
    return top;
  }
}

/**
 * Builds the draft tree for `root` from per-depth draft logits [depth, vocab] under a budget of
 * `budget` draft nodes (the tree has at most budget + 1 nodes with the root).
 */
export function buildDraftTree(root: number, draftLogits: Float32Array, depth: number, vocab: number, budget: number): DraftTree {
  if (!Number.isInteger(depth) || depth < 1) throw new ReferenceUsageError(`DDTree depth must be a positive integer, got ${depth}`);
  if (!Number.isInteger(budget) || budget < 0) throw new ReferenceUsageError(`DDTree budget must be a non-negative integer, got ${budget}`);
  if (draftLogits.length !== depth * vocab) throw new ReferenceUsageError(`draft logits have ${draftLogits.length} values, expected depth ${depth} x vocab ${vocab}`);
  const k = Math.min(budget, vocab);
  const top = topKLogProbs(draftLogits, depth, vocab, k);
  const tree = expandDraftTree(top.logProbs, depth, k, budget);
  const tokens = new Int32Array(tree.size);
  tokens[0] = root;
  for (let node = 1; node < tree.size; node++) tokens[node] = top.tokens[(tree.depths[node] - 1) * k + tree.ranks[node]];
  return { size: tree.size, tokens, parents: tree.parents, depths: tree.depths, logProbs: tree.logProbs };
}

/**
 * DDTree's best-first expansion: from each depth's k best log-probabilities `top` [depth, k]
 * (each row descending), the nodes of the best tree of `budget` draft nodes in pop order, the root
 * first (node 0: parent -1, depth 0, log-prob 0). A node is a path of one ranked token a depth
 * scored by the sum of their log-probs; popping one offers its next sibling and its first child, so
 * the nodes come out in descending score. `ranks[i]` is node i's rank at its depth. Fewer than
 * budget + 1 nodes where the table holds fewer paths.
 */
export function expandDraftTree(top: ArrayLike<number>, depth: number, k: number, budget: number): { size: number; parents: Int32Array; depths: Int32Array; ranks: Int32Array; logProbs: Float64Array } {
  const n = budget + 1;
  const parents = new Int32Array(n);
  const depths = new Int32Array(n);
  const ranks = new Int32Array(n);
  const logProbs = new Float64Array(n);
  parents[0] = -1;
  let size = 1;
  if (k > 0) {
    const heap = new Heap();
    let seq = 0;
    heap.push({ w: top[0], parent: 0, depth: 1, rank: 0, seq: seq++ });
    while (heap.size > 0 && size < n) {
      const e = heap.pop();
      const node = size++;
      const at = (e.depth - 1) * k + e.rank;
      parents[node] = e.parent;
      depths[node] = e.depth;
      ranks[node] = e.rank;
      logProbs[node] = e.w;
      if (e.rank + 1 < k) heap.push({ w: e.w - top[at] + top[at + 1], parent: e.parent, depth: e.depth, rank: e.rank + 1, seq: seq++ });
      if (e.depth < depth) heap.push({ w: e.w + top[e.depth * k], parent: node, depth: e.depth + 1, rank: 0, seq: seq++ });
    }
  }
  return { size, parents: parents.slice(0, size), depths: depths.slice(0, size), ranks: ranks.slice(0, size), logProbs: logProbs.slice(0, size) };
}

/** Tree positions: start + depth. */
export function treePositions(tree: DraftTree, start: number): number[] {
  return Array.from(tree.depths, (d) => start + d);
}

/** Ancestor-or-self mask [size, size], row-major: mask[i * size + j] = 1 when node i attends to node j. */
export function treeMask(tree: DraftTree): Uint8Array {
  const n = tree.size;
  const mask = new Uint8Array(n * n);
  for (let i = 0; i < n; i++) {
    for (let j = i; j >= 0; j = tree.parents[j]) mask[i * n + j] = 1;
  }
  return mask;
}

/**
 * One target forward over every tree node at its tree position, attending to the committed
 * cache and to its ancestors. Writes the nodes' KV at slots [cache.length, cache.length + size)
 * and returns logits [size, vocab]. Call commitPath afterwards. `onLayer` sees each layer's output
 * (a DFlash drafter's hidden-state taps).
 */
export function verifyTree(model: ReferenceModel, cache: LatentKvCache, tree: DraftTree, onLayer?: ForwardOptions['onLayer']): Float32Array {
  const start = cache.length;
  const mask = treeMask(tree);
  const n = tree.size;
  const logits = model.forward(Array.from(tree.tokens), cache, { positions: treePositions(tree, start), attends: (i, j) => mask[i * n + j] === 1, onLayer });
  cache.length = start; // the tree's slots are scratch until commitPath
  return logits;
}

export interface Acceptance {
  /** Accepted node indices from the root: path[0] = 0. */
  path: number[];
  /** Tokens of path[1:], then the bonus token. */
  emitted: number[];
  bonus: number;
}

/** Greedy acceptance: follow children whose token is the target's argmax at their parent. */
export function acceptTree(tree: DraftTree, targetArgmax: ArrayLike<number>): Acceptance {
  const path = [0];
  let cur = 0;
  for (;;) {
    let next = -1;
    for (let c = cur + 1; c < tree.size; c++) {
      if (tree.parents[c] === cur && tree.tokens[c] === targetArgmax[cur]) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    path.push(next);
    cur = next;
  }
  const bonus = targetArgmax[cur];
  return { path, emitted: [...path.slice(1).map((i) => tree.tokens[i]), bonus], bonus };
}

/**
 * Compacts the accepted path's KV: slot start + k gets slot start + path[k] (k ascending, safe
 * since path[k] >= k), then the cache ends after the path.
 */
export function commitPath(cache: LatentKvCache, start: number, path: readonly number[]): void {
  for (let k = 0; k < path.length; k++) cache.copySlot(start + k, start + path[k]);
  cache.truncate(start + path.length);
}

/** Per-depth draft logits [depth, vocab] for the positions after `context` (whose last token is the root). */
export type Drafter = (context: readonly number[], depth: number) => Float32Array;

export interface DdtreeOptions {
  maxNew: number;
  budget: number;
  depth: number;
  drafter: Drafter;
  eos?: readonly number[];
}

export interface DdtreeResult {
  tokens: number[];
  /** Tokens emitted per target forward (accepted draft tokens + 1 bonus), one entry per step. */
  acceptedPerStep: number[];
  stoppedBy: 'eos' | 'max';
}

/** Decodes with DDTree speculation. With greedy acceptance the output equals greedyDecode's. */
export function ddtreeDecode(model: ReferenceModel, prompt: readonly number[], options: DdtreeOptions): DdtreeResult {
  if (prompt.length === 0) throw new ReferenceUsageError('the prompt needs at least one token');
  const eos = new Set(options.eos ?? model.config.eosTokenIds);
  const vocab = model.config.vocabSize;
  const cache = model.newCache(prompt.length + options.maxNew + options.budget + 2);
  const tokens: number[] = [];
  const acceptedPerStep: number[] = [];
  if (options.maxNew === 0) return { tokens, acceptedPerStep, stoppedBy: 'max' };
  let root = argmax(model.forward(prompt, cache, { logitRows: [prompt.length - 1] }));
  tokens.push(root);
  if (eos.has(root)) return { tokens, acceptedPerStep, stoppedBy: 'eos' };
  while (tokens.length < options.maxNew) {
    const start = cache.length;
    const draft = options.drafter([...prompt, ...tokens], options.depth);
    const tree = buildDraftTree(root, draft, options.depth, vocab, options.budget);
    const logits = verifyTree(model, cache, tree);
    const post = Array.from({ length: tree.size }, (_, i) => argmax(logits, i * vocab, vocab));
    const { path, emitted, bonus } = acceptTree(tree, post);
    commitPath(cache, start, path);
    acceptedPerStep.push(emitted.length);
    for (const t of emitted) {
      tokens.push(t);
      if (eos.has(t)) return { tokens, acceptedPerStep, stoppedBy: 'eos' };
      if (tokens.length >= options.maxNew) return { tokens, acceptedPerStep, stoppedBy: 'max' };
    }
    root = bonus;
  }
  return { tokens, acceptedPerStep, stoppedBy: 'max' };
}

/**
 * A drafter from an autoregressive draft model: it decodes `depth` tokens greedily after the
 * context and returns its logits at each step (the per-depth distributions of its greedy chain).
 */
export function modelDrafter(draft: ReferenceModel): Drafter {
  return (context, depth) => {
    const vocab = draft.config.vocabSize;
    const cache = draft.newCache(context.length + depth);
    const out = new Float32Array(depth * vocab);
    let logits = draft.forward(context, cache, { logitRows: [context.length - 1] });
    for (let d = 0; d < depth; d++) {
      out.set(logits, d * vocab);
      if (d + 1 < depth) logits = draft.forward([argmax(logits)], cache);
    }
    return out;
  };
}
