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

  /** Reads a whole tensor into a new buffer of exactly its size. */
  async read(name: string, options: { verify?: boolean } = {}): Promise<Uint8Array> {
    const info = this.get(name);
    return this.readInto(name, new Uint8Array(info.size), options);
  }

  /** Reads a tensor as a typed array (F16/BF16 as raw Uint16 bits). */
  async readTyped<D extends Dtype>(name: string, dtype?: D): Promise<TypedArrayFor<D>> {
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
    return typedView(info.dtype as D, await this.read(name));
  }

  /**
   * Reads a tensor into the caller's buffer (no allocation) and returns the filled view.
   * With `verify`, the CRC-32 is checked when the container stores one.
   */
  async readInto(name: string, target: Uint8Array, options: { verify?: boolean } = {}): Promise<Uint8Array> {
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
    if (options.verify) this.checkCrc(info, crc32(view));
    return view;
  }

  /**
   * Reads bytes [start, start + length) of one tensor: a tensor-parallel rank reads the rows of its
   * shard without touching the rest of the tensor.
   */
  async readRange(name: string, start: number, length: number, target?: Uint8Array): Promise<Uint8Array> {
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
    await preadFully(this.openFile(info).handle, out, 0, length, info.offset + start, {
      file: info.file,
      format: this.format,
      tensor: name,
    });
    return out.subarray(0, length);
  }

  /**
   * Streams one tensor in order through a few reusable buffers: bounded memory for tensors of any
   * size (copying, hashing, uploading through a pinned staging buffer).
   */
  chunks(name: string, options: { chunkBytes?: number; depth?: number } = {}): AsyncGenerator<Uint8Array> {
    const info = this.get(name);
    return streamRange(this.openFile(info).handle, info.offset, info.size, {
      file: info.file,
      format: this.format,
      tensor: name,
    }, options);
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
      for await (const chunk of this.chunks(info.name)) {
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
