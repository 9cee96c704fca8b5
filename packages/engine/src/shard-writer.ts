/**
 * `kdtree shard`: cuts a bundle into a shard directory (shard-source.ts) in one streaming pass.
 * What each rank holds of each weight is the model's shardPlan, the reads its layers make at
 * load: a shard directory therefore holds exactly the bytes load-time sharding would read.
 *
 * Every stored tensor is read once, in order, in chunks of whole rows (checked against its CRC-32
 * on the way), and each chunk is cut into the N ranks' pieces, written to the N rank files at
 * once: memory is one chunk and its pieces, whatever the model's size. A column-parallel weight's
 * rows go to the rank whose block holds them; a row-parallel weight's every row is cut into the
 * ranks' K blocks (an INT4 weight's packed words and scales in the same groups); a replicated one
 * goes whole to every rank. Each rank file is published atomically (temp file, fsync, rename)
 * and the index last (an earlier one removed first), so a directory with an index is complete.
 */
import { rm } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { formatCrc32, KdtrWriter, writeFileAtomic, type KdtrWriteResult, type TensorInfo } from '@kdtree/format';
import { newQuantizationMetadata, type Int4Descriptor } from '@kdtree/quant';
import { modelError } from './errors.js';
import { shardPlan } from './model.js';
import type { ModelSource } from './model-source.js';
import { rankFileName, SHARD_INDEX_NAME, SHARD_INDEX_SCHEMA, SHARD_METADATA_KEY, type ShardIndex, type ShardIndexTensor } from './shard-source.js';
import { checkShard, type Block, type TensorCut } from './shard.js';

/** Target bytes of one chunk of whole rows (a row larger than this is one chunk). */
const CHUNK_BYTES = 4 << 20;

export interface ShardProgress {
  /** The stored tensor just written to every rank, and how many of how many. */
  tensor: string;
  index: number;
  count: number;
  bytesDone: number;
  bytesTotal: number;
}

export interface ShardResult {
  dir: string;
  indexPath: string;
  index: ShardIndex;
  /** Weights by split. */
  splits: Record<ShardIndexTensor['split'], number>;
  /** Bytes read from the source, and written to each rank's file. */
  bytesRead: number;
  rankBytes: number[];
}

/** One stored tensor of a weight (the weight itself, or an INT4 weight's packed words or scales) and how its rows are cut. */
interface StoredCut {
  info: TensorInfo;
  cut: TensorCut;
  /** Stored elements per unit of the weight's K (1 for a float weight, 1/8 for packed words, 1/group for scales). */
  perK: number;
}

/**
 * Writes rank files and the index of `source` split over `world` ranks into `dir` (which must
 * exist). The split is checked for every rank before anything is written: a weight that cannot
 * be split throws KDTREE_ENGINE_SHARD naming it.
 */
export async function writeShards(source: ModelSource, world: number, dir: string, options: { onProgress?: (p: ShardProgress) => void } = {}): Promise<ShardResult> {
  checkShard({ rank: 0, world });
  const c = source.config;
  const plans = Array.from({ length: world }, (_, rank) => shardPlan(source, c, { rank, world }));
  const weights = plans[0].map((cut, i) => {
    const splits = plans.map((p) => p[i]);
    if (splits.some((s) => s.name !== cut.name || s.split !== cut.split)) throw modelError(cut.name, 'is split differently on different ranks', source.path);
    return splits;
  });
  const stored: StoredCut[][] = weights.map((cuts) => storedCuts(source, cuts[0]));
  const metadata = rankMetadata(source, weights);
  const writers: KdtrWriter[] = [];
  const bytesTotal = stored.flat().reduce((s, t) => s + t.info.size, 0);
  let bytesDone = 0;
  let written = 0;
  // an index of an earlier cut goes first: until the new one is published, the directory is no shard directory
  await rm(join(dir, SHARD_INDEX_NAME), { force: true });
  try {
    for (let rank = 0; rank < world; rank++) {
      writers.push(await KdtrWriter.create(join(dir, rankFileName(rank)), { metadata: { ...metadata(rank), [SHARD_METADATA_KEY]: { rank, world, index: SHARD_INDEX_NAME } } }));
    }
    const count = stored.flat().length;
    for (let w = 0; w < weights.length; w++) {
      for (let part = 0; part < stored[w].length; part++) {
        const s = stored[w][part];
        const cuts = weights[w].map((cut) => storedCuts(source, cut)[part]);
        // chunks no larger than the tensor: a small tensor's read then allocates no more than it holds
        await writeTensor(writers, source.store.chunks(s.info.name, { chunkBytes: Math.max(4096, Math.min(1 << 20, s.info.size)) }), s.info, cuts);
        bytesDone += s.info.size;
        options.onProgress?.({ tensor: s.info.name, index: ++written, count, bytesDone, bytesTotal });
      }
    }
    const results: KdtrWriteResult[] = [];
    for (const writer of writers) results.push(await writer.close());
    const index = indexOf(source, weights, results);
    const indexPath = join(dir, SHARD_INDEX_NAME);
    await writeFileAtomic(indexPath, `${JSON.stringify(index, null, 1)}\n`);
    const splits = { column: 0, row: 0, replicated: 0 };
    for (const w of weights) splits[w[0].split]++;
    return { dir, indexPath, index, splits, bytesRead: bytesTotal, rankBytes: results.map((r) => r.fileLength) };
  } catch (error) {
    await Promise.all(writers.map((wr) => wr.abort().catch(() => undefined)));
    throw error;
  }
}

/** The stored tensors of one weight with its cut: the weight, or an INT4 weight's packed words and scales. */
function storedCuts(source: ModelSource, cut: TensorCut): StoredCut[] {
  const d = source.int4(cut.name);
  if (d === undefined) return [{ info: source.store.get(source.prefix + cut.name), cut, perK: 1 }];
  const k = d.shape[1];
  return [
    { info: source.store.get(d.qw), cut, perK: 1 / 8 },
    { info: source.store.get(d.sc), cut, perK: 1 / d.group_size },
  ].map((s) => ({ ...s, perK: s.info.shape[1] / k }));
}

/** The part of stored tensor `s` a rank holds: its shape there, and the block of rows or of each row's bytes it keeps. */
function pieceOf(s: StoredCut): { shape: number[]; rows?: Block; bytes?: Block } {
  const { info, cut } = s;
  if (cut.split === 'replicated') return { shape: [...info.shape] };
  const b = cut.block!;
  if (cut.split === 'column') return { shape: [b.count, ...info.shape.slice(1)], rows: b };
  const elementBytes = info.size / info.shape[0] / info.shape[1];
  return { shape: [info.shape[0], b.count * s.perK], bytes: { start: b.start * s.perK * elementBytes, count: b.count * s.perK * elementBytes } };
}

/** Streams one stored tensor once and writes each rank its piece of it. */
async function writeTensor(writers: readonly KdtrWriter[], chunks: AsyncIterable<Uint8Array>, info: TensorInfo, cuts: readonly StoredCut[]): Promise<void> {
  const pieces = cuts.map(pieceOf);
  const rowBytes = info.shape.length === 0 ? info.size : info.size / info.shape[0];
  const rowsPerChunk = Math.max(1, Math.floor(CHUNK_BYTES / Math.max(1, rowBytes)));
  const rounds = async function* (): AsyncGenerator<Uint8Array[]> {
    let row = 0;
    for await (const chunk of rowChunks(chunks, Math.min(info.size, rowBytes * rowsPerChunk))) {
      const n = chunk.byteLength / rowBytes;
      yield pieces.map((p) => {
        if (p.rows !== undefined) {
          const from = Math.max(row, p.rows.start);
          const to = Math.min(row + n, p.rows.start + p.rows.count);
          return from < to ? chunk.subarray((from - row) * rowBytes, (to - row) * rowBytes) : EMPTY;
        }
        if (p.bytes !== undefined) {
          const out = new Uint8Array(n * p.bytes.count);
          for (let r = 0; r < n; r++) out.set(chunk.subarray(r * rowBytes + p.bytes.start, r * rowBytes + p.bytes.start + p.bytes.count), r * p.bytes.count);
          return out;
        }
        return chunk;
      });
      row += n;
    }
  };
  const streams = fanOut(rounds(), writers.length);
  await Promise.all(writers.map((w, rank) => w.add({ name: info.name, dtype: info.dtype, shape: pieces[rank].shape }, streams[rank])));
}

const EMPTY = new Uint8Array(0);

/**
 * Regroups `chunks` into chunks of exactly `size` bytes (the last one shorter), so every chunk
 * holds whole rows. A chunk passed on is not reused: the rank writers may still hold it.
 */
async function* rowChunks(chunks: AsyncIterable<Uint8Array>, size: number): AsyncGenerator<Uint8Array> {
  let buffer = new Uint8Array(size);
  let filled = 0;
  for await (const chunk of chunks) {
    let at = 0;
    while (at < chunk.byteLength) {
      const take = Math.min(size - filled, chunk.byteLength - at);
      buffer.set(chunk.subarray(at, at + take), filled);
      filled += take;
      at += take;
      if (filled === size) {
        yield buffer;
        buffer = new Uint8Array(size);
        filled = 0;
      }
    }
  }
  if (filled > 0) yield buffer.subarray(0, filled);
}

/**
 * N consumers of one producer of rounds, consumer i taking piece i of each round, in lockstep:
 * round k + 1 is made only once every consumer has taken round k, so one round is in memory. A
 * consumer that stops early (its writer failed) fails the others, which would wait for it forever.
 */
export function fanOut(rounds: AsyncIterator<Uint8Array[]>, n: number): AsyncIterable<Uint8Array>[] {
  let round = -1;
  let current: Promise<IteratorResult<Uint8Array[]>> = Promise.resolve({ done: false, value: [] });
  let taken = n;
  let gate: { promise: Promise<void>; resolve: () => void; reject: (e: unknown) => void } | undefined;
  let failed: unknown;
  const open = (): typeof gate => {
    let resolve!: () => void;
    let reject!: (e: unknown) => void;
    const promise = new Promise<void>((res, rej) => ((resolve = res), (reject = rej)));
    promise.catch(() => undefined);
    return { promise, resolve, reject };
  };
  const at = async (k: number): Promise<IteratorResult<Uint8Array[]>> => {
    while (k !== round) {
      if (failed !== undefined) throw failed;
      if (taken < n) await gate!.promise;
      else {
        round = k;
        taken = 0;
        gate = open();
        current = rounds.next();
      }
    }
    return current;
  };
  const take = () => {
    if (++taken === n) gate?.resolve();
  };
  return Array.from({ length: n }, (_, i) => ({
    async *[Symbol.asyncIterator]() {
      let finished = false;
      try {
        for (let k = 0; ; k++) {
          const r = await at(k);
          take();
          if (r.done) {
            finished = true;
            return;
          }
          if (r.value[i].byteLength > 0) yield r.value[i];
        }
      } finally {
        if (!finished && failed === undefined) {
          failed = new Error(`rank ${i}'s writer stopped before the end of the tensor`);
          gate?.reject(failed);
          await rounds.return?.(undefined);
        }
      }
    },
  }));
}

/** Each rank file's metadata: the source's (config, tokenizer, ...), with the INT4 descriptors of that rank's blocks. */
function rankMetadata(source: ModelSource, weights: readonly TensorCut[][]): (rank: number) => Record<string, unknown> {
  const base: Record<string, unknown> = source.store.format.startsWith('kdtr') ? { ...source.metadata } : {};
  base.config = source.configJson;
  delete base.quantization;
  delete base['kdtr.shard'];
  return (rank) => {
    const meta = { ...base };
    if (source.quantization === undefined) return meta;
    const tensors: Record<string, Int4Descriptor> = {};
    for (const cuts of weights) {
      const cut = cuts[rank];
      const d = source.int4(cut.name);
      if (d === undefined) continue;
      const [n, k] = d.shape;
      const shape: [number, number] = cut.split === 'column' ? [cut.block!.count, k] : cut.split === 'row' ? [n, cut.block!.count] : [n, k];
      tensors[source.prefix + cut.name] = { ...d, shape };
    }
    const { tensors: _, ...rest } = source.quantization;
    meta.quantization = newQuantizationMetadata({ ...rest, tensors });
    return meta;
  };
}

/** The index of the shards written: the source, each rank's file, every weight's split and blocks. */
function indexOf(source: ModelSource, weights: readonly TensorCut[][], results: readonly KdtrWriteResult[]): ShardIndex {
  const store = source.store;
  const headers = 'shards' in store ? store.shards.map((s) => formatCrc32(s.headerCrc32)) : [];
  const tensors: Record<string, ShardIndexTensor> = {};
  for (const cuts of weights) {
    const first = cuts[0];
    tensors[first.name] = first.split === 'replicated' ? { shape: [...first.shape], split: 'replicated' } : { shape: [...first.shape], split: first.split, blocks: cuts.map((c) => [c.block!.start, c.block!.count]) };
  }
  return {
    schema: SHARD_INDEX_SCHEMA,
    world: results.length,
    source: { name: basename(source.path), format: store.format, header_crc32: headers },
    ranks: results.map((r, rank) => ({ rank, file: basename(r.path), file_length: r.fileLength, header_crc32: formatCrc32(r.headerCrc32) })),
    tensors,
  };
}
