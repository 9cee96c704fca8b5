/**
 * The dtype table shared by KDTR, safetensors and .npy. Names follow safetensors so that import
 * and export keep dtypes verbatim.
 */
import { UnknownDtypeError, type ErrorFormat } from './errors.js';

export const DTYPE_SIZES = {
  F64: 8,
  F32: 4,
  F16: 2,
  BF16: 2,
  I64: 8,
  I32: 4,
  I16: 2,
  I8: 1,
  U64: 8,
  U32: 4,
  U16: 2,
  U8: 1,
  BOOL: 1,
  F8_E4M3: 1,
  F8_E5M2: 1,
} as const;

export type Dtype = keyof typeof DTYPE_SIZES;
export const DTYPES = Object.keys(DTYPE_SIZES) as Dtype[];

export function isDtype(name: unknown): name is Dtype {
  return typeof name === 'string' && Object.prototype.hasOwnProperty.call(DTYPE_SIZES, name);
}

export function dtypeSize(dtype: Dtype): number {
  return DTYPE_SIZES[dtype];
}

export function checkDtype(
  name: unknown,
  where: { file: string; tensor?: string; format?: ErrorFormat },
): Dtype {
  if (isDtype(name)) return name;
  throw new UnknownDtypeError('unknown dtype', {
    ...where,
    field: 'dtype',
    expected: `one of ${DTYPES.join(' ')}`,
    actual: JSON.stringify(name),
  });
}

/** Element count of a shape; `undefined` when it is not a safe integer (a hostile header). */
export function elementCount(shape: readonly number[]): number | undefined {
  // A zero dimension makes the product 0 whatever the other factors (valid: [0, 2^52, 2^52]).
  if (shape.includes(0)) return 0;
  let n = 1;
  for (const d of shape) {
    n *= d;
    if (!Number.isSafeInteger(n)) return undefined;
  }
  return n;
}

export type TypedArrayFor<D extends Dtype> = D extends 'F64'
  ? Float64Array
  : D extends 'F32'
    ? Float32Array
    : D extends 'I64'
      ? BigInt64Array
      : D extends 'U64'
        ? BigUint64Array
        : D extends 'I32'
          ? Int32Array
          : D extends 'U32'
            ? Uint32Array
            : D extends 'I16'
              ? Int16Array
              : D extends 'F16' | 'BF16' | 'U16'
                ? Uint16Array
                : D extends 'I8'
                  ? Int8Array
                  : Uint8Array;

export type AnyTypedArray =
  | Float64Array
  | Float32Array
  | BigInt64Array
  | BigUint64Array
  | Int32Array
  | Uint32Array
  | Int16Array
  | Uint16Array
  | Int8Array
  | Uint8Array;

/**
 * A typed-array view over little-endian tensor bytes (no copy when the bytes are aligned for the
 * element type; a copy otherwise). F16 and BF16 come back as raw Uint16 bits: see half.ts.
 */
export function typedView<D extends Dtype>(dtype: D, bytes: Uint8Array): TypedArrayFor<D> {
  const size = DTYPE_SIZES[dtype];
  const aligned = bytes.byteOffset % size === 0 ? bytes : bytes.slice();
  const { buffer, byteOffset } = aligned;
  const n = bytes.byteLength / size;
  const ctor = typedArrayConstructor(dtype);
  return new ctor(buffer as ArrayBuffer, byteOffset, n) as TypedArrayFor<D>;
}

function typedArrayConstructor(dtype: Dtype) {
  switch (dtype) {
    case 'F64':
      return Float64Array;
    case 'F32':
      return Float32Array;
    case 'I64':
      return BigInt64Array;
    case 'U64':
      return BigUint64Array;
    case 'I32':
      return Int32Array;
    case 'U32':
      return Uint32Array;
    case 'I16':
      return Int16Array;
    case 'F16':
    case 'BF16':
    case 'U16':
      return Uint16Array;
    case 'I8':
      return Int8Array;
    default:
      return Uint8Array;
  }
}

/** The bytes behind a typed array, without a copy. */
export function bytesOf(view: ArrayBufferView): Uint8Array {
  return new Uint8Array(view.buffer, view.byteOffset, view.byteLength);
}
