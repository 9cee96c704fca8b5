/**
 * Validation of the KDTR JSON header. Nothing in it is trusted until every field is checked:
 * types, dtype names, shape x dtype = size, alignment, bounds, order, overlaps and duplicates.
 */
import { checkDtype, dtypeSize, elementCount, type Dtype } from './dtypes.js';
import {
  DuplicateTensorError,
  HeaderParseError,
  InvalidFieldError,
  MisalignedError,
  OutOfRangeError,
  OverlapError,
  ShapeSizeMismatchError,
  truncate,
} from './errors.js';
import { KDTR_ALIGNMENT, KDTR_VERSION_MINOR, type KdtrPreamble } from './kdtr-layout.js';
import { isIntegerLiteral, parseStrictJsonBytes } from './strict-json.js';

export const MAX_TENSOR_NAME_BYTES = 4096;
export const MAX_RANK = 16;

/** One row of the tensor table as stored in the header. */
export interface KdtrTensorEntry {
  name: string;
  dtype: Dtype;
  shape: number[];
  offset: number;
  size: number;
  crc32: number;
}

export interface KdtrHeader {
  metadata: Record<string, unknown>;
  tensors: KdtrTensorEntry[];
}

const TENSOR_KEYS = new Set(['name', 'dtype', 'shape', 'offset', 'size', 'crc32']);
const TOP_KEYS = new Set(['metadata', 'tensors']);
const encoder = new TextEncoder();

export function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * Parses a header or index: strict UTF-8 JSON (no BOM, no duplicate keys, no lone surrogates,
 * bounded nesting, nothing after the value; see strict-json.ts). Every failure is a
 * HeaderParseError naming the file.
 */
export function parseJsonBytes(bytes: Uint8Array, file: string, format: 'kdtr' | 'kdtr-index' | 'safetensors' | 'safetensors-index'): unknown {
  return parseStrictJsonBytes(bytes, { file, format, what: format.endsWith('index') ? 'index' : 'header' });
}

/**
 * A non-negative integer field: a JSON integer literal (no fraction or exponent, see
 * strict-json.ts) below 2^53.
 */
function nonNegativeInteger(container: Record<string, unknown>, key: string, file: string, tensor: string): number {
  const value = container[key];
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0 || !isIntegerLiteral(container, key)) {
    throw new InvalidFieldError('not a non-negative integer', {
      file,
      format: 'kdtr',
      tensor,
      field: key,
      expected: 'an integer literal in [0, 2^53) (no fraction, no exponent)',
      actual: truncate(JSON.stringify(value) ?? String(value), 80),
    });
  }
  return value;
}

export function validateShape(value: unknown, file: string, tensor: string, format: 'kdtr' | 'safetensors'): number[] {
  if (!Array.isArray(value) || value.length > MAX_RANK) {
    throw new InvalidFieldError('shape must be an array of at most 16 dimensions', {
      file,
      format,
      tensor,
      field: 'shape',
      expected: 'an array of non-negative integers',
      actual: truncate(JSON.stringify(value) ?? String(value), 80),
    });
  }
  value.forEach((d: unknown, i: number) => {
    if (typeof d !== 'number' || !Number.isSafeInteger(d) || d < 0 || !isIntegerLiteral(value, i)) {
      throw new InvalidFieldError('shape dimension is not a non-negative integer', {
        file,
        format,
        tensor,
        field: 'shape',
        expected: 'integer literals in [0, 2^53)',
        actual: truncate(JSON.stringify(value), 80),
      });
    }
  });
  return value as number[];
}

/** Byte size of a shape x dtype, or an error naming both when it does not fit in 2^53. */
export function checkedByteSize(shape: number[], dtype: Dtype, file: string, tensor: string, format: 'kdtr' | 'safetensors'): number {
  const count = elementCount(shape);
  const bytes = count === undefined ? undefined : count * dtypeSize(dtype);
  if (bytes === undefined || !Number.isSafeInteger(bytes)) {
    throw new ShapeSizeMismatchError('shape is too large', { file, format, tensor, field: 'shape', actual: JSON.stringify(shape) });
  }
  return bytes;
}

function validateName(value: unknown, file: string, index: number): string {
  if (typeof value !== 'string' || value.length === 0 || value.includes('\0') || encoder.encode(value).byteLength > MAX_TENSOR_NAME_BYTES) {
    throw new InvalidFieldError('tensor name must be a non-empty string without NUL, at most 4096 UTF-8 bytes', {
      file,
      format: 'kdtr',
      field: `tensors[${index}].name`,
      actual: truncate(JSON.stringify(value) ?? String(value), 80),
    });
  }
  return value;
}

/**
 * Checks a parsed header against its preamble. Returns the entries in file order; throws the
 * first problem found, naming tensor and field.
 */
export function validateKdtrHeader(json: unknown, preamble: KdtrPreamble, file: string): KdtrHeader {
  if (!isPlainObject(json)) {
    throw new HeaderParseError('header must be a JSON object', { file, format: 'kdtr', expected: '{"metadata": {...}, "tensors": [...]}' });
  }
  const strict = preamble.versionMinor <= KDTR_VERSION_MINOR;
  if (strict) {
    for (const key of Object.keys(json)) {
      if (!TOP_KEYS.has(key)) {
        throw new InvalidFieldError('unknown top-level header key', { file, format: 'kdtr', field: key, expected: '"metadata" and "tensors"' });
      }
    }
  }
  const metadata = json.metadata;
  if (!isPlainObject(metadata)) {
    throw new InvalidFieldError('metadata must be a JSON object', { file, format: 'kdtr', field: 'metadata', actual: typeof metadata });
  }
  const rows = json.tensors;
  if (!Array.isArray(rows)) {
    throw new InvalidFieldError('tensors must be an array', { file, format: 'kdtr', field: 'tensors', actual: typeof rows });
  }
  if (rows.length !== preamble.tensorCount) {
    throw new InvalidFieldError('tensor count differs from the preamble', {
      file,
      format: 'kdtr',
      field: 'tensor_count',
      expected: `${preamble.tensorCount}`,
      actual: `${rows.length} entries`,
    });
  }
  const seen = new Set<string>();
  const tensors: KdtrTensorEntry[] = [];
  let previousEnd = KDTR_ALIGNMENT;
  let previousName = '(preamble)';
  rows.forEach((row: unknown, index: number) => {
    if (!isPlainObject(row)) {
      throw new InvalidFieldError('tensor entry must be an object', { file, format: 'kdtr', field: `tensors[${index}]` });
    }
    const name = validateName(row.name, file, index);
    if (strict) {
      for (const key of Object.keys(row)) {
        if (!TENSOR_KEYS.has(key)) {
          throw new InvalidFieldError('unknown tensor field', { file, format: 'kdtr', tensor: name, field: key, expected: [...TENSOR_KEYS].join(', ') });
        }
      }
    }
    if (seen.has(name)) {
      throw new DuplicateTensorError('tensor name appears twice', { file, format: 'kdtr', tensor: name, field: `tensors[${index}].name` });
    }
    seen.add(name);
    const dtype = checkDtype(row.dtype, { file, tensor: name, format: 'kdtr' });
    const shape = validateShape(row.shape, file, name, 'kdtr');
    const offset = nonNegativeInteger(row, 'offset', file, name);
    const size = nonNegativeInteger(row, 'size', file, name);
    const crc = nonNegativeInteger(row, 'crc32', file, name);
    if (crc > 0xffffffff) {
      throw new InvalidFieldError('crc32 out of range', { file, format: 'kdtr', tensor: name, field: 'crc32', expected: 'at most 4294967295', actual: `${crc}` });
    }
    const expectedSize = checkedByteSize(shape, dtype, file, name, 'kdtr');
    if (expectedSize !== size) {
      throw new ShapeSizeMismatchError('size differs from shape x dtype', {
        file,
        format: 'kdtr',
        tensor: name,
        field: 'size',
        expected: `${expectedSize} bytes (${JSON.stringify(shape)} x ${dtype})`,
        actual: `${size}`,
      });
    }
    if (offset % KDTR_ALIGNMENT !== 0) {
      throw new MisalignedError('tensor offset not aligned', { file, format: 'kdtr', tensor: name, field: 'offset', expected: `a multiple of ${KDTR_ALIGNMENT}`, actual: `${offset}` });
    }
    if (offset < previousEnd) {
      throw new OverlapError(`tensor starts before the end of '${truncate(previousName, 80)}' (tensors must be in file order without overlap)`, {
        file,
        format: 'kdtr',
        tensor: name,
        field: 'offset',
        expected: `>= ${previousEnd}`,
        actual: `${offset}`,
      });
    }
    if (offset + size > preamble.headerOffset) {
      throw new OutOfRangeError('tensor data runs into the header', {
        file,
        format: 'kdtr',
        tensor: name,
        field: 'size',
        expected: `offset + size <= header_offset (${preamble.headerOffset})`,
        actual: `${offset} + ${size}`,
      });
    }
    previousEnd = offset + size;
    previousName = name;
    tensors.push({ name, dtype, shape, offset, size, crc32: crc });
  });
  return { metadata, tensors };
}
