/**
 * Where a model's weights come from: a KDTR bundle (config and INT4 descriptors in its metadata), a
 * HuggingFace directory or a safetensors checkpoint with a config.json beside it (INT4 weights in
 * compressed-tensors' pack-quantized form are read in place). Tensors are read one at a time, as
 * the layer that owns them asks, so loading streams with bounded host memory.
 */
import { f16ArrayToF32, f32ArrayToBf16, openTensors, typedView, type AnyTensorStore, type TensorInfo } from '@kdtree/format';
import { describeCompressedTensors, findCompressedTensorsConfig, floatToF32, readInt4, readQuantizationMetadata, type Int4Descriptor, type QuantizationMetadata } from '@kdtree/quant';
import { configFor, isDflashConfig, parseModelConfig, type ModelConfig } from '@kdtree/reference';
import { EngineError, modelError } from './errors.js';
import { checkShard, WHOLE, type Block, type Shard } from './shard.js';

/** An INT4 weight in the checkpoint layout: qw i32 [rows, K/8], sc [rows, K/group]. */
export interface HostInt4 {
  rows: number;
  cols: number;
  group: number;
  scaleDtype: 'bf16' | 'f32';
  qw: Int32Array;
  sc: Uint16Array | Float32Array;
}

/** A float weight as bf16 bits, row-major [rows, cols]. */
export interface HostBf16 {
  rows: number;
  cols: number;
  bits: Uint16Array;
}

/** The weight reads a layer makes: a checkpoint (ModelSource), or weights made in memory (SeededSource). */
export interface WeightReader {
  /** Names the source in errors. */
  readonly path: string;
  readonly config: ModelConfig;
  /** The HF config.json object the config was parsed from. */
  readonly configJson: Record<string, unknown>;
  /** The INT4 descriptor of a weight, or undefined when it is a float tensor. */
  int4(name: string): Pick<Int4Descriptor, 'shape' | 'group_size' | 'scale_dtype'> | undefined;
  readF32(name: string, shape: readonly number[]): Promise<Float32Array>;
  /**
   * A float weight [rows, cols] as bf16 bits: only the given rows in that order (all when absent)
   * and of each only the columns `cols` (a row-parallel shard's block of K; all when absent).
   */
  readBf16(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostBf16>;
  /** An INT4 weight's checkpoint parts, rows and columns selected as readBf16's (`cols` in whole groups). */
  readInt4(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostInt4>;
  close(): Promise<void>;
}

export class ModelSource implements WeightReader {
  private constructor(
    readonly path: string,
    readonly store: AnyTensorStore,
    readonly config: ModelConfig,
    /** The HF config.json object (what `kdtree inspect` shows, what a drafter is checked against). */
    readonly configJson: Record<string, unknown>,
    readonly quantization: QuantizationMetadata | undefined,
    /** Tensor name prefix of this checkpoint ('language_model.' inside Kimi K2.5's wrapper). */
    readonly prefix: string,
    /**
     * The tensor-parallel rank this source is read for: with more than one rank, a selection of
     * rows or of K reads only the bytes of those rows, or of each row its block of K
     * (TensorStore.readRange), unchecked.
     */
    readonly shard: Shard,
    /** A tensor-parallel rank's pieces of a tensor at most this many bytes apart are read as one range (coalesceReads). */
    readonly readGap: number,
  ) {}

  /**
   * Opens a checkpoint. `shard` (a tensor-parallel rank): selections are then read as byte ranges
   * without their CRC-32 — a checksum covers a whole tensor, so checking it would read every byte
   * on every rank (`kdtree verify` checks the bundle once); without it every read is a whole,
   * checked tensor, selections cut from it in memory. `readGap`: see coalesceReads (default
   * READ_GAP; 0 reads exactly the selected bytes).
   */
  static async open(path: string, options: { config?: string; shard?: Shard; readGap?: number } = {}): Promise<ModelSource> {
    const shard = checkShard(options.shard ?? WHOLE);
    const store = await openTensors(path);
    try {
      const { json, source } = await configFor(store, path, options.config);
      if (isDflashConfig(json)) {
        throw new EngineError('KDTREE_ENGINE_MODEL', `${path} is a DFlash drafter (${source}: architectures ${JSON.stringify((json as { architectures: unknown }).architectures)}), not a model to decode or draft with as one: pass it as a drafter, dflash:${path}`, 'architectures');
      }
      const config = parseModelConfig(json, source);
      let quantization = readQuantizationMetadata(store);
      if (quantization === undefined) {
        const found = findCompressedTensorsConfig(json as Record<string, unknown>, source);
        if (found) {
          quantization = await describeCompressedTensors(store.tensors, found, async (name) =>
            Array.from(typedView(store.get(name).dtype, await store.read(name)) as ArrayLike<number | bigint>, Number),
          );
        }
      }
      const prefix = config.weightPrefix || (store.has('language_model.model.embed_tokens.weight') ? 'language_model.' : '');
      const readGap = options.readGap ?? READ_GAP;
      if (!Number.isInteger(readGap) || readGap < 0) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `readGap must be a non-negative integer of bytes, got ${readGap}`, 'readGap');
      return new ModelSource(path, store, config, json as Record<string, unknown>, quantization, prefix, shard, readGap);
    } catch (error) {
      await store.close();
      throw error;
    }
  }

  /** The metadata of a KDTR bundle ({} for safetensors). */
  get metadata(): Record<string, unknown> {
    return this.store.metadata as Record<string, unknown>;
  }

  private full(name: string): string {
    return this.prefix + name;
  }

  /** The INT4 descriptor of a weight, or undefined when it is stored as a float tensor. */
  int4(name: string): Int4Descriptor | undefined {
    return this.quantization?.tensors[this.full(name)];
  }

  /** Shape of a weight as the model sees it ([N, K] for INT4 weights). */
  shape(name: string): number[] {
    const d = this.int4(name);
    if (d !== undefined) return [...d.shape];
    return [...this.info(name).shape];
  }

  private info(name: string): TensorInfo {
    const full = this.full(name);
    if (!this.store.has(full)) throw modelError(full, `missing (a ${this.config.modelType} of ${this.config.numLayers} layers and ${this.config.nRoutedExperts} experts needs it)`, this.path);
    return this.store.get(full);
  }

  private checkShape(name: string, actual: readonly number[], expected: readonly number[]): void {
    if (actual.length !== expected.length || actual.some((d, i) => d !== expected[i])) {
      throw modelError(this.full(name), `has shape [${actual.join(', ')}], the config needs [${expected.join(', ')}]`, this.path);
    }
  }

  /** A small float tensor (norm weights, router bias) widened to f32. */
  async readF32(name: string, shape: readonly number[]): Promise<Float32Array> {
    if (this.int4(name) !== undefined) throw modelError(this.full(name), 'is INT4; the engine keeps norms and router biases in float', this.path);
    const info = this.info(name);
    this.checkShape(name, info.shape, shape);
    return floatToF32(info.dtype, await this.store.read(this.full(name)), this.full(name));
  }

  /** Whether selections are read as byte ranges (a tensor-parallel rank) rather than cut from whole reads. */
  private get ranged(): boolean {
    return this.shard.world > 1;
  }

  /**
   * Bytes [colStart, colStart + colBytes) of each of the given rows (of `rowBytes` each) of tensor
   * `full`, rows in that order, packed: a row-parallel shard's block of K is such a column block,
   * a column-parallel one's rows are whole-row blocks. A tensor-parallel rank reads them as
   * unchecked ranged reads (see open), the pieces coalesced by coalesceReads (those back to back,
   * or at most `readGap` apart, in one read), a few reads at a time; a whole-model source cuts
   * them from the whole checked tensor.
   */
  private async readBlocks(full: string, rowBytes: number, rows: readonly number[], colStart = 0, colBytes = rowBytes): Promise<Uint8Array> {
    const out = new Uint8Array(rows.length * colBytes);
    if (!this.ranged) {
      const all = await this.store.read(full);
      rows.forEach((r, i) => out.set(all.subarray(r * rowBytes + colStart, r * rowBytes + colStart + colBytes), i * colBytes));
      return out;
    }
    const spans = coalesceReads(rows.map((r) => r * rowBytes + colStart), colBytes, this.readGap);
    let next = 0;
    const reader = async () => {
      while (next < spans.length) {
        const { start, end, first, count } = spans[next++];
        const target = out.subarray(first * colBytes, (first + count) * colBytes);
        if (end - start === count * colBytes) {
          // back to back in the file as in `out`: straight there
          await this.store.readRange(full, start, end - start, target, { verify: false });
          continue;
        }
        const span = await this.store.readRange(full, start, end - start, undefined, { verify: false });
        for (let i = 0; i < count; i++) {
          const at = rows[first + i] * rowBytes + colStart - start;
          target.set(span.subarray(at, at + colBytes), i * colBytes);
        }
      }
    };
    await Promise.all(Array.from({ length: Math.min(READS_IN_FLIGHT, spans.length) }, reader));
    return out;
  }

  private checkCols(name: string, cols: Block | undefined, k: number, unit: number, unitName: string): void {
    if (cols === undefined) return;
    if (cols.start < 0 || cols.count < 1 || cols.start + cols.count > k || cols.start % unit !== 0 || cols.count % unit !== 0) {
      throw modelError(this.full(name), `columns [${cols.start}, ${cols.start + cols.count}) of K = ${k} are not whole ${unitName}s of ${unit}`, this.path);
    }
  }

  async readBf16(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostBf16> {
    const info = this.info(name);
    this.checkShape(name, info.shape, shape);
    const [r, c] = shape;
    this.checkCols(name, cols, c, 1, 'column');
    const full = this.full(name);
    const elementBytes = ({ BF16: 2, F16: 2, F32: 4, F64: 8 } as Record<string, number | undefined>)[info.dtype];
    if (elementBytes === undefined) throw modelError(full, `is ${info.dtype}; expected a float tensor (BF16, F16, F32) or an INT4 descriptor`, this.path);
    const selected = rows ?? (cols === undefined ? undefined : range(r));
    const block = cols ?? { start: 0, count: c };
    const bytes = selected === undefined ? await this.store.read(full) : await this.readBlocks(full, c * elementBytes, selected, block.start * elementBytes, block.count * elementBytes);
    let bits: Uint16Array;
    switch (info.dtype) {
      case 'BF16':
        bits = typedView('BF16', bytes);
        break;
      case 'F16':
        bits = f32ArrayToBf16(f16ArrayToF32(typedView('F16', bytes)));
        break;
      default:
        bits = f32ArrayToBf16(floatToF32(info.dtype, bytes, full));
    }
    return { rows: selected?.length ?? r, cols: block.count, bits };
  }

  async readInt4(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostInt4> {
    const d = this.int4(name);
    if (d === undefined) throw modelError(this.full(name), 'is not INT4', this.path);
    this.checkShape(name, d.shape, shape);
    const [n, k] = shape;
    const g = d.group_size;
    this.checkCols(name, cols, k, g, 'INT4 group');
    const scaleDtype = d.scale_dtype === 'BF16' ? 'bf16' : 'f32';
    if (rows === undefined && cols === undefined) {
      const m = await readInt4(this.store, this.full(name), d);
      return { rows: n, cols: k, group: m.groupSize, scaleDtype, qw: m.packed, sc: m.scales };
    }
    const selected = rows ?? range(n);
    const scBytes = scaleDtype === 'bf16' ? 2 : 4;
    // K block [start, start + count) in whole groups: qw's 8 values per i32, sc's one per group
    const block = cols ?? { start: 0, count: k };
    const [qwBytes, scRaw] = await Promise.all([
      this.readBlocks(d.qw, (k / 8) * 4, selected, (block.start / 8) * 4, (block.count / 8) * 4),
      this.readBlocks(d.sc, (k / g) * scBytes, selected, (block.start / g) * scBytes, (block.count / g) * scBytes),
    ]);
    const qw = new Int32Array(qwBytes.buffer, qwBytes.byteOffset, qwBytes.byteLength / 4);
    const sc: Uint16Array | Float32Array = scaleDtype === 'bf16' ? new Uint16Array(scRaw.buffer, scRaw.byteOffset, scRaw.byteLength / 2) : new Float32Array(scRaw.buffer, scRaw.byteOffset, scRaw.byteLength / 4);
    return { rows: selected.length, cols: block.count, group: g, scaleDtype, qw, sc };
  }

  async close(): Promise<void> {
    await this.store.close();
  }
}

type Rows = Uint16Array | Int32Array | Float32Array;

/** Ranged reads a rank keeps in flight for one tensor. */
const READS_IN_FLIGHT = 16;

/**
 * The default gap up to which a rank's pieces of a tensor are read as one range: a page. The
 * storage reads whole pages, so skipping less saves no I/O, while every read costs a call: the
 * K blocks of a row-parallel weight whose rows are short (an expert's INT4 down_proj: 1 KiB rows,
 * 128 bytes a rank at tp 8) are read whole, those of long rows (o_proj: 16 KiB bf16 rows) as one
 * read per row of only the rank's block.
 */
export const READ_GAP = 4096;

/** The largest span coalesceReads makes of several pieces (a bound on the scratch it needs). */
const MAX_SPAN = 8 << 20;

/** One ranged read of coalesceReads: file bytes [start, end), holding pieces first..first+count-1. */
export interface ReadSpan {
  start: number;
  end: number;
  first: number;
  count: number;
}

/**
 * Groups pieces of `length` bytes at `offsets` (in the order wanted) into ranged reads: a piece
 * joins the read before it when it starts at or after that read's end and at most `gap` bytes
 * later, and the read stays within MAX_SPAN (one piece longer than that is a read of its own).
 */
export function coalesceReads(offsets: readonly number[], length: number, gap: number): ReadSpan[] {
  const spans: ReadSpan[] = [];
  let last: ReadSpan | undefined;
  offsets.forEach((start, i) => {
    if (last !== undefined && start >= last.end && start - last.end <= gap && start + length - last.start <= MAX_SPAN) {
      last.end = start + length;
      last.count++;
      return;
    }
    last = { start, end: start + length, first: i, count: 1 };
    spans.push(last);
  });
  return spans;
}

const range = (n: number) => Array.from({ length: n }, (_, i) => i);

/** Columns [start, start + count) of every row of a row-major [*, width] array. */
export function pickCols<T extends Rows>(data: T, width: number, start: number, count: number): T {
  const rows = data.length / width;
  const out = new (data.constructor as new (n: number) => T)(rows * count);
  for (let r = 0; r < rows; r++) out.set(data.subarray(r * width + start, r * width + start + count), r * count);
  return out;
}

/** The given rows of a row-major [*, width] array, in that order. */
export function pickRows<T extends Rows>(data: T, width: number, rows: readonly number[]): T {
  const out = new (data.constructor as new (n: number) => T)(rows.length * width);
  rows.forEach((r, i) => out.set(data.subarray(r * width, (r + 1) * width), i * width));
  return out;
}

