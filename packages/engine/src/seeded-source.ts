/**
 * Seeded random weights made in memory, for models too large to write as a bundle first (Kimi K2's
 * real dimensions on a GPU host with a small disk): the engine loads them through the same layer
 * loaders as a checkpoint. Every value is a function of (seed, tensor, row), so a row selection
 * (a split projection, a tensor-parallel shard) reads the rows the whole tensor would have.
 *
 * Rows repeat with a period of `distinctRows` and experts with a period of `distinctExperts`: the
 * device still holds and reads every row and expert (the bytes a step moves are the model's), but
 * the host generates a bounded amount. Scales keep activations O(1): float weights ~ N(0, 1/K),
 * INT4 codes uniform in [-8, 7] with a group scale of 1/(4.6 sqrt(K)).
 */
import { f32ToBf16 } from '@kdtree/format';
import { parseModelConfig, type ModelConfig } from '@kdtree/reference';
import { pickCols, type HostBf16, type HostInt4, type WeightReader } from './model-source.js';
import type { Block } from './shard.js';

export interface SeededSourceOptions {
  seed: number;
  /** Which weights are INT4: routed experts (Kimi K2's scheme), every MLP projection, or none. */
  quant?: 'kimi-k2' | 'seed' | 'none';
  distinctRows?: number;
  distinctExperts?: number;
}

/** FNV-1a of a string, for per-tensor seeds. */
function hash(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

/** xorshift32 stream. */
function stream(seed: number): () => number {
  let x = seed >>> 0 || 0x9e3779b9;
  return () => {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    return x >>> 0;
  };
}

const EXPERT = /\.experts\.(\d+)\./;

export class SeededSource implements WeightReader {
  readonly config: ModelConfig;
  readonly path: string;
  private readonly quant: 'kimi-k2' | 'seed' | 'none';
  private readonly distinctRows: number;
  private readonly distinctExperts: number;
  /** The last whole INT4 tensors made, by canonical name: experts past distinctExperts reuse them. */
  private readonly made = new Map<string, HostInt4>();

  constructor(
    readonly configJson: Record<string, unknown>,
    private readonly options: SeededSourceOptions,
  ) {
    this.config = parseModelConfig(configJson, 'seeded weights');
    this.quant = options.quant ?? 'kimi-k2';
    this.distinctRows = options.distinctRows ?? 4096;
    this.distinctExperts = options.distinctExperts ?? 8;
    this.path = `seeded weights (seed ${options.seed}, ${this.quant})`;
  }

  int4(name: string): { shape: [number, number]; group_size: number; scale_dtype: 'BF16' } | undefined {
    const mlp = /\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$/.exec(name);
    if (mlp === null || this.quant === 'none') return undefined;
    if (this.quant === 'kimi-k2' && !mlp[1]?.startsWith('experts.')) return undefined;
    return { shape: this.shapeOf(name), group_size: 32, scale_dtype: 'BF16' };
  }

  private shapeOf(name: string): [number, number] {
    const c = this.config;
    const inter = name.includes('.experts.') ? c.moeIntermediateSize : name.includes('shared_experts') ? c.moeIntermediateSize * c.nSharedExperts : c.intermediateSize;
    return name.endsWith('down_proj.weight') ? [c.hiddenSize, inter] : [inter, c.hiddenSize];
  }

  /** The seed of row `row` of `name` (experts past distinctExperts repeat earlier ones). */
  private rowSeed(name: string, row: number): number {
    const canonical = name.replace(EXPERT, (_, e: string) => `.experts.${Number(e) % this.distinctExperts}.`);
    return (hash(canonical) ^ Math.imul((row % this.distinctRows) + 1, 0x9e3779b9) ^ this.options.seed) >>> 0;
  }

  async readF32(name: string, shape: readonly number[]): Promise<Float32Array> {
    const n = shape.reduce((a, b) => a * b, 1);
    const next = stream(this.rowSeed(name, 0));
    const out = new Float32Array(n);
    const bias = name.endsWith('e_score_correction_bias');
    for (let i = 0; i < n; i++) out[i] = bias ? (next() / 2 ** 32) * 0.1 : 1 + ((next() / 2 ** 32) - 0.5) * 0.2;
    return out;
  }

  async readBf16(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostBf16> {
    const whole = this.wholeBf16(name, shape, rows);
    if (cols === undefined) return whole;
    return { rows: whole.rows, cols: cols.count, bits: pickCols(whole.bits, shape[1], cols.start, cols.count) };
  }

  private wholeBf16(name: string, shape: readonly [number, number], rows?: readonly number[]): HostBf16 {
    const [r, k] = shape;
    const list = rows ?? Array.from({ length: r }, (_, i) => i);
    const scale = name.includes('embed_tokens') ? 1 : (name === 'lm_head.weight' ? 4 : 1) / Math.sqrt(k);
    const bits = new Uint16Array(list.length * k);
    const cache = new Map<number, Uint16Array>();
    list.forEach((row, i) => {
      const key = row % this.distinctRows;
      let values = cache.get(key);
      if (values === undefined) {
        values = new Uint16Array(k);
        const next = stream(this.rowSeed(name, row));
        // sum of four uniforms: mean 0, variance 1/3
        for (let j = 0; j < k; j++) values[j] = f32ToBf16(scale * 1.732 * ((next() + next() + next() + next()) / 2 ** 32 - 2));
        cache.set(key, values);
      }
      bits.set(values, i * k);
    });
    return { rows: list.length, cols: k, bits };
  }

  async readInt4(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostInt4> {
    const whole = this.wholeInt4(name, shape, rows);
    if (cols === undefined) return whole;
    const [, k] = shape;
    return { ...whole, cols: cols.count, qw: pickCols(whole.qw, k / 8, cols.start / 8, cols.count / 8), sc: pickCols(whole.sc, k / whole.group, cols.start / whole.group, cols.count / whole.group) };
  }

  private wholeInt4(name: string, shape: readonly [number, number], rows?: readonly number[]): HostInt4 {
    const canonical = name.replace(EXPERT, (_, e: string) => `.experts.${Number(e) % this.distinctExperts}.`);
    const hit = rows === undefined ? this.made.get(canonical) : undefined;
    if (hit !== undefined) return hit;
    const made = this.makeInt4(name, shape, rows);
    if (rows === undefined && EXPERT.test(name)) {
      if (this.made.size >= 3 * this.distinctExperts) this.made.delete(this.made.keys().next().value!);
      this.made.set(canonical, made);
    }
    return made;
  }

  private makeInt4(name: string, shape: readonly [number, number], rows?: readonly number[]): HostInt4 {
    const [r, k] = shape;
    const list = rows ?? Array.from({ length: r }, (_, i) => i);
    const group = 32;
    const qw = new Int32Array((list.length * k) / 8);
    const sc = new Uint16Array((list.length * k) / group);
    const scale = f32ToBf16(1 / (4.6 * Math.sqrt(k)));
    const cache = new Map<number, Int32Array>();
    list.forEach((row, i) => {
      const key = row % this.distinctRows;
      let words = cache.get(key);
      if (words === undefined) {
        words = new Int32Array(k / 8);
        const next = stream(this.rowSeed(name, row));
        for (let j = 0; j < words.length; j++) words[j] = next() | 0;
        cache.set(key, words);
      }
      qw.set(words, (i * k) / 8);
      sc.fill(scale, (i * k) / group, ((i + 1) * k) / group);
    });
    return { rows: list.length, cols: k, group, scaleDtype: 'bf16', qw, sc };
  }

  async close(): Promise<void> {}
}
