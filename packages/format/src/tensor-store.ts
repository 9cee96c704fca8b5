/**
 * The read side shared by every container: a set of open files and a table of located tensors.
 * KDTR bundles (one file or index + shards) and safetensors checkpoints (one file or index +
 * shards) both open to a TensorStore, so the CLI and the engine read them the same way.
 */
import type { FileHandle } from 'node:fs/promises';
import { crc32 } from './crc32.js';
import type { Dtype } from './dtypes.js';
import { typedView, type TypedArrayFor } from './dtypes.js';
import { TensorNotFoundError, UsageError, type ErrorFormat } from './errors.js';
import { preadFully, streamRange } from './positional-io.js';

export interface TensorInfo {
  readonly name: string;
  readonly dtype: Dtype;
  readonly shape: readonly number[];
  /** Bytes of tensor data: product(shape) x dtype size. */
  readonly size: number;
  /** The file that holds the tensor. */
  readonly file: string;
  /** Absolute byte offset of the tensor's first byte in `file`. */
  readonly offset: number;
  /** CRC-32 of the tensor bytes (KDTR only; safetensors has no checksums). */
  readonly crc32?: number;
}

export interface OpenFile {
  readonly path: string;
  readonly handle: FileHandle;
  readonly format: ErrorFormat;
}

export interface VerifyProgress {
  tensor: TensorInfo;
  index: number;
  count: number;
  bytesDone: number;
  bytesTotal: number;
}

export interface VerifyFailure {
  tensor: string;
  file: string;
  expected: number;
  actual: number;
}

export interface VerifyResult {
  ok: boolean;
  checked: number;
  bytes: number;
  failures: VerifyFailure[];
}

export interface ReadOptions {
  /**
   * Check the tensor's stored CRC-32 (default true; containers without checksums have nothing to
   * check). Pass false only where the caller verifies the same bytes another way.
   */
  verify?: boolean;
}

export interface ChunkOptions extends ReadOptions {
  /** Bytes per chunk (default 1 MiB, at least 4096). */
  chunkBytes?: number;
  /** Reads in flight (default 4). */
  depth?: number;
}

export abstract class TensorStore {
  /** Tensors in file order (shard by shard for multi-file containers). */
  readonly tensors: readonly TensorInfo[];
  protected readonly files: readonly OpenFile[];
  private readonly byName: Map<string, TensorInfo>;
  private readonly fileOf: Map<string, OpenFile>;
  private closed = false;

  protected constructor(files: readonly OpenFile[], tensors: readonly TensorInfo[]) {
    this.files = files;
    this.tensors = tensors;
    this.byName = new Map(tensors.map((t) => [t.name, t]));
    this.fileOf = new Map(files.map((f) => [f.path, f]));
  }

  /** The path the store was opened from (a file, or a multi-file index). */
  abstract readonly path: string;
  abstract readonly format: ErrorFormat;
  /** Free-form metadata (KDTR: a JSON object; safetensors: the string map of __metadata__). */
  abstract readonly metadata: Readonly<Record<string, unknown>>;

  get names(): string[] {
    return this.tensors.map((t) => t.name);
  }

  get totalBytes(): number {
    return this.tensors.reduce((sum, t) => sum + t.size, 0);
  }

  has(name: string): boolean {
    return this.byName.has(name);
  }

  get(name: string): TensorInfo {
    const info = this.byName.get(name);
    if (info === undefined) {
      throw new TensorNotFoundError('no such tensor', {
        file: this.path,
        format: this.format,
        tensor: name,
        expected: `one of ${this.tensors.length} tensors`,
      });
    }
    return info;
  }

  /**
   * Reads a whole tensor into a new buffer of exactly its size. Like every read of this class it
   * checks the tensor's CRC-32 where the container stores one (KDTR) and throws
   * ChecksumMismatchError on a mismatch; `verify: false` skips that, for a caller that verified
   * the bundle separately (e.g. with verify()).
   */
  async read(name: string, options: ReadOptions = {}): Promise<Uint8Array> {
    const info = this.get(name);
    return this.readInto(name, new Uint8Array(info.size), options);
  }

  /** Reads a tensor as a typed array (F16/BF16 as raw Uint16 bits); checks the CRC as read() does. */
  async readTyped<D extends Dtype>(name: string, dtype?: D, options: ReadOptions = {}): Promise<TypedArrayFor<D>> {
    const info = this.get(name);
    if (dtype !== undefined && info.dtype !== dtype) {
      throw new UsageError('tensor has another dtype', {
        file: info.file,
        format: this.format,
        tensor: name,
        field: 'dtype',
        expected: dtype,
        actual: info.dtype,
      });
    }
    return typedView(info.dtype as D, await this.read(name, options));
  }

  /**
   * Reads a tensor into the caller's buffer (no allocation) and returns the filled view. Checks
   * the CRC-32 as read() does (the bytes are in hand: one more pass over them).
   */
  async readInto(name: string, target: Uint8Array, options: ReadOptions = {}): Promise<Uint8Array> {
    const info = this.get(name);
    if (target.byteLength < info.size) {
      throw new UsageError('target buffer too small', {
        file: info.file,
        format: this.format,
        tensor: name,
        expected: `at least ${info.size} bytes`,
        actual: `${target.byteLength} bytes`,
      });
    }
    const file = this.openFile(info);
    await preadFully(file.handle, target, 0, info.size, info.offset, {
      file: info.file,
      format: this.format,
      tensor: name,
    });
    const view = target.subarray(0, info.size);
    if (this.verifies(info, options)) this.checkCrc(info, crc32(view));
    return view;
  }

  /**
   * Reads bytes [start, start + length) of one tensor: a tensor-parallel rank reads the rows of its
   * shard. A checksum covers a whole tensor, so checking it means reading the whole tensor: by
   * default the tensor is streamed through the CRC and the range copied out on the way;
   * `verify: false` reads only the range (for a caller that verified the bundle separately).
   */
  async readRange(name: string, start: number, length: number, target?: Uint8Array, options: ReadOptions = {}): Promise<Uint8Array> {
    const info = this.get(name);
    if (!Number.isSafeInteger(start) || !Number.isSafeInteger(length) || start < 0 || length < 0 || start + length > info.size) {
      throw new UsageError('byte range outside the tensor', {
        file: info.file,
        format: this.format,
        tensor: name,
        expected: `0 <= start, start + length <= ${info.size}`,
        actual: `start ${start}, length ${length}`,
      });
    }
    const out = target ?? new Uint8Array(length);
    if (out.byteLength < length) {
      throw new UsageError('target buffer too small', {
        file: info.file,
        format: this.format,
        tensor: name,
        expected: `at least ${length} bytes`,
        actual: `${out.byteLength} bytes`,
      });
    }
    if (this.verifies(info, options)) {
      let at = 0;
      for await (const chunk of this.chunks(name)) {
        const from = Math.max(start, at);
        const to = Math.min(start + length, at + chunk.byteLength);
        if (from < to) out.set(chunk.subarray(from - at, to - at), from - start);
        at += chunk.byteLength;
      }
      return out.subarray(0, length);
    }
    await preadFully(this.openFile(info).handle, out, 0, length, info.offset + start, {
      file: info.file,
      format: this.format,
      tensor: name,
    });
    return out.subarray(0, length);
  }

  /**
   * Streams one tensor in order through a few reusable buffers: bounded memory for tensors of any
   * size (copying, hashing, uploading through a pinned staging buffer). The CRC-32 runs over each
   * chunk as it arrives and is checked before the last chunk is handed out, so a consumer that
   * reaches the end of the stream has seen exactly the stored bytes; on a mismatch the iteration
   * throws ChecksumMismatchError instead (`verify: false` skips the check).
   */
  chunks(name: string, options: ChunkOptions = {}): AsyncGenerator<Uint8Array> {
    const info = this.get(name);
    const raw = streamRange(this.openFile(info).handle, info.offset, info.size, {
      file: info.file,
      format: this.format,
      tensor: name,
    }, options);
    return this.verifies(info, options) ? this.checkedChunks(info, raw) : raw;
  }

  private async *checkedChunks(info: TensorInfo, raw: AsyncGenerator<Uint8Array>): AsyncGenerator<Uint8Array> {
    let crc = 0;
    let seen = 0;
    try {
      for await (const chunk of raw) {
        crc = crc32(chunk, crc);
        seen += chunk.byteLength;
        if (seen === info.size) this.checkCrc(info, crc);
        yield chunk;
      }
      if (info.size === 0) this.checkCrc(info, 0);
    } finally {
      await raw.return(undefined);
    }
  }

  private verifies(info: TensorInfo, options: ReadOptions): boolean {
    return options.verify !== false && info.crc32 !== undefined;
  }

  /**
   * Checks every stored checksum, streaming each tensor through bounded memory. Returns every
   * failure (does not stop at the first); containers without checksums report `checked: 0`.
   */
  async verify(options: { onProgress?: (p: VerifyProgress) => void; names?: readonly string[] } = {}): Promise<VerifyResult> {
    const list = options.names ? options.names.map((n) => this.get(n)) : this.tensors;
    const bytesTotal = list.reduce((s, t) => s + t.size, 0);
    const failures: VerifyFailure[] = [];
    let bytesDone = 0;
    let checked = 0;
    for (let index = 0; index < list.length; index++) {
      const info = list[index];
      if (info.crc32 === undefined) continue;
      let crc = 0;
      for await (const chunk of this.chunks(info.name, { verify: false })) {
        crc = crc32(chunk, crc);
        bytesDone += chunk.byteLength;
        options.onProgress?.({ tensor: info, index, count: list.length, bytesDone, bytesTotal });
      }
      if (info.size === 0) options.onProgress?.({ tensor: info, index, count: list.length, bytesDone, bytesTotal });
      checked++;
      if (crc !== info.crc32) failures.push({ tensor: info.name, file: info.file, expected: info.crc32, actual: crc });
    }
    return { ok: failures.length === 0, checked, bytes: bytesDone, failures };
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await Promise.all(this.files.map((f) => f.handle.close()));
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  protected abstract checkCrc(info: TensorInfo, actual: number): void;

  private openFile(info: TensorInfo): OpenFile {
    if (this.closed) {
      throw new UsageError('store is closed', { file: this.path, format: this.format, tensor: info.name });
    }
    return this.fileOf.get(info.file)!;
  }
}
