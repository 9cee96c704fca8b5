/**
 * Streaming KDTR writers. Tensors go to disk as they arrive, chunk by chunk, so memory stays at
 * the size of the chunks the caller passes (a 595 GB checkpoint converts in bounded memory).
 * The header is written after the last tensor and the preamble last of all, then the temp file
 * is fsynced and renamed: an interrupted write never leaves a file that reads as valid.
 */
import { unlink } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { AtomicFile, writeFileAtomic } from './atomic-file.js';
import { crc32 } from './crc32.js';
import { checkDtype, type Dtype } from './dtypes.js';
import { DuplicateTensorError, InvalidFieldError, UsageError } from './errors.js';
import { checkedByteSize, MAX_TENSOR_NAME_BYTES, validateShape, type KdtrTensorEntry } from './kdtr-header.js';
import { encodePreamble, KDTR_ALIGNMENT, KDTR_VERSION_MAJOR, KDTR_VERSION_MINOR } from './kdtr-layout.js';
import { KDTR_INDEX_FORMAT, KDTR_INDEX_VERSION, type KdtrShardSummary } from './kdtr-reader.js';
import { dataChunks, type TensorData } from './tensor-data.js';

export interface TensorSpec {
  name: string;
  dtype: Dtype;
  shape: readonly number[];
}

export interface KdtrWriteResult {
  path: string;
  fileLength: number;
  headerCrc32: number;
  tensors: KdtrTensorEntry[];
}

const encoder = new TextEncoder();

function alignUp(n: number): number {
  return Math.ceil(n / KDTR_ALIGNMENT) * KDTR_ALIGNMENT;
}

/** Writes one .kdtr file. Create with KdtrWriter.create(path); add tensors; close() publishes. */
export class KdtrWriter {
  /** Bundle metadata; may be changed until close(). Must be JSON-serializable. */
  metadata: Record<string, unknown>;
  private readonly entries: KdtrTensorEntry[] = [];
  private readonly names = new Set<string>();
  private position = KDTR_ALIGNMENT;
  private busy = false;
  private finished = false;

  private constructor(
    private readonly file: AtomicFile,
    metadata: Record<string, unknown>,
  ) {
    this.metadata = metadata;
  }

  static async create(path: string, options: { metadata?: Record<string, unknown> } = {}): Promise<KdtrWriter> {
    return new KdtrWriter(await AtomicFile.create(path), { ...(options.metadata ?? {}) });
  }

  get path(): string {
    return this.file.path;
  }

  /** Bytes of tensor data and padding written so far. */
  get dataBytes(): number {
    return this.position - KDTR_ALIGNMENT;
  }

  get tensorCount(): number {
    return this.entries.length;
  }

  private usage(message: string, tensor?: string, expected?: string, actual?: string): UsageError {
    return new UsageError(message, { file: this.file.path, format: 'kdtr', tensor, expected, actual });
  }

  /**
   * Appends one tensor. `data` is its bytes (little-endian, row-major), or an (async) iterable of
   * byte chunks; their total must be exactly product(shape) x dtype size. On a length mismatch
   * nothing of this tensor is kept and the writer stays usable.
   */
  async add(spec: TensorSpec, data: TensorData): Promise<KdtrTensorEntry> {
    if (this.finished) throw this.usage('writer is closed', spec.name);
    if (this.busy) throw this.usage('add() called again before the previous add() finished', spec.name);
    const name = spec.name;
    if (typeof name !== 'string' || name.length === 0 || name.includes('\0') || encoder.encode(name).byteLength > MAX_TENSOR_NAME_BYTES) {
      throw new InvalidFieldError('tensor name must be a non-empty string without NUL, at most 4096 UTF-8 bytes', { file: this.file.path, format: 'kdtr', field: 'name', actual: JSON.stringify(name) });
    }
    if (this.names.has(name)) throw new DuplicateTensorError('tensor added twice', { file: this.file.path, format: 'kdtr', tensor: name });
    const dtype = checkDtype(spec.dtype, { file: this.file.path, tensor: name, format: 'kdtr' });
    const shape = validateShape([...spec.shape], this.file.path, name, 'kdtr');
    const size = checkedByteSize(shape, dtype, this.file.path, name, 'kdtr');
    this.busy = true;
    try {
      const offset = this.position;
      let written = 0;
      let crc = 0;
      for await (const chunk of dataChunks(data)) {
        if (written + chunk.byteLength > size) {
          throw this.usage('tensor data longer than its shape', name, `${size} bytes (${JSON.stringify(shape)} x ${dtype})`, `more than ${written + chunk.byteLength}`);
        }
        await this.writeAll(chunk, offset + written);
        crc = crc32(chunk, crc);
        written += chunk.byteLength;
      }
      if (written !== size) {
        throw this.usage('tensor data shorter than its shape', name, `${size} bytes (${JSON.stringify(shape)} x ${dtype})`, `${written} bytes`);
      }
      const entry: KdtrTensorEntry = { name, dtype, shape, offset, size, crc32: crc };
      this.entries.push(entry);
      this.names.add(name);
      this.position = alignUp(offset + size);
      return entry;
    } finally {
      this.busy = false;
    }
  }

  private async writeAll(bytes: Uint8Array, position: number): Promise<void> {
    await this.file.write(bytes, position);
  }

  /** Writes header and preamble, fsyncs and renames into place. */
  async close(): Promise<KdtrWriteResult> {
    if (this.finished) throw this.usage('writer is already closed');
    if (this.busy) throw this.usage('close() called while add() is still running');
    this.finished = true;
    try {
      const last = this.entries.at(-1);
      const headerOffset = last ? last.offset + last.size : KDTR_ALIGNMENT;
      const header = encoder.encode(JSON.stringify({ metadata: this.metadata, tensors: this.entries }));
      const headerCrc32 = crc32(header);
      const fileLength = headerOffset + header.byteLength;
      await this.writeAll(header, headerOffset);
      // A failed add() may have left bytes past the end; the file must end at the header's end.
      await this.file.handle.truncate(fileLength);
      await this.writeAll(
        encodePreamble({
          versionMajor: KDTR_VERSION_MAJOR,
          versionMinor: KDTR_VERSION_MINOR,
          alignment: KDTR_ALIGNMENT,
          headerOffset,
          headerLength: header.byteLength,
          fileLength,
          headerCrc32,
          tensorCount: this.entries.length,
        }),
        0,
      );
      await this.file.commit();
      return { path: this.file.path, fileLength, headerCrc32, tensors: this.entries };
    } catch (error) {
      await this.file.abort();
      throw error;
    }
  }

  /** Discards everything written; the destination is untouched. */
  async abort(): Promise<void> {
    this.finished = true;
    await this.file.abort();
  }
}

export interface ShardedWriterOptions {
  metadata?: Record<string, unknown>;
  /** Start a new shard before a tensor that would push the current one past this many bytes. */
  maxShardBytes?: number;
}

/**
 * Writes a multi-file bundle: shards `<stem>-00001.kdtr`, ... next to the index `<stem>.kdtr.json`.
 * Shards roll over by size, or where the caller calls nextShard() (e.g. one shard per TP rank).
 * The index is published last: until it exists, no bundle is visible under its name.
 */
export class ShardedKdtrWriter {
  metadata: Record<string, unknown>;
  private readonly done: KdtrWriteResult[] = [];
  private readonly names = new Set<string>();
  private current: KdtrWriter | undefined;
  private finished = false;

  private constructor(
    readonly indexPath: string,
    private readonly maxShardBytes: number,
    metadata: Record<string, unknown>,
  ) {
    this.metadata = metadata;
  }

  static async create(indexPath: string, options: ShardedWriterOptions = {}): Promise<ShardedKdtrWriter> {
    const max = options.maxShardBytes;
    if (max !== undefined && (!Number.isSafeInteger(max) || max < 1)) {
      throw new UsageError('maxShardBytes must be a positive integer', { file: indexPath, format: 'kdtr-index', field: 'maxShardBytes', expected: 'an integer >= 1', actual: String(max) });
    }
    return new ShardedKdtrWriter(indexPath, options.maxShardBytes ?? Number.MAX_SAFE_INTEGER, { ...(options.metadata ?? {}) });
  }

  private shardPath(index: number): string {
    return join(dirname(this.indexPath), `${shardStem(this.indexPath)}-${String(index + 1).padStart(5, '0')}.kdtr`);
  }

  /**
   * Whether `file` is a path this writer could write a shard of `indexPath` to: the same
   * directory and `<stem>-NNNNN.kdtr` (callers resolve both paths first).
   */
  static isShardPath(indexPath: string, file: string): boolean {
    if (dirname(indexPath) !== dirname(file)) return false;
    const name = basename(file);
    const stem = shardStem(indexPath);
    return name.startsWith(`${stem}-`) && /^-\d{5}\.kdtr$/.test(name.slice(stem.length));
  }

  /** Closes the current shard (if it holds anything); the next add() opens a new one. */
  async nextShard(): Promise<void> {
    if (this.current === undefined) return;
    const shard = this.current;
    this.current = undefined;
    if (shard.tensorCount === 0) {
      await shard.abort();
      return;
    }
    this.done.push(await shard.close());
  }

  async add(spec: TensorSpec, data: TensorData): Promise<KdtrTensorEntry> {
    if (this.finished) throw new UsageError('writer is closed', { file: this.indexPath, format: 'kdtr-index', tensor: spec.name });
    if (this.names.has(spec.name)) {
      throw new DuplicateTensorError('tensor added twice', { file: this.indexPath, format: 'kdtr-index', tensor: spec.name });
    }
    const size = checkedByteSize(validateShape([...spec.shape], this.indexPath, spec.name, 'kdtr'), checkDtype(spec.dtype, { file: this.indexPath, tensor: spec.name }), this.indexPath, spec.name, 'kdtr');
    if (this.current && this.current.tensorCount > 0 && this.current.dataBytes + size > this.maxShardBytes) await this.nextShard();
    this.current ??= await KdtrWriter.create(this.shardPath(this.done.length), { metadata: { 'kdtr.shard': { index: this.done.length } } });
    const entry = await this.current.add(spec, data);
    this.names.add(spec.name);
    return entry;
  }

  async close(): Promise<{ indexPath: string; shards: KdtrWriteResult[] }> {
    this.finished = true;
    try {
      await this.nextShard();
    } catch (error) {
      await this.abort();
      throw error;
    }
    if (this.done.length === 0) {
      // An empty bundle still gets one (empty) shard, so every index names at least one file.
      this.done.push(await (await KdtrWriter.create(this.shardPath(0), { metadata: { 'kdtr.shard': { index: 0 } } })).close());
    }
    const shards: KdtrShardSummary[] = this.done.map((r) => ({ file: basename(r.path), fileLength: r.fileLength, headerCrc32: r.headerCrc32, tensorCount: r.tensors.length }));
    const weightMap: Record<string, number> = {};
    this.done.forEach((r, i) => r.tensors.forEach((t) => (weightMap[t.name] = i)));
    const index = {
      format: KDTR_INDEX_FORMAT,
      version: KDTR_INDEX_VERSION,
      metadata: this.metadata,
      shards: shards.map((s) => ({ file: s.file, file_length: s.fileLength, header_crc32: s.headerCrc32, tensor_count: s.tensorCount })),
      weight_map: weightMap,
    };
    await writeFileAtomic(this.indexPath, `${JSON.stringify(index, null, 1)}\n`);
    return { indexPath: this.indexPath, shards: this.done };
  }

  /** Discards the bundle: the open shard and the shards already published (no index was written). */
  async abort(): Promise<void> {
    this.finished = true;
    await this.current?.abort();
    this.current = undefined;
    await Promise.all(this.done.map((r) => unlink(r.path).catch(() => undefined)));
  }
}

function shardStem(indexPath: string): string {
  return basename(indexPath).replace(/(\.kdtr)?\.json$/, '');
}

export function kdtrVersion(): string {
  return `${KDTR_VERSION_MAJOR}.${KDTR_VERSION_MINOR}`;
}
