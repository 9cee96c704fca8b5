/**
 * Opening KDTR bundles: one .kdtr file, or a multi-file bundle (an index JSON plus .kdtr shards,
 * e.g. one shard per 5 GB or per tensor-parallel rank) that reads as one bundle. Opening reads
 * only the preambles and headers; tensor data is read on demand.
 */
import type { FileHandle } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { crc32 } from './crc32.js';
import {
  BadMagicError,
  ChecksumMismatchError,
  DuplicateTensorError,
  FormatError,
  HeaderTooLargeError,
  InvalidFieldError,
  UnsupportedVersionError,
} from './errors.js';
import { isPlainObject, parseJsonBytes, validateKdtrHeader, type KdtrHeader } from './kdtr-header.js';
import {
  decodePreamble,
  hex32,
  KDTR_DEFAULT_MAX_HEADER_BYTES,
  KDTR_PREAMBLE_BYTES,
  startsWithMagic,
  type KdtrPreamble,
} from './kdtr-layout.js';
import { openRegularFile } from './file-access.js';
import { preadFully } from './positional-io.js';
import { isIntegerLiteral } from './strict-json.js';
import { TensorStore, type OpenFile, type TensorInfo } from './tensor-store.js';

export const KDTR_INDEX_FORMAT = 'kdtr-index';
export const KDTR_INDEX_VERSION = 1;

export interface OpenOptions {
  /** Largest header (or index) the reader will allocate; default 512 MiB. */
  maxHeaderBytes?: number;
}

export interface KdtrShardSummary {
  file: string;
  fileLength: number;
  headerCrc32: number;
  tensorCount: number;
}

export class KdtrBundle extends TensorStore {
  readonly path: string;
  readonly format: 'kdtr' | 'kdtr-index';
  readonly metadata: Readonly<Record<string, unknown>>;
  /** "1.0" for v1.0 files. */
  readonly version: string;
  readonly shards: readonly KdtrShardSummary[];

  /** @internal use openBundle() */
  constructor(args: {
    path: string;
    format: 'kdtr' | 'kdtr-index';
    metadata: Record<string, unknown>;
    version: string;
    shards: KdtrShardSummary[];
    files: OpenFile[];
    tensors: TensorInfo[];
  }) {
    super(args.files, args.tensors);
    this.path = args.path;
    this.format = args.format;
    this.metadata = args.metadata;
    this.version = args.version;
    this.shards = args.shards;
  }

  protected checkCrc(info: TensorInfo, actual: number): void {
    if (info.crc32 !== undefined && info.crc32 !== actual) {
      throw new ChecksumMismatchError('tensor data checksum mismatch', {
        file: info.file,
        format: 'kdtr',
        tensor: info.name,
        field: 'crc32',
        expected: hex32(info.crc32),
        actual: hex32(actual),
      });
    }
  }
}

interface OpenedKdtrFile {
  handle: FileHandle;
  preamble: KdtrPreamble;
  header: KdtrHeader;
}

/** Opens one .kdtr file and validates its preamble and header; closes the handle on failure. */
async function openKdtrFile(path: string, options: OpenOptions): Promise<OpenedKdtrFile> {
  const { handle, size } = await openRegularFile(path, 'kdtr');
  try {
    const head = new Uint8Array(Math.min(KDTR_PREAMBLE_BYTES, size));
    await preadFully(handle, head, 0, head.byteLength, 0, { file: path, format: 'kdtr' });
    const preamble = decodePreamble(head, size, path);
    const limit = options.maxHeaderBytes ?? KDTR_DEFAULT_MAX_HEADER_BYTES;
    if (preamble.headerLength > limit) {
      throw new HeaderTooLargeError('header larger than the reader limit', {
        file: path,
        format: 'kdtr',
        field: 'header_length',
        expected: `at most ${limit} bytes (raise maxHeaderBytes to accept it)`,
        actual: `${preamble.headerLength} bytes`,
      });
    }
    const headerBytes = new Uint8Array(preamble.headerLength);
    await preadFully(handle, headerBytes, 0, preamble.headerLength, preamble.headerOffset, { file: path, format: 'kdtr' });
    const actualCrc = crc32(headerBytes);
    if (actualCrc !== preamble.headerCrc32) {
      throw new ChecksumMismatchError('header checksum mismatch', {
        file: path,
        format: 'kdtr',
        field: 'header_crc32',
        expected: hex32(preamble.headerCrc32),
        actual: hex32(actualCrc),
      });
    }
    const header = validateKdtrHeader(parseJsonBytes(headerBytes, path, 'kdtr'), preamble, path);
    return { handle, preamble, header };
  } catch (error) {
    await handle.close();
    throw error;
  }
}

function toInfos(file: string, header: KdtrHeader): TensorInfo[] {
  return header.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, size: t.size, file, offset: t.offset, crc32: t.crc32 }));
}

async function openSingle(path: string, options: OpenOptions): Promise<KdtrBundle> {
  const { handle, preamble, header } = await openKdtrFile(path, options);
  return new KdtrBundle({
    path,
    format: 'kdtr',
    metadata: header.metadata,
    version: `${preamble.versionMajor}.${preamble.versionMinor}`,
    shards: [{ file: basename(path), fileLength: preamble.fileLength, headerCrc32: preamble.headerCrc32, tensorCount: preamble.tensorCount }],
    files: [{ path, handle, format: 'kdtr' }],
    tensors: toInfos(path, header),
  });
}

function indexError(path: string, message: string, field: string, expected?: string, actual?: string): InvalidFieldError {
  return new InvalidFieldError(message, { file: path, format: 'kdtr-index', field, expected, actual });
}

function shardFileName(value: unknown, path: string, index: number): string {
  // Plain names only: an index must not reach files outside its own directory.
  if (typeof value !== 'string' || value === '' || value === '.' || value === '..' || /[/\\\0]/.test(value)) {
    throw indexError(path, 'shard file must be a plain file name in the index directory', `shards[${index}].file`, 'a name without / or \\', JSON.stringify(value));
  }
  return value;
}

function u32Field(row: Record<string, unknown>, key: string, path: string, field: string): number {
  const value = row[key];
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 0 || value > 0xffffffff || !isIntegerLiteral(row, key)) {
    throw indexError(path, 'not a 32-bit unsigned integer', field, 'an integer literal in [0, 2^32)', JSON.stringify(value));
  }
  return value;
}

function safeIntField(row: Record<string, unknown>, key: string, path: string, field: string): number {
  const value = row[key];
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0 || !isIntegerLiteral(row, key)) {
    throw indexError(path, 'not a non-negative integer', field, 'an integer literal in [0, 2^53)', JSON.stringify(value));
  }
  return value;
}

const INDEX_KEYS = ['format', 'version', 'metadata', 'shards', 'weight_map'];
const SHARD_KEYS = ['file', 'file_length', 'header_crc32', 'tensor_count'];

/** Index version 1 has no minor version to grow by: a key it does not define is an error. */
function checkKeys(obj: Record<string, unknown>, allowed: readonly string[], path: string, where: string): void {
  for (const key of Object.keys(obj)) {
    if (!allowed.includes(key)) throw indexError(path, 'unknown key', where ? `${where}.${key}` : key, allowed.join(', '));
  }
}

interface ParsedIndex {
  metadata: Record<string, unknown>;
  shards: KdtrShardSummary[];
  weightMap: Map<string, number>;
}

export function parseKdtrIndex(json: unknown, path: string): ParsedIndex {
  if (!isPlainObject(json) || json.format !== KDTR_INDEX_FORMAT) {
    throw new BadMagicError('not a KDTR index', { file: path, format: 'kdtr-index', field: 'format', expected: `"${KDTR_INDEX_FORMAT}"` });
  }
  if (json.version !== KDTR_INDEX_VERSION || !isIntegerLiteral(json, 'version')) {
    throw new UnsupportedVersionError('unsupported KDTR index version', { file: path, format: 'kdtr-index', field: 'version', expected: `${KDTR_INDEX_VERSION}`, actual: JSON.stringify(json.version) });
  }
  checkKeys(json, INDEX_KEYS, path, '');
  if (!isPlainObject(json.metadata)) throw indexError(path, 'metadata must be an object', 'metadata');
  if (!Array.isArray(json.shards) || json.shards.length === 0) throw indexError(path, 'shards must be a non-empty array', 'shards');
  const names = new Set<string>();
  const shards = json.shards.map((row: unknown, i: number): KdtrShardSummary => {
    if (!isPlainObject(row)) throw indexError(path, 'shard entry must be an object', `shards[${i}]`);
    checkKeys(row, SHARD_KEYS, path, `shards[${i}]`);
    const file = shardFileName(row.file, path, i);
    if (names.has(file)) throw indexError(path, 'shard listed twice', `shards[${i}].file`, undefined, file);
    names.add(file);
    return {
      file,
      fileLength: safeIntField(row, 'file_length', path, `shards[${i}].file_length`),
      headerCrc32: u32Field(row, 'header_crc32', path, `shards[${i}].header_crc32`),
      tensorCount: u32Field(row, 'tensor_count', path, `shards[${i}].tensor_count`),
    };
  });
  if (!isPlainObject(json.weight_map)) throw indexError(path, 'weight_map must be an object', 'weight_map');
  const weightMap = new Map<string, number>();
  const map = json.weight_map;
  for (const [name, shard] of Object.entries(map)) {
    if (typeof shard !== 'number' || !Number.isInteger(shard) || shard < 0 || shard >= shards.length || !isIntegerLiteral(map, name)) {
      throw indexError(path, 'weight_map entry must be a shard index (0-based position in shards)', `weight_map.${name}`, `an integer literal in [0, ${shards.length})`, JSON.stringify(shard));
    }
    weightMap.set(name, shard);
  }
  return { metadata: json.metadata, shards, weightMap };
}

async function openIndexed(path: string, indexBytes: Uint8Array, options: OpenOptions): Promise<KdtrBundle> {
  const index = parseKdtrIndex(parseJsonBytes(indexBytes, path, 'kdtr-index'), path);
  const dir = dirname(path);
  const opened: OpenFile[] = [];
  const tensors: TensorInfo[] = [];
  const owner = new Map<string, string>();
  try {
    for (const [i, shard] of index.shards.entries()) {
      const shardPath = join(dir, shard.file);
      const { handle, preamble, header } = await openKdtrFile(shardPath, options);
      opened.push({ path: shardPath, handle, format: 'kdtr' });
      const mismatch = (field: string, expected: number, actual: number) =>
        new InvalidFieldError('shard differs from its index entry (a shard from another bundle?)', {
          file: path,
          format: 'kdtr-index',
          field: `shards[${i}].${field}`,
          expected: `${expected}`,
          actual: `${actual} in ${shard.file}`,
        });
      if (preamble.fileLength !== shard.fileLength) throw mismatch('file_length', shard.fileLength, preamble.fileLength);
      if (preamble.headerCrc32 !== shard.headerCrc32) throw mismatch('header_crc32', shard.headerCrc32, preamble.headerCrc32);
      if (preamble.tensorCount !== shard.tensorCount) throw mismatch('tensor_count', shard.tensorCount, preamble.tensorCount);
      for (const info of toInfos(shardPath, header)) {
        const first = owner.get(info.name);
        if (first !== undefined) {
          throw new DuplicateTensorError(`tensor is in two shards (${basename(first)} and ${shard.file})`, { file: path, format: 'kdtr-index', tensor: info.name });
        }
        owner.set(info.name, shardPath);
        if (index.weightMap.get(info.name) !== i) {
          throw new InvalidFieldError('weight_map does not place this tensor in the shard that holds it', {
            file: path,
            format: 'kdtr-index',
            tensor: info.name,
            field: 'weight_map',
            expected: `${i} (${shard.file})`,
            actual: JSON.stringify(index.weightMap.get(info.name) ?? null),
          });
        }
        tensors.push(info);
      }
    }
    if (owner.size !== index.weightMap.size) {
      const missing = [...index.weightMap.keys()].find((n) => !owner.has(n))!;
      throw new InvalidFieldError('weight_map names a tensor that no shard holds', { file: path, format: 'kdtr-index', tensor: missing, field: 'weight_map' });
    }
  } catch (error) {
    await Promise.all(opened.map((f) => f.handle.close()));
    throw error;
  }
  return new KdtrBundle({ path, format: 'kdtr-index', metadata: index.metadata, version: '1.0', shards: index.shards, files: opened, tensors });
}

/**
 * Opens a KDTR bundle: a .kdtr file or a multi-file index. Validates everything before returning;
 * every failure is a FormatError subclass naming the file, tensor and field.
 */
export async function openBundle(path: string, options: OpenOptions = {}): Promise<KdtrBundle> {
  const indexBytes = await readIfIndex(path, options);
  return indexBytes === undefined ? openSingle(path, options) : openIndexed(path, indexBytes, options);
}

/** The whole file when it is a JSON index (starts with '{'), else undefined. */
async function readIfIndex(path: string, options: OpenOptions): Promise<Uint8Array | undefined> {
  const { handle, size } = await openRegularFile(path, 'kdtr');
  try {
    const head = new Uint8Array(Math.min(size, 16));
    await preadFully(handle, head, 0, head.byteLength, 0, { file: path, format: 'kdtr' });
    if (startsWithMagic(head) || firstNonSpace(head) !== 0x7b /* { */) return undefined;
    const limit = options.maxHeaderBytes ?? KDTR_DEFAULT_MAX_HEADER_BYTES;
    if (size > limit) {
      throw new HeaderTooLargeError('index larger than the reader limit', { file: path, format: 'kdtr-index', expected: `at most ${limit} bytes`, actual: `${size} bytes` });
    }
    const bytes = new Uint8Array(size);
    await preadFully(handle, bytes, 0, size, 0, { file: path, format: 'kdtr-index' });
    return bytes;
  } finally {
    await handle.close();
  }
}

function firstNonSpace(bytes: Uint8Array): number | undefined {
  for (const b of bytes) if (b !== 0x20 && b !== 0x0a && b !== 0x0d && b !== 0x09) return b;
  return undefined;
}

export function isFormatError(error: unknown): error is FormatError {
  return error instanceof FormatError;
}
