/**
 * A shard directory (what `kdtree shard MODEL --tp N -o DIR` writes): one KDTR file per rank
 * holding that rank's block of every weight, and an index naming the files and, per weight, its
 * split and every rank's block. Rank r opens only its own file. ShardSource presents it as the
 * whole model (the whole tensors' names and shapes), so the layers load it exactly as they load
 * the unsharded bundle: a read of rows or of a K block is moved into the file's coordinates, and
 * one outside the block the file holds is refused (the shards were cut by another split).
 */
import { stat } from 'node:fs/promises';
import { join } from 'node:path';
import { formatCrc32, readJsonFile } from '@kdtree/format';
import type { Int4Descriptor } from '@kdtree/quant';
import type { ModelConfig } from '@kdtree/reference';
import { EngineError, modelError } from './errors.js';
import { ModelSource, type HostBf16, type HostInt4, type WeightReader } from './model-source.js';
import { checkShard, WHOLE, type Block, type Shard, type Split } from './shard.js';

/** The index's file name inside a shard directory. */
export const SHARD_INDEX_NAME = 'tp-index.json';
export const SHARD_INDEX_SCHEMA = 'kdtree.tp-shards/1';
/** The metadata key of a rank's file: { rank, world, index }. */
export const SHARD_METADATA_KEY = 'kdtree.tp_shard';

export const rankFileName = (rank: number) => `rank-${rank}.kdtr`;

export interface ShardIndexTensor {
  /** The whole tensor's shape (as the config gives it; [N, K] for an INT4 weight). */
  shape: number[];
  split: Split;
  /** Per rank, its block of dim 0 (column) or dim 1 (row) as [start, count]; absent when replicated. */
  blocks?: [number, number][];
}

export interface ShardIndex {
  schema: typeof SHARD_INDEX_SCHEMA;
  world: number;
  /** The bundle the shards were cut from: its file name, format and header CRC-32s (which cover every tensor's CRC-32). */
  source: { name: string; format: string; header_crc32: string[] };
  ranks: { rank: number; file: string; file_length: number; header_crc32: string }[];
  /** By weight name, as the layers read them (without a checkpoint's prefix). */
  tensors: Record<string, ShardIndexTensor>;
}

/** The index path when `path` is a shard directory, else undefined. */
export async function shardIndexPath(path: string): Promise<string | undefined> {
  if (!(await stat(path).catch(() => undefined))?.isDirectory()) return undefined;
  const index = join(path, SHARD_INDEX_NAME);
  return (await stat(index).catch(() => undefined))?.isFile() ? index : undefined;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

const isCount = (v: unknown, min: number) => Number.isSafeInteger(v) && (v as number) >= min;

/** Reads and checks an index; every problem names the file and the field. */
export async function readShardIndex(path: string): Promise<ShardIndex> {
  const j = await readJsonFile(path, 'tensor-parallel shard index');
  const fail = (field: string, expected: string, actual?: unknown) =>
    new EngineError('KDTREE_ENGINE_MODEL', `${path}: ${field}: expected ${expected}${actual === undefined ? '' : `, found ${JSON.stringify(actual)?.slice(0, 80)}`}`, field);
  if (!isObject(j)) throw fail('(top)', 'a JSON object', j);
  if (j.schema !== SHARD_INDEX_SCHEMA) throw fail('schema', `"${SHARD_INDEX_SCHEMA}"`, j.schema);
  if (!isCount(j.world, 1)) throw fail('world', 'a positive integer', j.world);
  const world = j.world as number;
  if (!isObject(j.source) || typeof j.source.name !== 'string') throw fail('source', 'an object with the source bundle name', j.source);
  if (!Array.isArray(j.ranks) || j.ranks.length !== world) throw fail('ranks', `an array of ${world} rank files`, j.ranks);
  j.ranks.forEach((r: unknown, i) => {
    if (!isObject(r) || r.rank !== i || typeof r.file !== 'string' || r.file === '' || /[\\/]/.test(r.file) || !isCount(r.file_length, 1) || typeof r.header_crc32 !== 'string') {
      throw fail(`ranks[${i}]`, `{ rank: ${i}, file: a file name in the directory, file_length, header_crc32 }`, r);
    }
  });
  if (!isObject(j.tensors)) throw fail('tensors', 'an object of weight name -> split', j.tensors);
  for (const [name, t] of Object.entries(j.tensors)) {
    const at = `tensors["${name}"]`;
    if (!isObject(t) || !Array.isArray(t.shape) || !t.shape.every((d) => isCount(d, 1))) throw fail(`${at}.shape`, 'positive integers', isObject(t) ? t.shape : t);
    if (t.split !== 'column' && t.split !== 'row' && t.split !== 'replicated') throw fail(`${at}.split`, '"column", "row" or "replicated"', t.split);
    if (t.split === 'replicated') continue;
    const dim = t.split === 'column' ? 0 : 1;
    const size = (t.shape as number[])[dim];
    if (!Array.isArray(t.blocks) || t.blocks.length !== world || !t.blocks.every((b) => Array.isArray(b) && b.length === 2 && isCount(b[0], 0) && isCount(b[1], 1) && b[0] + b[1] <= size)) {
      throw fail(`${at}.blocks`, `${world} blocks [start, count] within its dim ${dim} (${size})`, t.blocks);
    }
  }
  return j as unknown as ShardIndex;
}

/** Where a read lands in the file: its rows and K block there (undefined: all of them). */
interface LocalRead {
  shape: [number, number];
  rows?: number[];
  cols?: Block;
}

export class ShardSource implements WeightReader {
  private constructor(
    /** The shard directory. */
    readonly path: string,
    readonly indexPath: string,
    readonly index: ShardIndex,
    readonly shard: Shard,
    /** This rank's file, read whole and checked (every byte of it is this rank's). */
    readonly file: ModelSource,
  ) {}

  /**
   * Opens rank `shard.rank`'s file of the shard directory `dir`. Throws when the index was cut
   * for another number of ranks than `shard.world`, naming the index and both numbers.
   */
  static async open(dir: string, options: { config?: string; shard?: Shard } = {}): Promise<ShardSource> {
    const shard = checkShard(options.shard ?? WHOLE);
    const indexPath = join(dir, SHARD_INDEX_NAME);
    const index = await readShardIndex(indexPath);
    if (index.world !== shard.world) {
      throw new EngineError(
        'KDTREE_ENGINE_SHARD',
        `${indexPath}: the shards were cut for tp ${index.world}, but the model is being loaded on tp ${shard.world} (run with --tp ${index.world}, or cut it again: kdtree shard MODEL --tp ${shard.world} -o DIR)`,
        'tp',
      );
    }
    const rank = index.ranks[shard.rank];
    const file = await ModelSource.open(join(dir, rank.file), { config: options.config });
    try {
      const header = 'shards' in file.store ? file.store.shards[0] : undefined;
      if (header === undefined || formatCrc32(header.headerCrc32) !== rank.header_crc32 || header.fileLength !== rank.file_length) {
        const found = header === undefined ? file.store.format : `header CRC-32 ${formatCrc32(header.headerCrc32)}, ${header.fileLength} bytes`;
        throw modelError(rank.file, `is not the file ${indexPath} was written with (expected header CRC-32 ${rank.header_crc32}, ${rank.file_length} bytes; found ${found}): cut the model again`, dir);
      }
      const mark = file.metadata[SHARD_METADATA_KEY] as Record<string, unknown> | undefined;
      if (!isObject(mark) || mark.rank !== shard.rank || mark.world !== shard.world) {
        throw modelError(`metadata["${SHARD_METADATA_KEY}"]`, `expected rank ${shard.rank} of ${shard.world} (as ${indexPath} names this file), found ${JSON.stringify(mark)}`, file.path);
      }
      return new ShardSource(dir, indexPath, index, shard, file);
    } catch (error) {
      await file.close();
      throw error;
    }
  }

  get config(): ModelConfig {
    return this.file.config;
  }

  get configJson(): Record<string, unknown> {
    return this.file.configJson;
  }

  /** The rank file's metadata (the source bundle's, with this rank's INT4 shapes). */
  get metadata(): Record<string, unknown> {
    return this.file.metadata;
  }

  private entry(name: string): ShardIndexTensor {
    const t = this.index.tensors[name];
    if (t === undefined) throw new EngineError('KDTREE_ENGINE_SHARD', `${this.indexPath}: ${name} is not in the shard index, but the model reads it (the shards were cut for another model or by another version)`, name);
    return t;
  }

  private mismatch(name: string, held: string, asked: string): EngineError {
    return new EngineError('KDTREE_ENGINE_SHARD', `${this.indexPath}: rank ${this.shard.rank} holds ${held} of ${name}, but its layer reads ${asked}: the shards were cut by another split (cut them again with kdtree shard)`, name);
  }

  /** Moves a read of the whole tensor's rows / K block to the rank file's. */
  private local(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): LocalRead {
    const t = this.entry(name);
    if (t.shape.length !== 2 || t.shape[0] !== shape[0] || t.shape[1] !== shape[1]) {
      throw new EngineError('KDTREE_ENGINE_SHARD', `${this.indexPath}: ${name} is [${t.shape.join(', ')}] in the index, the config needs [${shape.join(', ')}]`, name);
    }
    if (t.split === 'replicated') return { shape: [shape[0], shape[1]], rows: rows && [...rows], cols };
    const [start, count] = t.blocks![this.shard.rank];
    const held = `${t.split === 'column' ? 'rows' : 'columns'} [${start}, ${start + count})`;
    if (t.split === 'column') {
      const wanted = rows ?? Array.from({ length: shape[0] }, (_, i) => i);
      const moved = wanted.map((r) => r - start);
      const outside = moved.findIndex((r) => r < 0 || r >= count);
      if (outside >= 0) throw this.mismatch(name, held, `row ${wanted[outside]}`);
      const identity = moved.length === count && moved.every((r, i) => r === i);
      return { shape: [count, shape[1]], rows: identity ? undefined : moved, cols };
    }
    if (cols === undefined || cols.start < start || cols.start + cols.count > start + count) {
      throw this.mismatch(name, held, cols === undefined ? 'all of its columns' : `columns [${cols.start}, ${cols.start + cols.count})`);
    }
    const whole = cols.start === start && cols.count === count;
    return { shape: [shape[0], count], rows: rows && [...rows], cols: whole ? undefined : { start: cols.start - start, count: cols.count } };
  }

  int4(name: string): Pick<Int4Descriptor, 'shape' | 'group_size' | 'scale_dtype'> | undefined {
    const d = this.file.int4(name);
    if (d === undefined) return undefined;
    const shape = this.entry(name).shape;
    return { shape: [shape[0], shape[1]], group_size: d.group_size, scale_dtype: d.scale_dtype };
  }

  async readF32(name: string, shape: readonly number[]): Promise<Float32Array> {
    const t = this.entry(name);
    if (t.split !== 'replicated') throw this.mismatch(name, `a ${t.split} block`, 'all of it');
    return this.file.readF32(name, shape);
  }

  async readBf16(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostBf16> {
    const l = this.local(name, shape, rows, cols);
    return this.file.readBf16(name, l.shape, l.rows, l.cols);
  }

  async readInt4(name: string, shape: readonly [number, number], rows?: readonly number[], cols?: Block): Promise<HostInt4> {
    const l = this.local(name, shape, rows, cols);
    return this.file.readInt4(name, l.shape, l.rows, l.cols);
  }

  async close(): Promise<void> {
    await this.file.close();
  }
}

/**
 * Opens a model for rank `shard`: a shard directory's file of that rank (ShardSource), or any
 * bundle or checkpoint ModelSource reads, of which the layers then cut the rank's block.
 */
export async function openModel(path: string, options: { config?: string; shard?: Shard } = {}): Promise<ModelSource | ShardSource> {
  if ((await shardIndexPath(path)) !== undefined) return ShardSource.open(path, options);
  return ModelSource.open(path, options);
}
