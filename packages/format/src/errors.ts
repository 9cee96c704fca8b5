/**
 * Typed errors of @kdtree/format. Every error names the file it came from and, where it applies,
 * the tensor and the header field, with what was expected and what was found, so that a CLI can
 * print one line and a program can branch on `code`.
 */

export type ErrorFormat = 'kdtr' | 'kdtr-index' | 'safetensors' | 'safetensors-index' | 'npy' | 'json';

export interface FormatErrorDetails {
  file: string;
  format?: ErrorFormat;
  tensor?: string;
  field?: string;
  expected?: string;
  actual?: string;
  cause?: unknown;
}

/** Base class: `instanceof FormatError` catches every failure this package reports. */
export class FormatError extends Error {
  readonly code: string = 'KDTREE_FORMAT';
  readonly file: string;
  readonly format?: ErrorFormat;
  readonly tensor?: string;
  readonly field?: string;
  readonly expected?: string;
  readonly actual?: string;

  constructor(message: string, details: FormatErrorDetails) {
    super(FormatError.compose(message, details), details.cause === undefined ? undefined : { cause: details.cause });
    this.name = new.target.name;
    this.file = details.file;
    this.format = details.format;
    this.tensor = details.tensor;
    this.field = details.field;
    this.expected = details.expected;
    this.actual = details.actual;
  }

  private static compose(message: string, d: FormatErrorDetails): string {
    const where = [d.file];
    if (d.tensor !== undefined) where.push(`tensor '${truncate(d.tensor, 200)}'`);
    if (d.field !== undefined) where.push(`field '${d.field}'`);
    let text = `${where.join(': ')}: ${message}`;
    if (d.expected !== undefined) text += `; expected ${d.expected}`;
    if (d.actual !== undefined) text += `, found ${truncate(d.actual, 200)}`;
    return text;
  }
}

/** The file does not start with the format's magic bytes. */
export class BadMagicError extends FormatError {
  override readonly code = 'KDTREE_BAD_MAGIC';
}
/** The file declares a version this reader does not implement. */
export class UnsupportedVersionError extends FormatError {
  override readonly code = 'KDTREE_UNSUPPORTED_VERSION';
}
/** The file is shorter than its own header says (an interrupted copy or download). */
export class TruncatedFileError extends FormatError {
  override readonly code = 'KDTREE_TRUNCATED';
}
/** The declared header length is above the reader's limit, so it is not allocated. */
export class HeaderTooLargeError extends FormatError {
  override readonly code = 'KDTREE_HEADER_TOO_LARGE';
}
/** The header is not valid UTF-8 JSON of the expected top-level shape. */
export class HeaderParseError extends FormatError {
  override readonly code = 'KDTREE_HEADER_PARSE';
}
/** A header field is missing, of the wrong type, or out of its allowed range. */
export class InvalidFieldError extends FormatError {
  override readonly code = 'KDTREE_INVALID_FIELD';
}
/** A dtype name that is not in the format's table. */
export class UnknownDtypeError extends FormatError {
  override readonly code = 'KDTREE_UNKNOWN_DTYPE';
}
/** product(shape) x dtype size differs from the declared byte size. */
export class ShapeSizeMismatchError extends FormatError {
  override readonly code = 'KDTREE_SHAPE_SIZE_MISMATCH';
}
/** A tensor's bytes or the header lie (partly) outside the region they must be in. */
export class OutOfRangeError extends FormatError {
  override readonly code = 'KDTREE_OUT_OF_RANGE';
}
/** Two tensors share bytes, or the table is not in file order. */
export class OverlapError extends FormatError {
  override readonly code = 'KDTREE_OVERLAP';
}
/** A tensor offset is not on the format's alignment. */
export class MisalignedError extends FormatError {
  override readonly code = 'KDTREE_MISALIGNED';
}
/** The same tensor name appears twice (in one file or across the shards of a bundle). */
export class DuplicateTensorError extends FormatError {
  override readonly code = 'KDTREE_DUPLICATE_TENSOR';
}
/** A stored checksum does not match the bytes (preamble, header or tensor data). */
export class ChecksumMismatchError extends FormatError {
  override readonly code = 'KDTREE_CHECKSUM_MISMATCH';
}
/** A tensor name that the bundle does not hold. */
export class TensorNotFoundError extends FormatError {
  override readonly code = 'KDTREE_TENSOR_NOT_FOUND';
}
/** The path names a directory, device, FIFO or socket where a regular file is needed. */
export class NotAFileError extends FormatError {
  override readonly code = 'KDTREE_NOT_A_FILE';
}
/** The operating system failed a read (EIO, a file that cannot be read positionally). */
export class FileReadError extends FormatError {
  override readonly code = 'KDTREE_READ';
}
/**
 * An output that must not be written: it is one of the inputs, or a non-regular file (a device
 * node or FIFO that a rename would replace), or the directory refuses the file.
 */
export class OutputPathError extends FormatError {
  override readonly code = 'KDTREE_OUTPUT_PATH';
}
/** The operating system failed a write to an output (ENOSPC, EIO, EFBIG). */
export class FileWriteError extends FormatError {
  override readonly code = 'KDTREE_WRITE';
}
/** The caller's arguments do not fit (buffer too small, range outside the tensor, bad data length). */
export class UsageError extends FormatError {
  override readonly code = 'KDTREE_USAGE';
}

export function truncate(text: string, max: number): string {
  return text.length <= max ? text : `${text.slice(0, max)}... (${text.length} chars)`;
}
