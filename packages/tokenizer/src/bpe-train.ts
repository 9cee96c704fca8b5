import { TokenizerError } from './errors.js';
import { kimiPieceRegExp } from './pattern.js';

/**
 * Byte-level BPE training: starting from the 256 single bytes (rank = byte value), repeatedly merge
 * the most frequent adjacent pair of tokens within the pre-tokenized words of `corpus` and give the
 * new token the next rank, until there are `numRanks` tokens. Ties go to the pair of lowest
 * (left, right) ids, so the result depends only on the corpus and `numRanks`. The ranks feed
 * tiktoken's encoder, which merges the lowest-ranked pair first: ranks in merge order are what
 * makes it reproduce the training merges.
 */
export function trainBpe(corpus: string, numRanks: number): Uint8Array[] {
  if (!Number.isInteger(numRanks) || numRanks < 256) throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', 'trainBpe: numRanks must be an integer >= 256 (one rank per byte first)', { actual: String(numRanks) });
  const tokens: Uint8Array[] = Array.from({ length: 256 }, (_, b) => Uint8Array.of(b));
  const tokenIds = new Map<string, number>(tokens.map((t, id) => [latin1(t), id]));

  // the distinct words and their counts
  const counts = new Map<string, number>();
  const encoder = new TextEncoder();
  for (const m of corpus.matchAll(kimiPieceRegExp())) {
    const key = latin1(encoder.encode(m[0]));
    counts.set(key, (counts.get(key) ?? 0) + 1);
  }
  const words: number[][] = [];
  const freq: number[] = [];
  for (const [key, n] of counts) {
    if (key.length < 2) continue;
    words.push(Array.from(key, (c) => c.charCodeAt(0)));
    freq.push(n);
  }

  // pair -> total count and the words it occurs in; a max-heap of (count, pair) with stale entries
  // skipped on pop, so each merge touches only the words that contain its pair
  const pairCount = new Map<number, number>();
  const pairWords = new Map<number, Set<number>>();
  const heap = new PairHeap();
  const key = (a: number, b: number) => a * 2 ** 21 + b;
  const addPairs = (w: number, sign: 1 | -1, touched: Set<number>) => {
    const word = words[w];
    for (let i = 0; i + 1 < word.length; i++) {
      const k = key(word[i], word[i + 1]);
      pairCount.set(k, (pairCount.get(k) ?? 0) + sign * freq[w]);
      if (sign > 0) {
        let set = pairWords.get(k);
        if (set === undefined) pairWords.set(k, (set = new Set()));
        set.add(w);
      }
      touched.add(k);
    }
  };
  const initial = new Set<number>();
  for (let w = 0; w < words.length; w++) addPairs(w, 1, initial);
  for (const k of initial) heap.push(pairCount.get(k)!, k);

  while (tokens.length < numRanks) {
    const best = heap.pop((count, k) => pairCount.get(k) === count && count > 0);
    if (best === undefined) {
      throw new TokenizerError('KDTREE_TOKENIZER_VOCAB', `the corpus supports only ${tokens.length} ranks, ${numRanks} were asked for`, { expected: `numRanks <= ${tokens.length}, or a larger corpus` });
    }
    const a = Math.floor(best / 2 ** 21);
    const b = best % 2 ** 21;
    const bytes = concat(tokens[a], tokens[b]);
    const k = latin1(bytes);
    // two merge paths can spell the same bytes ("ab"+"c", "a"+"bc"): one token, one rank
    let id = tokenIds.get(k);
    if (id === undefined) {
      id = tokens.length;
      tokens.push(bytes);
      tokenIds.set(k, id);
    }
    const touched = new Set<number>();
    for (const w of [...pairWords.get(best)!]) {
      addPairs(w, -1, touched);
      const word = words[w];
      const merged: number[] = [];
      for (let i = 0; i < word.length; i++) {
        if (i + 1 < word.length && word[i] === a && word[i + 1] === b) {
          merged.push(id);
          i++;
        } else merged.push(word[i]);
      }
      words[w] = merged;
      addPairs(w, 1, touched);
    }
    pairWords.delete(best);
    pairCount.delete(best);
    for (const t of touched) {
      const c = pairCount.get(t);
      if (c !== undefined && c > 0) heap.push(c, t);
    }
  }
  return tokens;
}

function latin1(bytes: Uint8Array): string {
  let s = '';
  for (let i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]);
  return s;
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

/** A binary max-heap of (count, pair key); ties: the smaller key (lower left id, then right) first. */
class PairHeap {
  private readonly counts: number[] = [];
  private readonly keys: number[] = [];

  push(count: number, key: number): void {
    this.counts.push(count);
    this.keys.push(key);
    let i = this.counts.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!this.before(i, p)) break;
      this.swap(i, p);
      i = p;
    }
  }

  /** Pops entries until one is `valid`; undefined when the heap runs out. */
  pop(valid: (count: number, key: number) => boolean): number | undefined {
    while (this.counts.length > 0) {
      const count = this.counts[0];
      const key = this.keys[0];
      const lastCount = this.counts.pop()!;
      const lastKey = this.keys.pop()!;
      if (this.counts.length > 0) {
        this.counts[0] = lastCount;
        this.keys[0] = lastKey;
        this.siftDown(0);
      }
      if (valid(count, key)) return key;
    }
    return undefined;
  }

  private siftDown(i: number): void {
    const n = this.counts.length;
    for (;;) {
      const l = 2 * i + 1;
      const r = l + 1;
      let m = i;
      if (l < n && this.before(l, m)) m = l;
      if (r < n && this.before(r, m)) m = r;
      if (m === i) return;
      this.swap(i, m);
      i = m;
    }
  }

  private before(i: number, j: number): boolean {
    return this.counts[i] > this.counts[j] || (this.counts[i] === this.counts[j] && this.keys[i] < this.keys[j]);
  }

  private swap(i: number, j: number): void {
    [this.counts[i], this.counts[j]] = [this.counts[j], this.counts[i]];
    [this.keys[i], this.keys[j]] = [this.keys[j], this.keys[i]];
  }
}
