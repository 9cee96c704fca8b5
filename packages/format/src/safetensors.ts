/**
 * safetensors interop: read single files and sharded checkpoints (model.safetensors.index.json),
 * write single files. The writer lays files out as the reference `safetensors` library does
 * (compact JSON header, tensors in the given order, header padded with spaces to 8 bytes), so a
 * file imported into KDTR and exported again comes back byte for byte.
 */
import { stat, type FileHandle } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { AtomicFile } from './atomic-file.js';
import { checkDtype, type Dtype } from './dtypes.js';
import {
  BadMagicError,
  DuplicateTensorError,
  HeaderParseError,
  HeaderTooLargeError,
  InvalidFieldError,
  NotAFileError,
  OutOfRangeError,
  OverlapError,
  ShapeSizeMismatchError,
  TruncatedFileError,
  UsageError,
} from './errors.js';
import { checkedByteSize, isPlainObject, parseJsonBytes, validateShape } from './kdtr-header.js';
import { nonRegularKind, openRegularFile, readRegularFile } from './file-access.js';
import { preadFully } from './positional-io.js';
import { dataChunks, type TensorData } from './tensor-data.js';
import { TensorStore, type OpenFile, type TensorInfo } from './tensor-store.js';

/** The reference implementation refuses headers above 100 MB; so do we by default. */
export const SAFETENSORS_MAX_HEADER_BYTES = 100_000_000;
export const SAFETENSORS_INDEX_NAME = 'model.safetensors.index.json';

export class SafetensorsCheckpoint extends TensorStore {
  readonly format: 'safetensors' | 'safetensors-index';
  /** `__metadata__` of the file (for a sharded checkpoint: of the first shard). */
  readonly metadata: Readonly<Record<string, string>>;
  /** For sharded checkpoints: the index's own "metadata" object. */
  readonly indexMetadata?: Readonly<Record<string, unknown>>;
  readonly fileNames: readonly string[];

  /** @internal use openSafetensors() */
  constructor(
    readonly path: string,
    args: {
      format: 'safetensors' | 'safetensors-index';
      metadata: Record<string, string>;
      indexMetadata?: Record<string, unknown>;
      files: OpenFile[];
      tensors: TensorInfo[];
    },
  ) {
    super(args.files, args.tensors);
    this.format = args.format;
    this.metadata = args.metadata;
    this.indexMetadata = args.indexMetadata;
    this.fileNames = args.files.map((f) => f.path);
  }

  protected checkCrc(): void {
    // safetensors stores no checksums (huggingface/safetensors#220).
  }
}

interface ParsedSafetensorsFile {
  handle: FileHandle;
  metadata: Record<string, string>;
  tensors: TensorInfo[];
}

async function openSafetensorsFile(path: string, maxHeaderBytes: number): Promise<ParsedSafetensorsFile> {
  const { handle, size } = await openRegularFile(path, 'safetensors');
  try {
    const where = { file: path, format: 'safetensors' as const };
    if (size < 8) throw new TruncatedFileError('file too short for a safetensors header length', { ...where, expected: 'at least 8 bytes', actual: `${size} bytes` });
    const lengthBytes = new Uint8Array(8);
    await preadFully(handle, lengthBytes, 0, 8, 0, where);
    const declared = new DataView(lengthBytes.buffer).getBigUint64(0, true);
    if (declared > BigInt(maxHeaderBytes)) {
      throw new HeaderTooLargeError('header length above the limit', { ...where, field: 'header_length', expected: `at most ${maxHeaderBytes} bytes`, actual: declared.toString() });
    }
    const headerLength = Number(declared);
    if (8 + headerLength > size) {
      throw new TruncatedFileError('file ends inside the header', { ...where, field: 'header_length', expected: `${8 + headerLength} bytes at least`, actual: `${size} bytes` });
    }
    const headerBytes = new Uint8Array(headerLength);
    await preadFully(handle, headerBytes, 0, headerLength, 8, where);
    if (headerBytes[0] !== 0x7b) {
      // The reference library's InvalidHeaderStart: what follows the length is not a JSON object.
      throw new BadMagicError('not a safetensors file: the header does not start with "{"', { ...where, field: 'header', expected: 'a u64 header length, then a JSON object', actual: headerLength === 0 ? 'an empty header' : `byte 0x${headerBytes[0].toString(16).padStart(2, '0')}` });
    }
    const json = parseJsonBytes(headerBytes, path, 'safetensors');
    if (!isPlainObject(json)) throw new HeaderParseError('header must be a JSON object', where);
    const dataStart = 8 + headerLength;
    const dataLength = size - dataStart;
    let metadata: Record<string, string> = {};
    const rows: { info: TensorInfo; begin: number; end: number }[] = [];
    for (const [name, value] of Object.entries(json)) {
      if (name === '__metadata__') {
        if (!isPlainObject(value) || !Object.values(value).every((v) => typeof v === 'string')) {
          throw new InvalidFieldError('__metadata__ must map strings to strings', { ...where, field: '__metadata__' });
        }
        metadata = value as Record<string, string>;
        continue;
      }
      if (!isPlainObject(value)) throw new InvalidFieldError('tensor entry must be an object', { ...where, tensor: name });
      const dtype: Dtype = checkDtype(value.dtype, { file: path, tensor: name, format: 'safetensors' });
      const shape = validateShape(value.shape, path, name, 'safetensors');
      const offsets = value.data_offsets;
      if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every((o) => typeof o === 'number' && Number.isSafeInteger(o) && o >= 0) || offsets[0] > offsets[1]) {
        throw new InvalidFieldError('data_offsets must be [begin, end] with 0 <= begin <= end', { ...where, tensor: name, field: 'data_offsets', actual: JSON.stringify(offsets) });
      }
      const [begin, end] = offsets as [number, number];
      const size = checkedByteSize(shape, dtype, path, name, 'safetensors');
      if (end - begin !== size) {
        throw new ShapeSizeMismatchError('data_offsets span differs from shape x dtype', { ...where, tensor: name, field: 'data_offsets', expected: `${size} bytes`, actual: `${end - begin}` });
      }
      if (end > dataLength) {
        throw new OutOfRangeError('tensor data past the end of the file', { ...where, tensor: name, field: 'data_offsets', expected: `end <= ${dataLength}`, actual: `${end}` });
      }
      rows.push({ info: { name, dtype, shape, size, file: path, offset: dataStart + begin }, begin, end });
    }
    rows.sort((a, b) => a.begin - b.begin || a.end - b.end);
    let previous = 0;
    for (const row of rows) {
      if (row.begin !== previous) {
        const message = row.begin < previous ? 'tensors overlap' : 'gap between tensors (the format packs them contiguously)';
        throw new OverlapError(message, { ...where, tensor: row.info.name, field: 'data_offsets', expected: `begin == ${previous}`, actual: `${row.begin}` });
      }
      previous = row.end;
    }
    if (previous !== dataLength) {
      throw new OutOfRangeError('trailing bytes after the last tensor', { ...where, expected: `data length ${previous}`, actual: `${dataLength}` });
    }
    return { handle, metadata, tensors: rows.map((r) => r.info) };
  } catch (error) {
    await handle.close();
    throw error;
  }
}

export interface OpenSafetensorsOptions {
  maxHeaderBytes?: number;
}

/**
 * Opens a .safetensors file, a model.safetensors.index.json, or a directory holding either
 * (a HuggingFace model directory).
 */
export async function openSafetensors(path: string, options: OpenSafetensorsOptions = {}): Promise<SafetensorsCheckpoint> {
  const limit = options.maxHeaderBytes ?? SAFETENSORS_MAX_HEADER_BYTES;
  const resolved = await resolveCheckpointPath(path);
  if (!resolved.endsWith('.json')) {
    const parsed = await openSafetensorsFile(resolved, limit);
    return new SafetensorsCheckpoint(resolved, {
      format: 'safetensors',
      metadata: parsed.metadata,
      files: [{ path: resolved, handle: parsed.handle, format: 'safetensors' }],
      tensors: parsed.tensors,
    });
  }
  return openSafetensorsIndex(resolved, limit);
}

async function resolveCheckpointPath(path: string): Promise<string> {
  const info = await stat(path);
  if (!info.isDirectory()) return path;
  for (const candidate of [SAFETENSORS_INDEX_NAME, 'model.safetensors']) {
    const full = join(path, candidate);
    if (await stat(full).then(() => true, () => false)) return full;
  }
  throw new UsageError('directory has neither model.safetensors.index.json nor model.safetensors', { file: path, format: 'safetensors' });
}

async function openSafetensorsIndex(path: string, limit: number): Promise<SafetensorsCheckpoint> {
  const bytes = await readRegularFile(path, 'safetensors-index', limit, (size) =>
    new HeaderTooLargeError('index larger than the limit', { file: path, format: 'safetensors-index', expected: `at most ${limit} bytes`, actual: `${size}` }),
  );
  const json = parseJsonBytes(bytes, path, 'safetensors-index');
  if (isPlainObject(json) && json.weight_map === undefined && ('architectures' in json || 'model_type' in json)) {
    // A model's config.json passed where its weights were meant: name the directory instead.
    throw new UsageError(`this is a model's config.json, not its weights; pass the directory that holds it (${dirname(path)})`, { file: path, format: 'safetensors-index' });
  }
  if (!isPlainObject(json) || !isPlainObject(json.weight_map)) {
    // any other JSON file: say what a JSON model file must be, not only which key is missing
    throw new InvalidFieldError('not a safetensors index (model.safetensors.index.json) or a KDTR index ("format": "kdtr-index")', {
      file: path,
      format: 'safetensors-index',
      field: 'weight_map',
      expected: 'a weight_map object of tensor name -> shard file',
      actual: isPlainObject(json) ? (json.weight_map === undefined ? '(absent)' : JSON.stringify(json.weight_map).slice(0, 40)) : `a JSON ${Array.isArray(json) ? 'array' : json === null ? 'null' : typeof json}`,
    });
  }
  const weightMap = json.weight_map;
  if (Object.keys(weightMap).length === 0) {
    // An index with nothing in it would open as a checkpoint of 0 tensors beside shards full of them.
    throw new InvalidFieldError('weight_map names no tensor', { file: path, format: 'safetensors-index', field: 'weight_map', expected: 'tensor name -> shard file for every tensor of the checkpoint', actual: '{}' });
  }
  const fileNames: string[] = [];
  for (const [name, file] of Object.entries(weightMap)) {
    if (typeof file !== 'string' || file === '' || /[/\\\0]/.test(file) || file === '..' || file === '.') {
      throw new InvalidFieldError('weight_map value must be a plain file name', { file: path, format: 'safetensors-index', tensor: name, field: 'weight_map', actual: JSON.stringify(file) });
    }
    if (!fileNames.includes(file)) fileNames.push(file);
  }
  fileNames.sort();
  const files: OpenFile[] = [];
  const tensors: TensorInfo[] = [];
  let firstMetadata: Record<string, string> | undefined;
  const seen = new Set<string>();
  try {
    for (const name of fileNames) {
      const shardPath = join(dirname(path), name);
      const parsed = await openSafetensorsFile(shardPath, limit);
      files.push({ path: shardPath, handle: parsed.handle, format: 'safetensors' });
      firstMetadata ??= parsed.metadata;
      for (const info of parsed.tensors) {
        if (seen.has(info.name)) throw new DuplicateTensorError('tensor in two shards', { file: path, format: 'safetensors-index', tensor: info.name });
        seen.add(info.name);
        if (weightMap[info.name] !== name) {
          throw new InvalidFieldError('weight_map does not place this tensor in the file that holds it', {
            file: path,
            format: 'safetensors-index',
            tensor: info.name,
            field: 'weight_map',
            expected: name,
            actual: JSON.stringify(weightMap[info.name] ?? null),
          });
        }
        tensors.push(info);
      }
    }
    const missing = Object.keys(weightMap).find((n) => !seen.has(n));
    if (missing !== undefined) {
      throw new InvalidFieldError('weight_map names a tensor its file does not hold', { file: path, format: 'safetensors-index', tensor: missing, field: 'weight_map', expected: `in ${String(weightMap[missing])}` });
    }
  } catch (error) {
    await Promise.all(files.map((f) => f.handle.close()));
    throw error;
  }
  return new SafetensorsCheckpoint(path, {
    format: 'safetensors-index',
    metadata: firstMetadata ?? {},
    indexMetadata: isPlainObject(json.metadata) ? json.metadata : undefined,
    files,
    tensors,
  });
}

/** The reference library's dtype enum order (Rust `safetensors::Dtype`), ascending alignment. */
const REFERENCE_DTYPE_ORDER: readonly Dtype[] = ['BOOL', 'U8', 'I8', 'F8_E5M2', 'F8_E4M3', 'I16', 'U16', 'F16', 'BF16', 'I32', 'U32', 'F32', 'F64', 'I64', 'U64'];

/**
 * Sorts tensors the way the reference library lays out a file it writes (`save_file`): by
 * dtype, largest alignment first, then by name. Writing in this order reproduces its files.
 */
export function referenceSafetensorsOrder<T extends { name: string; dtype: Dtype }>(tensors: readonly T[]): T[] {
  const rank = (d: Dtype) => REFERENCE_DTYPE_ORDER.indexOf(d);
  const bytes = (s: string) => Buffer.from(s, 'utf8');
  return [...tensors].sort((a, b) => rank(b.dtype) - rank(a.dtype) || Buffer.compare(bytes(a.name), bytes(b.name)));
}

export interface SafetensorsTensor {
  name: string;
  dtype: Dtype;
  shape: readonly number[];
  /** Bytes, or a function returning a stream of chunks (called once, in file order). */
  data: TensorData | (() => TensorData);
}

/**
 * Writes one .safetensors file, streaming each tensor's data in order (memory bounded by the
 * caller's chunks). The file is published atomically.
 */
export async function writeSafetensors(
  path: string,
  tensors: readonly SafetensorsTensor[],
  options: { metadata?: Record<string, string>; onTensor?: (name: string, index: number) => void } = {},
): Promise<void> {
  const header: Record<string, unknown> = {};
  if (options.metadata !== undefined && Object.keys(options.metadata).length > 0) header.__metadata__ = options.metadata;
  let offset = 0;
  const sizes: number[] = [];
  for (const t of tensors) {
    if (t.name === '__metadata__' || Object.prototype.hasOwnProperty.call(header, t.name)) {
      throw new DuplicateTensorError('tensor name used twice (or reserved)', { file: path, format: 'safetensors', tensor: t.name });
    }
    const dtype = checkDtype(t.dtype, { file: path, tensor: t.name, format: 'safetensors' });
    const shape = validateShape([...t.shape], path, t.name, 'safetensors');
    const size = checkedByteSize(shape, dtype, path, t.name, 'safetensors');
    header[t.name] = { dtype, shape, data_offsets: [offset, offset + size] };
    sizes.push(size);
    offset += size;
  }
  let json = JSON.stringify(header);
  const encoded = new TextEncoder().encode(json);
  json += ' '.repeat((8 - (encoded.byteLength % 8)) % 8);
  const headerBytes = new TextEncoder().encode(json);
  const file = await AtomicFile.create(path);
  try {
    const lengthBytes = new Uint8Array(8);
    new DataView(lengthBytes.buffer).setBigUint64(0, BigInt(headerBytes.byteLength), true);
    let position = 0;
    const writeAll = async (bytes: Uint8Array) => {
      await file.write(bytes, position);
      position += bytes.byteLength;
    };
    await writeAll(lengthBytes);
    await writeAll(headerBytes);
    for (const [i, t] of tensors.entries()) {
      options.onTensor?.(t.name, i);
      const data = typeof t.data === 'function' ? t.data() : t.data;
      let written = 0;
      for await (const chunk of dataChunks(data)) {
        written += chunk.byteLength;
        if (written > sizes[i]) break;
        await writeAll(chunk);
      }
      if (written !== sizes[i]) {
        throw new UsageError('tensor data length differs from shape x dtype', { file: path, format: 'safetensors', tensor: t.name, expected: `${sizes[i]} bytes`, actual: `${written} bytes or more` });
      }
    }
  } catch (error) {
    await file.abort();
    throw error;
  }
  await file.commit();
}

/**
 * The model config that belongs to a checkpoint path, if there is one: for a directory its
 * config.json; for a file `NAME.safetensors` first `NAME.config.json` beside it (what
 * `kdtree export -o NAME.safetensors` writes), then the directory's config.json. A candidate that
 * exists but is not a regular file (a directory named config.json) is an error, not skipped.
 */
export async function findModelConfig(path: string): Promise<string | undefined> {
  const info = await stat(path);
  const dir = info.isDirectory() ? path : dirname(path);
  const names = info.isDirectory() ? ['config.json'] : [modelConfigNameFor(path), 'config.json'];
  for (const name of [...new Set(names)]) {
    const candidate = join(dir, name);
    const found = await stat(candidate).catch(() => undefined);
    if (found === undefined) continue;
    const kind = nonRegularKind(found);
    if (kind !== undefined) throw new NotAFileError(`model config is ${kind}, not a regular file`, { file: candidate, format: 'json', expected: 'a config.json file' });
    return candidate;
  }
  return undefined;
}

/** `NAME.config.json` for `NAME.safetensors` (any other name: NAME.config.json for NAME). */
export function modelConfigNameFor(file: string): string {
  return `${basename(file).replace(/\.safetensors$/, '')}.config.json`;
}

export function isSafetensorsPath(path: string): boolean {
  const name = basename(path);
  return name.endsWith('.safetensors') || name === SAFETENSORS_INDEX_NAME || name.endsWith('.safetensors.index.json');
}
