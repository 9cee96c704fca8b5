/**
 * KDTR v1 byte layout (docs/format/kdtr-v1.md is the normative text):
 *
 *   [0, 64)                  preamble (fixed, little-endian), then zeros up to 4096
 *   [4096, header_offset)    tensor data, each tensor at a multiple of 4096, zero padding between
 *   [header_offset, EOF)     header: UTF-8 JSON {"metadata": {...}, "tensors": [...]}
 *
 * The header sits at the end so a writer can stream tensors of any count and size without knowing
 * them in advance; the preamble, written last, is what makes the file valid.
 */
import { crc32 } from './crc32.js';
import {
  BadMagicError,
  ChecksumMismatchError,
  InvalidFieldError,
  TruncatedFileError,
  UnsupportedVersionError,
} from './errors.js';

/** "KDTR" then CR LF SUB LF, like PNG: catches text-mode transfers and truncation to 7 bits. */
export const KDTR_MAGIC = Uint8Array.of(0x4b, 0x44, 0x54, 0x52, 0x0d, 0x0a, 0x1a, 0x0a);
export const KDTR_VERSION_MAJOR = 1;
export const KDTR_VERSION_MINOR = 0;
export const KDTR_PREAMBLE_BYTES = 64;
/** Page alignment: tensors can be mmapped, and read with O_DIRECT / GPUDirect Storage. */
export const KDTR_ALIGNMENT = 4096;
/** Largest header a reader allocates by default (Kimi K2's ~500k tensors need about 80 MB). */
export const KDTR_DEFAULT_MAX_HEADER_BYTES = 512 * 1024 * 1024;

export interface KdtrPreamble {
  versionMajor: number;
  versionMinor: number;
  alignment: number;
  headerOffset: number;
  headerLength: number;
  fileLength: number;
  headerCrc32: number;
  tensorCount: number;
}

const OFFSETS = {
  versionMajor: 8,
  versionMinor: 10,
  alignment: 12,
  headerOffset: 16,
  headerLength: 24,
  fileLength: 32,
  headerCrc32: 40,
  tensorCount: 44,
  reserved: 48,
  preambleCrc32: 60,
} as const;

export function encodePreamble(p: KdtrPreamble): Uint8Array {
  const bytes = new Uint8Array(KDTR_PREAMBLE_BYTES);
  const view = new DataView(bytes.buffer);
  bytes.set(KDTR_MAGIC, 0);
  view.setUint16(OFFSETS.versionMajor, p.versionMajor, true);
  view.setUint16(OFFSETS.versionMinor, p.versionMinor, true);
  view.setUint32(OFFSETS.alignment, p.alignment, true);
  view.setBigUint64(OFFSETS.headerOffset, BigInt(p.headerOffset), true);
  view.setBigUint64(OFFSETS.headerLength, BigInt(p.headerLength), true);
  view.setBigUint64(OFFSETS.fileLength, BigInt(p.fileLength), true);
  view.setUint32(OFFSETS.headerCrc32, p.headerCrc32, true);
  view.setUint32(OFFSETS.tensorCount, p.tensorCount, true);
  view.setUint32(OFFSETS.preambleCrc32, crc32(bytes.subarray(0, OFFSETS.preambleCrc32)), true);
  return bytes;
}

function readU64(view: DataView, offset: number, field: string, file: string): number {
  const value = view.getBigUint64(offset, true);
  if (value > BigInt(Number.MAX_SAFE_INTEGER)) {
    throw new InvalidFieldError('value too large', {
      file,
      format: 'kdtr',
      field,
      expected: `at most 2^53 - 1`,
      actual: value.toString(),
    });
  }
  return Number(value);
}

/**
 * Decodes and checks the preamble against the real file length. Everything later trusts only
 * what passed here: the header is allocated only once its length fits inside the file.
 */
export function decodePreamble(bytes: Uint8Array, actualFileLength: number, file: string): KdtrPreamble {
  if (bytes.byteLength < KDTR_PREAMBLE_BYTES) {
    if (startsWithMagic(bytes)) {
      throw new TruncatedFileError('file ends inside the preamble', {
        file,
        format: 'kdtr',
        expected: `at least ${KDTR_PREAMBLE_BYTES} bytes`,
        actual: `${bytes.byteLength} bytes`,
      });
    }
    throw new BadMagicError('not a KDTR file', { file, format: 'kdtr', expected: 'magic "KDTR\\r\\n\\x1a\\n"', actual: hexPrefix(bytes) });
  }
  if (!startsWithMagic(bytes)) {
    throw new BadMagicError('not a KDTR file', { file, format: 'kdtr', expected: 'magic "KDTR\\r\\n\\x1a\\n"', actual: hexPrefix(bytes) });
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, KDTR_PREAMBLE_BYTES);
  const storedCrc = view.getUint32(OFFSETS.preambleCrc32, true);
  const actualCrc = crc32(bytes.subarray(0, OFFSETS.preambleCrc32));
  if (storedCrc !== actualCrc) {
    throw new ChecksumMismatchError('preamble checksum mismatch (corrupt or partially written file)', {
      file,
      format: 'kdtr',
      field: 'preamble_crc32',
      expected: hex32(storedCrc),
      actual: hex32(actualCrc),
    });
  }
  const versionMajor = view.getUint16(OFFSETS.versionMajor, true);
  const versionMinor = view.getUint16(OFFSETS.versionMinor, true);
  if (versionMajor !== KDTR_VERSION_MAJOR) {
    throw new UnsupportedVersionError('unsupported KDTR version', {
      file,
      format: 'kdtr',
      field: 'version_major',
      expected: `${KDTR_VERSION_MAJOR}`,
      actual: `${versionMajor}.${versionMinor}`,
    });
  }
  const alignment = view.getUint32(OFFSETS.alignment, true);
  if (alignment !== KDTR_ALIGNMENT) {
    throw new InvalidFieldError('unsupported alignment', { file, format: 'kdtr', field: 'alignment', expected: `${KDTR_ALIGNMENT}`, actual: `${alignment}` });
  }
  for (let i = OFFSETS.reserved; i < OFFSETS.preambleCrc32; i++) {
    if (bytes[i] !== 0) {
      throw new InvalidFieldError('reserved preamble bytes must be zero', { file, format: 'kdtr', field: 'reserved', actual: `byte ${i} = ${bytes[i]}` });
    }
  }
  const headerOffset = readU64(view, OFFSETS.headerOffset, 'header_offset', file);
  const headerLength = readU64(view, OFFSETS.headerLength, 'header_length', file);
  const fileLength = readU64(view, OFFSETS.fileLength, 'file_length', file);
  if (actualFileLength < fileLength) {
    throw new TruncatedFileError('file is shorter than its preamble declares', {
      file,
      format: 'kdtr',
      field: 'file_length',
      expected: `${fileLength} bytes`,
      actual: `${actualFileLength} bytes`,
    });
  }
  if (actualFileLength > fileLength) {
    throw new InvalidFieldError('file has trailing bytes after the header', {
      file,
      format: 'kdtr',
      field: 'file_length',
      expected: `${fileLength} bytes`,
      actual: `${actualFileLength} bytes`,
    });
  }
  // The data region starts at 4096 whether or not it holds a tensor, so the header never sits
  // inside the preamble's page (an empty bundle's header is at 4096).
  if (headerOffset < KDTR_ALIGNMENT || headerOffset + headerLength !== fileLength) {
    throw new InvalidFieldError('header must span from header_offset to the end of the file', {
      file,
      format: 'kdtr',
      field: 'header_offset',
      expected: `header_offset >= ${KDTR_ALIGNMENT} and header_offset + header_length == file_length (${fileLength})`,
      actual: `header_offset ${headerOffset}, header_length ${headerLength}`,
    });
  }
  return {
    versionMajor,
    versionMinor,
    alignment,
    headerOffset,
    headerLength,
    fileLength,
    headerCrc32: view.getUint32(OFFSETS.headerCrc32, true),
    tensorCount: view.getUint32(OFFSETS.tensorCount, true),
  };
}

export function startsWithMagic(bytes: Uint8Array): boolean {
  const n = Math.min(bytes.byteLength, KDTR_MAGIC.byteLength);
  if (n < KDTR_MAGIC.byteLength) return false;
  for (let i = 0; i < n; i++) if (bytes[i] !== KDTR_MAGIC[i]) return false;
  return true;
}

export function hex32(value: number): string {
  return `0x${(value >>> 0).toString(16).padStart(8, '0')}`;
}

function hexPrefix(bytes: Uint8Array): string {
  return Array.from(bytes.subarray(0, 8), (b) => b.toString(16).padStart(2, '0')).join(' ') || '(empty file)';
}
