/**
 * Which slice of the model one tensor-parallel rank holds. The layers that own the weights cut
 * their own shards (layers.ts, model.ts): a column-parallel weight keeps a contiguous block of its
 * output rows (heads, intermediate channels, vocabulary), a row-parallel weight a contiguous block
 * of its K columns, and everything else is replicated. Each cut is checked here, where the tensor
 * and both shapes can be named.
 */
import { EngineError } from './errors.js';

export interface Shard {
  /** This rank, 0 <= rank < world. */
  rank: number;
  /** Ranks in all (the tensor-parallel degree). */
  world: number;
}

/** The whole model on one rank. */
export const WHOLE: Shard = Object.freeze({ rank: 0, world: 1 });

/** A contiguous block [start, start + count) of one dimension. */
export interface Block {
  start: number;
  count: number;
}

/**
 * This rank's block of a dimension of `size` split in `shard.world` equal parts. `unit`: the part
 * must be a multiple of it (an INT4 group along K, a head). Throws KDTREE_ENGINE_SHARD naming the
 * tensor, its shape and why it cannot be split.
 */
export function shardBlock(shard: Shard, size: number, what: { tensor: string; shape: readonly number[]; dim: string; unit?: number; unitName?: string }): Block {
  const { world, rank } = shard;
  if (world === 1) return { start: 0, count: size };
  const shape = `[${what.shape.join(', ')}]`;
  if (size % world !== 0) {
    throw new EngineError('KDTREE_ENGINE_SHARD', `${what.tensor} ${shape}: its ${what.dim} (${size}) does not split over ${world} ranks`, what.tensor);
  }
  const count = size / world;
  const unit = what.unit ?? 1;
  if (count % unit !== 0) {
    throw new EngineError(
      'KDTREE_ENGINE_SHARD',
      `${what.tensor} ${shape}: its ${what.dim} (${size}) over ${world} ranks is ${count} per rank, not a multiple of ${what.unitName ?? 'the unit'} (${unit}): a shard would cut one`,
      what.tensor,
    );
  }
  return { start: rank * count, count };
}

/** The integers [start, start + count). */
export function blockRange(b: Block): number[] {
  return Array.from({ length: b.count }, (_, i) => b.start + i);
}

export function checkShard(shard: Shard): Shard {
  if (!Number.isSafeInteger(shard.world) || shard.world < 1 || !Number.isSafeInteger(shard.rank) || shard.rank < 0 || shard.rank >= shard.world) {
    throw new EngineError('KDTREE_ENGINE_ARGUMENT', `shard: expected 0 <= rank < world, got rank ${shard.rank} of ${shard.world}`, 'shard');
  }
  return shard;
}

/** One read a layer makes of a weight: the rows it keeps (all when absent) and its block of K (all when absent). */
export interface WeightRead {
  name: string;
  /** The whole tensor's shape, as the config gives it. */
  shape: readonly number[];
  rows?: readonly number[];
  cols?: Block;
}

/**
 * How a rank holds one weight: `column` keeps a block of its rows (dim 0: heads, intermediate
 * channels, vocabulary), `row` a block of its K (dim 1), `replicated` all of it.
 */
export type Split = 'column' | 'row' | 'replicated';

export interface TensorCut {
  name: string;
  /** The whole tensor's shape. */
  shape: readonly number[];
  split: Split;
  /** The block of dim 0 (column) or dim 1 (row); absent when replicated. */
  block?: Block;
}

/**
 * What one rank holds of each weight, from every read its layers make: the union of a weight's
 * reads (q_b's nope rows and rope rows of the same heads; a tied embedding read whole and as
 * lm_head's vocabulary block). Throws when the reads of one weight are not one block of one
 * dimension, which no shard file could hold.
 */
export function cutsOf(reads: readonly WeightRead[]): TensorCut[] {
  const byName = new Map<string, WeightRead[]>();
  for (const r of reads) {
    const list = byName.get(r.name);
    if (list === undefined) byName.set(r.name, [r]);
    else list.push(r);
  }
  return [...byName].map(([name, list]) => {
    const shape = list[0].shape;
    const fail = (why: string) => new EngineError('KDTREE_ENGINE_SHARD', `${name} [${shape.join(', ')}]: ${why}; a shard holds one block of one dimension`, name);
    if (list.some((r) => r.shape.length !== shape.length || r.shape.some((d, i) => d !== shape[i]))) throw fail('is read with different shapes');
    const allRows = list.some((r) => r.rows === undefined);
    const allCols = list.some((r) => r.cols === undefined);
    let rows: Block | undefined;
    if (!allRows) {
      const set = [...new Set(list.flatMap((r) => r.rows!))].sort((a, b) => a - b);
      if (set[set.length - 1] - set[0] + 1 !== set.length) throw fail(`its rows ${set[0]}..${set[set.length - 1]} are read with gaps`);
      if (set.length !== shape[0]) rows = { start: set[0], count: set.length };
    }
    let cols: Block | undefined;
    if (!allCols) {
      const c = list[0].cols!;
      if (list.some((r) => r.cols!.start !== c.start || r.cols!.count !== c.count)) throw fail('is read in different blocks of K');
      if (c.count !== shape[1]) cols = c;
    }
    if (rows !== undefined && cols !== undefined) throw fail('is read in a block of rows and a block of K at once');
    if (rows !== undefined) return { name, shape, split: 'column', block: rows };
    if (cols !== undefined) return { name, shape, split: 'row', block: cols };
    return { name, shape, split: 'replicated' };
  });
}
