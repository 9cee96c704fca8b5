/**
 * NumPy .npy read/write (format versions 1.0, 2.0, 3.0; little-endian, C order) for golden arrays:
 * logits, activations and token lists exchanged with Python tools.
 */
import { readFile } from 'node:fs/promises';
import { writeFileAtomic } from './atomic-file.js';
import { dtypeSize, type Dtype } from './dtypes.js';
import { BadMagicError, HeaderParseError, InvalidFieldError, ShapeSizeMismatchError, TruncatedFileError, UnknownDtypeError, UnsupportedVersionError } from './errors.js';
import { checkedByteSize } from './kdtr-header.js';

export interface NpyArray {
  dtype: Dtype;
  shape: number[];
  /** Little-endian, row-major element bytes. */
  data: Uint8Array;
}

const NPY_MAGIC = Uint8Array.of(0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59); // \x93NUMPY
const DESCR_TO_DTYPE: Record<string, Dtype> = {
  f8: 'F64',
  f4: 'F32',
  f2: 'F16',
  i8: 'I64',
  i4: 'I32',
  i2: 'I16',
  i1: 'I8',
  u8: 'U64',
  u4: 'U32',
  u2: 'U16',
  u1: 'U8',
  b1: 'BOOL',
};
const DTYPE_TO_DESCR: Partial<Record<Dtype, string>> = {
  F64: '<f8',
  F32: '<f4',
  F16: '<f2',
  I64: '<i8',
  I32: '<i4',
  I16: '<i2',
  I8: '|i1',
  U64: '<u8',
  U32: '<u4',
  U16: '<u2',
  U8: '|u1',
  BOOL: '|b1',
};

export function parseNpy(bytes: Uint8Array, file = '<buffer>'): NpyArray {
  const where = { file, format: 'npy' as const };
  if (bytes.byteLength < 10 || !NPY_MAGIC.every((b, i) => bytes[i] === b)) {
    throw new BadMagicError('not a .npy file', { ...where, expected: 'magic \\x93NUMPY' });
  }
  const major = bytes[6];
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let headerStart: number;
  let headerLength: number;
  if (major === 1) {
    headerLength = view.getUint16(8, true);
    headerStart = 10;
  } else if (major === 2 || major === 3) {
    if (bytes.byteLength < 12) throw new TruncatedFileError('file ends inside the header length', where);
    headerLength = view.getUint32(8, true);
    headerStart = 12;
  } else {
    throw new UnsupportedVersionError('unsupported .npy version', { ...where, field: 'version', expected: '1, 2 or 3', actual: `${major}.${bytes[7]}` });
  }
  if (headerStart + headerLength > bytes.byteLength) {
    throw new TruncatedFileError('file ends inside the header', { ...where, expected: `${headerStart + headerLength} bytes`, actual: `${bytes.byteLength}` });
  }
  const header = new TextDecoder(major === 3 ? 'utf-8' : 'latin1').decode(bytes.subarray(headerStart, headerStart + headerLength));
  const descr = /'descr'\s*:\s*'([^']*)'/.exec(header)?.[1];
  const fortran = /'fortran_order'\s*:\s*(True|False)/.exec(header)?.[1];
  const shapeText = /'shape'\s*:\s*\(([^)]*)\)/.exec(header)?.[1];
  if (descr === undefined || fortran === undefined || shapeText === undefined) {
    throw new HeaderParseError('header lacks descr, fortran_order or shape', { ...where, actual: header.trim().slice(0, 120) });
  }
  if (fortran === 'True') {
    throw new InvalidFieldError('Fortran-order arrays are not supported', { ...where, field: 'fortran_order', expected: 'False (C order; use np.ascontiguousarray)' });
  }
  const order = descr[0];
  const dtype = DESCR_TO_DTYPE[descr.slice(1)];
  if ((order !== '<' && order !== '|' && order !== '=') || dtype === undefined || (order === '|' && dtypeSize(dtype) !== 1)) {
    throw new UnknownDtypeError('unsupported .npy dtype', { ...where, field: 'descr', expected: `little-endian ${Object.values(DTYPE_TO_DESCR).join(' ')}`, actual: descr });
  }
  const shape = shapeText
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s !== '')
    .map((s) => {
      const n = Number(s.replace(/L$/, ''));
      if (!Number.isSafeInteger(n) || n < 0) throw new InvalidFieldError('bad shape dimension', { ...where, field: 'shape', actual: shapeText });
      return n;
    });
  const size = checkedByteSize(shape, dtype, file, 'array', 'kdtr');
  const dataStart = headerStart + headerLength;
  if (bytes.byteLength - dataStart !== size) {
    throw new ShapeSizeMismatchError('data length differs from shape x dtype', { ...where, expected: `${size} bytes`, actual: `${bytes.byteLength - dataStart}` });
  }
  return { dtype, shape, data: bytes.subarray(dataStart) };
}

export function encodeNpy(array: NpyArray): Uint8Array {
  const descr = DTYPE_TO_DESCR[array.dtype];
  if (descr === undefined) {
    throw new UnknownDtypeError('dtype has no .npy equivalent', { file: '<npy>', format: 'npy', field: 'dtype', expected: Object.keys(DTYPE_TO_DESCR).join(' '), actual: array.dtype });
  }
  const size = checkedByteSize(array.shape, array.dtype, '<npy>', 'array', 'kdtr');
  if (array.data.byteLength !== size) {
    throw new ShapeSizeMismatchError('data length differs from shape x dtype', { file: '<npy>', format: 'npy', expected: `${size} bytes`, actual: `${array.data.byteLength}` });
  }
  const shape = array.shape.length === 1 ? `(${array.shape[0]},)` : `(${array.shape.join(', ')})`;
  let header = `{'descr': '${descr}', 'fortran_order': False, 'shape': ${shape}, }`;
  const preamble = 10;
  const total = Math.ceil((preamble + header.length + 1) / 64) * 64;
  header = header.padEnd(total - preamble - 1, ' ') + '\n';
  if (header.length > 0xffff) throw new InvalidFieldError('shape too long for a version 1.0 header', { file: '<npy>', format: 'npy', field: 'shape' });
  const out = new Uint8Array(total + size);
  out.set(NPY_MAGIC, 0);
  out[6] = 1;
  out[7] = 0;
  new DataView(out.buffer).setUint16(8, header.length, true);
  for (let i = 0; i < header.length; i++) out[preamble + i] = header.charCodeAt(i);
  out.set(array.data, total);
  return out;
}

export async function readNpy(path: string): Promise<NpyArray> {
  const bytes = await readFile(path);
  return parseNpy(new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength), path);
}

/** Writes a .npy file atomically. */
export async function writeNpy(path: string, array: NpyArray): Promise<void> {
  await writeFileAtomic(path, encodeNpy(array));
}
