/**
 * INT4 W4A16 group quantization, bit-compatible with compressed-tensors' `pack-quantized` format
 * (docs/quant/int4.md is the spec).
 *
 *   W [N, K] (out, in), row-major; groups of G along K (G in 32, 64, 128; K % G == 0, K % 8 == 0)
 *   scale[n, g] = fl32(absmax(group) / d), d = 7.5 (minmax) or 7 (absmax7), then cast to the
 *                 storage dtype (bf16: round to nearest even); q = rne(fl32(w / scale)), clamped
 *                 to [-8, 7] (minmax) or [-7, 7] (absmax7)
 *   packed[n, j] (int32) holds elements 8j..8j+7 of row n, element 8j+i in bits 4i..4i+3,
 *                 stored as the nibble q + 8
 *   dequantized w = q * scale
 *
 * All arithmetic is f32 as torch does it: a JavaScript double holding f32 operands, divided and
 * rounded back with Math.fround, is the correctly rounded f32 quotient.
 */
import { bf16ToF32, f32ToBf16 } from '@kdtree/format';
import { GroupShapeError, NonFiniteWeightError, QuantShapeMismatchError } from './errors.js';

export type ScaleRule = 'minmax' | 'absmax7';
export type ScaleDtype = 'BF16' | 'F32';
export const GROUP_SIZES = [32, 64, 128] as const;
export type GroupSize = (typeof GROUP_SIZES)[number];
export const SCALE_RULES: readonly ScaleRule[] = ['minmax', 'absmax7'];

/** torch.finfo(float32).eps: compressed-tensors clamps every scale to at least this. */
export const F32_EPS = 2 ** -23;
/** The scale of an all-zero group: the storage dtype's epsilon (torch.finfo(dtype).eps). */
export const ZERO_GROUP_SCALE: Record<ScaleDtype, number> = { F32: 2 ** -23, BF16: 2 ** -7 };
const MAX_F32 = 3.4028234663852886e38;

export interface RuleConstants {
  divisor: number;
  qmin: number;
  qmax: number;
}

export const RULES: Record<ScaleRule, RuleConstants> = {
  // compressed-tensors' symmetric minmax observer: absmax / ((qmax - qmin) / 2) = absmax / 7.5
  minmax: { divisor: 7.5, qmin: -8, qmax: 7 },
  // the symmetric grid that Kimi K2's quantization-aware training fills: codes in [-7, 7]
  absmax7: { divisor: 7, qmin: -7, qmax: 7 },
};

/** A quantized matrix: packed int32 codes [N, K/8] and scales [N, K/G]. */
export interface Int4Matrix {
  /** N: output features (rows of W). */
  rows: number;
  /** K: input features (columns of W). */
  cols: number;
  groupSize: number;
  scaleDtype: ScaleDtype;
  /** [N, K/8] */
  packed: Int32Array;
  /** [N, K/G]: bf16 bits (Uint16Array) or f32 values (Float32Array) */
  scales: Uint16Array | Float32Array;
}

export interface QuantizeOptions {
  groupSize?: number;
  rule?: ScaleRule;
  scaleDtype?: ScaleDtype;
  /** The tensor's name, for error messages. */
  name?: string;
}

/** Per-tensor dequantization error, accumulated while quantizing. */
export interface ErrorStats {
  maxAbsError: number;
  sumAbsError: number;
  count: number;
}

export function checkInt4Shape(rows: number, cols: number, groupSize: number, name = 'tensor'): void {
  if (!(GROUP_SIZES as readonly number[]).includes(groupSize)) {
    throw new GroupShapeError(`group size ${groupSize} is not supported (use ${GROUP_SIZES.join(', ')})`, { tensor: name });
  }
  if (!Number.isSafeInteger(rows) || !Number.isSafeInteger(cols) || rows <= 0 || cols <= 0) {
    throw new GroupShapeError(`shape [${rows}, ${cols}] must be two positive integers`, { tensor: name });
  }
  if (cols % 8 !== 0) {
    throw new GroupShapeError(`K = ${cols} (shape [${rows}, ${cols}]) is not a multiple of 8, so it cannot pack into int32 words`, { tensor: name });
  }
  if (cols % groupSize !== 0) {
    throw new GroupShapeError(`K = ${cols} (shape [${rows}, ${cols}]) is not a multiple of the group size ${groupSize}`, { tensor: name });
  }
}

const RNE_MAGIC = 6755399441055744; // 1.5 * 2^52

function nonFinite(weights: Float32Array, base: number, end: number, cols: number, name: string): NonFiniteWeightError {
  let i = base;
  while (i < end && Number.isFinite(weights[i])) i++;
  return new NonFiniteWeightError(`weight [${Math.floor(i / cols)}, ${i % cols}] is ${weights[i]}; quantization needs finite weights`, { tensor: name });
}

/** Round half to even, as torch.round and numpy.rint. */
export function roundHalfEven(x: number): number {
  const r = Math.round(x);
  return r - x === 0.5 && (r & 1) !== 0 ? r - 1 : r;
}

/**
 * The scale of one group, as stored (bf16 bits or f32 value) and as the f32 value codes are
 * computed with. `absmax` is the largest |w| of the group.
 */
export function groupScale(absmax: number, rule: ScaleRule, scaleDtype: ScaleDtype): { stored: number; value: number } {
  let s: number;
  if (absmax === 0) s = ZERO_GROUP_SCALE[scaleDtype];
  else s = Math.max(Math.fround(absmax / RULES[rule].divisor), F32_EPS);
  if (scaleDtype === 'BF16') {
    const bits = f32ToBf16(s);
    return { stored: bits, value: bf16ToF32(bits) };
  }
  return { stored: s, value: s };
}

/**
 * Quantizes W [rows, cols] (f32) in groups along cols. Throws GroupShapeError for bad shapes and
 * NonFiniteWeightError naming the row and column of the first NaN/Inf.
 */
export function quantizeInt4(weights: Float32Array, rows: number, cols: number, options: QuantizeOptions = {}, stats?: ErrorStats): Int4Matrix {
  const q = resolveQuantizeOptions(weights, rows, cols, options);
  const packed = new Int32Array((rows * cols) / 8);
  const scales = q.scaleDtype === 'BF16' ? new Uint16Array((rows * cols) / q.groupSize) : new Float32Array((rows * cols) / q.groupSize);
  quantizeRowsInto(weights, 0, rows, cols, q, packed, scales, stats);
  return { rows, cols, groupSize: q.groupSize, scaleDtype: q.scaleDtype, packed, scales };
}

export interface ResolvedQuantizeOptions {
  groupSize: number;
  rule: ScaleRule;
  scaleDtype: ScaleDtype;
  name: string;
}

/** Defaults filled in and every argument checked (shape, group, length) before any work. */
export function resolveQuantizeOptions(weights: Float32Array, rows: number, cols: number, options: QuantizeOptions): ResolvedQuantizeOptions {
  const resolved = { groupSize: options.groupSize ?? 32, rule: options.rule ?? 'minmax', scaleDtype: options.scaleDtype ?? 'BF16', name: options.name ?? 'tensor' } as const;
  checkInt4Shape(rows, cols, resolved.groupSize, resolved.name);
  if (weights.length !== rows * cols) {
    throw new QuantShapeMismatchError(`has ${weights.length} values, shape [${rows}, ${cols}] needs ${rows * cols}`, { tensor: resolved.name });
  }
  return resolved;
}

/**
 * The quantization loop over rows [rowStart, rowEnd): writes their packed words and scales into
 * the full-size `packed` and `scales`. Independent per row, so threads can split the rows.
 */
export function quantizeRowsInto(
  weights: Float32Array,
  rowStart: number,
  rowEnd: number,
  cols: number,
  options: ResolvedQuantizeOptions,
  packed: Int32Array,
  scales: Uint16Array | Float32Array,
  stats?: ErrorStats,
): void {
  const { groupSize, rule, scaleDtype, name } = options;
  const { divisor, qmin, qmax } = RULES[rule];
  const zero = groupScale(0, rule, scaleDtype);
  const bf16 = scaleDtype === 'BF16';
  const first = rowStart * cols;
  const total = rowEnd * cols;
  let maxErr = 0;
  let sumErr = 0;
  for (let base = first, g = first / groupSize; base < total; base += groupSize, g++) {
    const end = base + groupSize;
    let absmax = 0;
    // Math.max propagates NaN, so one check after the loop catches NaN and +-Inf.
    for (let i = base; i < end; i++) absmax = Math.max(absmax, Math.abs(weights[i]));
    if (!(absmax <= MAX_F32)) throw nonFinite(weights, base, end, cols, name);
    let stored: number;
    let s: number;
    if (absmax === 0) {
      stored = zero.stored;
      s = zero.value;
    } else {
      const raw = Math.max(Math.fround(absmax / divisor), F32_EPS);
      if (bf16) {
        stored = f32ToBf16(raw);
        s = bf16ToF32(stored);
      } else {
        stored = raw;
        s = raw;
      }
    }
    scales[g] = stored;
    for (let j = base; j < end; j += 8) {
      let bits = 0;
      for (let i = 0; i < 8; i++) {
        // fl32(w / s), then round half to even: adding and subtracting 1.5 * 2^52 rounds a double
        // to an integer in the FPU's round-to-nearest-even mode (|x| is far below 2^51 here).
        let q = Math.fround(weights[j + i] / s) + RNE_MAGIC - RNE_MAGIC;
        q = q < qmin ? qmin : q > qmax ? qmax : q;
        bits |= (q + 8) << (4 * i);
      }
      packed[j / 8] = bits;
    }
    if (stats) {
      for (let i = base; i < end; i++) {
        const q = ((packed[(i / 8) | 0] >>> (4 * (i & 7))) & 0xf) - 8;
        const err = Math.abs(weights[i] - Math.fround(q * s));
        if (err > maxErr) maxErr = err;
        sumErr += err;
      }
    }
  }
  if (stats) {
    stats.maxAbsError = Math.max(stats.maxAbsError, maxErr);
    stats.sumAbsError += sumErr;
    stats.count += (rowEnd - rowStart) * cols;
  }
}

/** Packs codes q in [-8, 7] (row-major [rows, cols]) into int32 words [rows, cols/8]. */
export function packInt4(codes: Int8Array, rows: number, cols: number): Int32Array {
  if (cols % 8 !== 0) throw new GroupShapeError(`K = ${cols} is not a multiple of 8`);
  if (codes.length !== rows * cols) throw new QuantShapeMismatchError(`${codes.length} codes for shape [${rows}, ${cols}]`);
  const out = new Int32Array(codes.length / 8);
  for (let w = 0; w < out.length; w++) {
    let bits = 0;
    for (let i = 0; i < 8; i++) {
      const q = codes[w * 8 + i];
      if (q < -8 || q > 7) throw new QuantShapeMismatchError(`code ${q} at element ${w * 8 + i} is outside [-8, 7]`);
      bits |= (q + 8) << (4 * i);
    }
    out[w] = bits;
  }
  return out;
}

/** Unpacks int32 words [rows, cols/8] into codes q in [-8, 7], row-major [rows, cols]. */
export function unpackInt4(packed: Int32Array, rows: number, cols: number): Int8Array {
  if (cols % 8 !== 0 || packed.length !== (rows * cols) / 8) {
    throw new QuantShapeMismatchError(`${packed.length} packed words do not hold shape [${rows}, ${cols}] (need ${(rows * cols) / 8})`);
  }
  const out = new Int8Array(rows * cols);
  for (let w = 0; w < packed.length; w++) {
    const bits = packed[w];
    for (let i = 0; i < 8; i++) out[w * 8 + i] = ((bits >>> (4 * i)) & 0xf) - 8;
  }
  return out;
}

/** Scales as f32 values (bf16 widened exactly). */
export function scalesToF32(scales: Uint16Array | Float32Array): Float32Array {
  if (scales instanceof Float32Array) return scales;
  const out = new Float32Array(scales.length);
  for (let i = 0; i < scales.length; i++) out[i] = bf16ToF32(scales[i]);
  return out;
}

/** W' [rows, cols] = q * scale, in f32 (exact for bf16 scales: an 8-bit mantissa times a 4-bit code). */
export function dequantizeInt4(m: Pick<Int4Matrix, 'rows' | 'cols' | 'groupSize' | 'packed' | 'scales'>, out = new Float32Array(m.rows * m.cols)): Float32Array {
  checkInt4Shape(m.rows, m.cols, m.groupSize);
  const groups = m.cols / m.groupSize;
  if (m.packed.length !== (m.rows * m.cols) / 8 || m.scales.length !== m.rows * groups) {
    throw new QuantShapeMismatchError(`packed ${m.packed.length} words / scales ${m.scales.length} do not fit shape [${m.rows}, ${m.cols}] with group ${m.groupSize}`);
  }
  const scales = scalesToF32(m.scales);
  for (let r = 0; r < m.rows; r++) {
    for (let k = 0; k < m.cols; k += 8) {
      const s = scales[r * groups + Math.floor(k / m.groupSize)];
      const bits = m.packed[(r * m.cols + k) / 8];
      for (let i = 0; i < 8; i++) out[r * m.cols + k + i] = Math.fround((((bits >>> (4 * i)) & 0xf) - 8) * s);
    }
  }
  return out;
}

/**
 * GPTQ's `qweight` layout [K/8, N]: the transpose of compressed-tensors' `weight_packed` (each
 * int32 packs 8 consecutive k of one output column). Marlin-style kernels start from this.
 */
export function toGptqQweight(packed: Int32Array, rows: number, cols: number): Int32Array {
  const words = cols / 8;
  if (packed.length !== rows * words) throw new QuantShapeMismatchError(`${packed.length} words for shape [${rows}, ${cols}]`);
  const out = new Int32Array(packed.length);
  for (let n = 0; n < rows; n++) for (let j = 0; j < words; j++) out[j * rows + n] = packed[n * words + j];
  return out;
}

/** Inverse of toGptqQweight. */
export function fromGptqQweight(qweight: Int32Array, rows: number, cols: number): Int32Array {
  const words = cols / 8;
  if (qweight.length !== rows * words) throw new QuantShapeMismatchError(`${qweight.length} words for shape [${rows}, ${cols}]`);
  const out = new Int32Array(qweight.length);
  for (let j = 0; j < words; j++) for (let n = 0; n < rows; n++) out[n * words + j] = qweight[j * rows + n];
  return out;
}
