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
