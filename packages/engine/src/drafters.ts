/**
 * Drafters: given the sequence so far (its last token is the root of the next tree), a drafter
 * writes per-depth logits [depth, vocab] for the `depth` positions after the root into a tensor on
 * the engine's backend. DDTree builds the best tree under those distributions; chain decoding
 * follows their argmax. A drafter's quality changes how many tokens a step accepts, never which
 * tokens come out: verification makes the output that of greedy decoding of the target.
 *
 *   ngram        model-free: continuations of the longest earlier match of the context's suffix
 *   model:PATH   a small model of the same family, decoded greedily `depth` steps on the device
 *   dflash:PATH  a DFlash block-diffusion drafter over the target's hidden states (dflash-drafter.ts)
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { expandDraftTree } from '@kdtree/reference';
import { EngineError } from './errors.js';
import { view } from './linear.js';
import type { DeviceModel } from './model.js';
import { Runner } from './runner.js';

export interface DraftRequest {
  /** Prompt and every token emitted so far; the last one is the root of the tree being drafted. */
  tokens: readonly number[];
  depth: number;
  /** f32 [depth, vocab]: where the per-depth logits go (queued on the default stream). */
  out: DeviceTensor;
  /**
   * i32 [1]: the root (the last of `tokens`) where the device already holds it. A drafter may read
   * it there instead of uploading it: an upload from the host's memory waits for the stream, so the
   * device would idle until the host queues the draft.
   */
  rootOnDevice?: DeviceTensor;
}

export interface Drafter {
  /** 'ngram', 'model:<path>', ... (what stats and traces name). */
  readonly name: string;
  readonly vocabSize: number;
  /** The deepest draft it can make in one request. */
  readonly maxDepth: number;
  /** The depth a generation uses when it names none (the engine's default, 4, when absent). */
  readonly defaultDepth?: number;
  /**
   * Target layers whose hidden states the drafter reads (absent: it reads none). When set, the
   * engine taps the residual stream after each of these layers in every target pass and calls
   * `commit` with the rows of the tokens it commits, in order: the prompt's prefill chunk by chunk,
   * then each step's accepted path (the root and the accepted drafts; a tree's rows gathered by
   * the path) or a plain decode step's one token, before the next `draft`. The engine runs such a
   * drafter on one device only (tp 1).
   */
  readonly targetLayers?: readonly number[];
  /**
   * The target's hidden states of the next `rows` committed tokens: `hidden[j]` f32 [rows,
   * hidden] (at least) after layer targetLayers[j], on the engine's backend, valid until the next
   * target pass. Required with targetLayers.
   */
  commit?(hidden: readonly DeviceTensor[], rows: number): void;
  /** A new sequence starts (its prompt): forget the previous one (called before its prefill). */
  begin(prompt: readonly number[]): void;
  /**
   * Writes the request's logits. `false`: it has nothing to propose this step (ngram without an
   * earlier match), and need not write them: the step decodes plainly instead of verifying a tree
   * of guesses, and nothing reads them.
   */
  draft(request: DraftRequest): boolean | void;
  /**
   * Optional, for a drafter whose logits the host knows: the cumulative draft log-probabilities
   * (root excluded, in the order a DDTree build pops them, -Infinity past the nodes there are) of
   * the best tree of `budget` nodes under its last draft's logits, as `ddtreeBuild`'s logProbs
   * give them up to f32 rounding. Budget `auto` plans a try with them instead of building that
   * tree on the device and reading it back before the verify.
   */
  treeLogProbs?(budget: number): Float32Array;
  dispose(): void;
}

/** Logit of a token the n-gram statistics never saw: far below any seen one, but finite. */
const UNSEEN_LOGIT = -1e4;

/**
 * Prompt-lookup drafting: find the earlier occurrences of the longest suffix of the sequence (up to
 * `maxN` tokens) and, at each depth d, give every token that followed an occurrence d positions
 * later the log of its frequency. Alternatives at a depth come from different occurrences, which is
 * what a tree can use and a chain cannot.
 */
export class NgramDrafter implements Drafter {
  readonly name = 'ngram';
  private floor: DeviceTensor | undefined;
  /** i32 [2 x capacity]: the seen (depth, token) entries' flat indices, then their logits' f32 bits. */
  private entries: DeviceTensor | undefined;
  /** Per depth of the last draft: its seen tokens' log-frequencies, largest first (what treeLogProbs expands). */
  private ranked: number[][] = [];

  constructor(
    private readonly b: KdtreeBackend,
    readonly vocabSize: number,
    readonly maxDepth = 16,
    private readonly maxN = 4,
  ) {}

  begin(): void {}

  /** Per depth: token -> count of occurrences followed by it there. */
  static continuations(tokens: readonly number[], depth: number, maxN: number): Map<number, number>[] {
    const out = Array.from({ length: depth }, () => new Map<number, number>());
    const end = tokens.length;
    for (let n = Math.min(maxN, end - 1); n >= 1; n--) {
      let found = false;
      for (let at = end - n - 1; at >= 0; at--) {
        let match = true;
        for (let i = 0; i < n && match; i++) match = tokens[at + i] === tokens[end - n + i];
        if (!match) continue;
        const next = at + n; // first token after this occurrence
        if (next >= end) continue;
        found = true;
        for (let d = 0; d < depth && next + d < end; d++) out[d].set(tokens[next + d], (out[d].get(tokens[next + d]) ?? 0) + 1);
      }
      if (found) break;
    }
    return out;
  }

  /** Per depth: token -> the log of its share of the continuations there (what draft writes; every other token gets UNSEEN_LOGIT). */
  static logFrequencies(tokens: readonly number[], depth: number, maxN: number): Map<number, number>[] {
    return NgramDrafter.continuations(tokens, depth, maxN).map((seen) => {
      let total = 0;
      for (const c of seen.values()) total += c;
      return new Map([...seen].map(([token, c]) => [token, Math.log(c / total)]));
    });
  }

  draft({ tokens, depth, out }: DraftRequest): boolean {
    const frequencies = NgramDrafter.logFrequencies(tokens, depth, this.maxN);
    // a match always continues at depth 1: without one every node would be one of V equal guesses
    // (and there is no last draft for treeLogProbs: the device's logits are the previous one's)
    if (frequencies[0].size === 0) {
      this.ranked = [];
      return false;
    }
    this.ranked = frequencies.map((seen) => [...seen.values()].sort((x, y) => y - x));
    const b = this.b;
    const V = this.vocabSize;
    if (this.floor === undefined || this.floor.shape[0] < depth) {
      if (this.floor) b.free(this.floor);
      this.floor = b.fromArray('f32', [Math.max(depth, this.maxDepth), V], new Float32Array(Math.max(depth, this.maxDepth) * V).fill(UNSEEN_LOGIT));
    }
    const offset = out.offset ?? 0;
    b.native.copy({ dst: out.buffer, dstOffset: offset, src: this.floor.buffer, bytes: depth * V * 4, stream: 0 });
    // the seen tokens' log-frequencies in one upload and one scatter (kvWrite of one-value rows into
    // the logits as [depth x V, 1]): an upload from the host's memory waits for the stream, so one
    // per token (a few dozen where a frequent token has many continuations) kept the device idle.
    // kvWrite writes a latent part and a rope part; both are these values into these rows (the same
    // n floats twice: a scatter needs no op of its own for that)
    let n = 0;
    for (const seen of frequencies) n += seen.size;
    let capacity = (this.entries?.shape[0] ?? 0) / 2;
    if (capacity < n) {
      if (this.entries) b.free(this.entries);
      capacity = 2 ** Math.ceil(Math.log2(Math.max(64, n)));
      this.entries = b.empty('i32', [2 * capacity]);
    }
    const host = new Int32Array(capacity + n);
    const logits = new Float32Array(host.buffer, capacity * 4, n);
    let i = 0;
    frequencies.forEach((seen, d) => {
      for (const [token, logFrequency] of seen) {
        host[i] = d * V + token;
        logits[i++] = logFrequency;
      }
    });
    const entries = this.entries!;
    b.native.upload(entries.buffer, host, entries.offset ?? 0);
    const values = { buffer: entries.buffer, dtype: 'f32' as const, shape: [n, 1], offset: (entries.offset ?? 0) + capacity * 4 };
    const rows = { buffer: out.buffer, dtype: 'f32' as const, shape: [depth * V, 1], offset };
    b.native.kvWrite({ c: values, kpe: values, cacheC: rows, cacheKpe: rows, slots: { buffer: entries.buffer, dtype: 'i32', shape: [n], offset: entries.offset ?? 0 }, stream: 0 });
    return true;
  }

  /**
   * The last draft's best tree on the host: each depth's k best log-probabilities, then DDTree's
   * best-first expansion over them (@kdtree/reference's expandDraftTree, the build's own order). A
   * depth's r-th best token has its log-frequency if it was seen (its logit less a log-sum-exp of 0:
   * the unseen tokens' exp(-1e4) adds nothing in f32), UNSEEN_LOGIT if not, and -log V at a depth
   * where nothing was seen (all V logits equal).
   */
  treeLogProbs(budget: number): Float32Array {
    const V = this.vocabSize;
    const ranked = this.ranked;
    const depth = ranked.length;
    const out = new Float32Array(budget).fill(-Infinity);
    if (depth === 0) return out;
    const k = Math.min(budget, V);
    const top = new Float64Array(depth * k);
    ranked.forEach((seen, d) => {
      const row = top.subarray(d * k, (d + 1) * k);
      if (seen.length === 0) row.fill(-Math.log(V));
      else {
        row.fill(UNSEEN_LOGIT);
        row.set(seen.slice(0, k));
      }
    });
    // root excluded
    out.set(expandDraftTree(top, depth, k, budget).logProbs.subarray(1));
    return out;
  }

  dispose(): void {
    if (this.floor) this.b.free(this.floor);
    if (this.entries) this.b.free(this.entries);
    this.floor = undefined;
    this.entries = undefined;
  }
}

/** The largest captured catch-up step of a draft model (tokens; at most its workspace's rows). */
const CATCH_UP_CHUNK = 64;
/** A catch-up longer than this (a prompt) runs as direct prefill passes. */
const CATCH_UP_DIRECT = 1024;

/**
 * A draft model of the same family on the same backend: each request runs the tokens it has not
 * seen yet (a captured step per count), then `depth - 1` greedy decode steps captured as one graph,
 * each writing its logits into the next row of the request's tensor. Its cache keeps only the
 * sequence: the chain's speculative slots are overwritten by the next request.
 */
export class ModelDrafter implements Drafter {
  readonly runner: Runner;
  private processed = 0;

  constructor(
    b: KdtreeBackend,
    readonly model: DeviceModel,
    readonly name: string,
    capacity: number,
    readonly maxDepth = 16,
  ) {
    this.runner = new Runner(b, model, capacity, 'bf16');
  }

  get vocabSize(): number {
    return this.model.config.vocabSize;
  }

  begin(): void {
    this.processed = 0;
  }

  draft({ tokens, depth, out }: DraftRequest): void {
    const r = this.runner;
    const V = this.vocabSize;
    if (tokens.length + depth > r.capacity) throw new EngineError('KDTREE_ENGINE_CAPACITY', `the draft model's cache holds ${r.capacity} tokens; ${tokens.length} + depth ${depth} do not fit`, 'cacheTokens');
    // the graphs write into `out` as captured: one output tensor for the drafter's life
    this.out ??= out;
    if (this.out.buffer !== out.buffer || (this.out.offset ?? 0) !== (out.offset ?? 0)) {
      throw new EngineError('KDTREE_ENGINE_ARGUMENT', 'a model drafter writes every draft into the tensor of its first request', 'out');
    }
    // the tokens it has not run: a captured catch-up step per count up to depth + 1 (what a
    // speculative step accepts, so the counts repeat); more (the tokens of steps decoded without
    // drafting, or the prompt) first run all but the last: in captured steps of power-of-two
    // counts (a try after auto's plain decode steps then costs the device's time, not ~100 host
    // calls), or a prompt of more than CATCH_UP_DIRECT tokens in direct prefill passes
    let fresh = tokens.slice(this.processed);
    const stepMax = Math.min(r.model.workspace.rows, depth + 1);
    if (fresh.length > stepMax) {
      const lead = fresh.slice(0, -1);
      if (lead.length > CATCH_UP_DIRECT) r.prefill(lead, this.processed, undefined);
      else this.catchUp(lead, out);
      this.processed = tokens.length - 1;
      fresh = fresh.slice(-1);
    }
    r.committed = this.processed;
    const k = fresh.length;
    const input = this.input();
    r.b.native.upload(input.buffer, Int32Array.from(fresh));
    r.launch(r.graph(`catch-up ${k}`, (s) => r.queueAppend(k, view(input, [k]), view(out, [1, V]), s), k));
    if (depth > 1) {
      r.launch(
        // the host's committed length is still this.processed: the catch-up's k slots come first
        r.graph(
          `chain ${depth}`,
          (s) => {
            for (let d = 1; d < depth; d++) r.queueAppend(1, r.token, view(out, [1, V], d * V), s);
          },
          k + depth - 1,
        ),
      );
    }
    this.processed = tokens.length;
  }

  /** Runs `lead` (tokens after the processed ones) in captured steps of power-of-two counts; their logits are scratch. */
  private catchUp(lead: readonly number[], out: DeviceTensor): void {
    const r = this.runner;
    const V = this.vocabSize;
    const input = this.input();
    const most = 2 ** Math.floor(Math.log2(Math.min(r.model.workspace.rows, input.shape[0])));
    for (let i = 0; i < lead.length; ) {
      const k = 2 ** Math.floor(Math.log2(Math.min(most, lead.length - i)));
      // upload() queues behind the previous step on stream 0, so that step has read its ids
      r.b.native.upload(input.buffer, Int32Array.from(lead.slice(i, i + k)));
      r.committed = this.processed + i;
      r.launch(r.graph(`catch-up ${k}`, (s) => r.queueAppend(k, view(input, [k]), view(out, [1, V]), s), k));
      i += k;
    }
  }

  private inputIds: DeviceTensor | undefined;
  private out: DeviceTensor | undefined;

  /** The catch-up steps' token ids: a step's accepted tokens, or a power-of-two chunk of tokens decoded without drafting. */
  private input(): DeviceTensor {
    this.inputIds ??= this.runner.own(this.runner.b.zeros('i32', [Math.max(this.maxDepth + 1, CATCH_UP_CHUNK)]));
    return this.inputIds;
  }

  dispose(): void {
    this.runner.dispose();
    this.model.dispose();
  }
}
