/**
 * bf16 and f16 <-> f32 conversions with round-to-nearest-even, bit-exact with torch's casts.
 * Half values travel as raw Uint16 bits, since JavaScript has no 16-bit float array in Node 20.
 */

const f32Scratch = new Float32Array(1);
const u32Scratch = new Uint32Array(f32Scratch.buffer);

/** f32 bits -> bf16 bits, round to nearest even; NaN stays a quiet NaN with its sign. */
function bf16FromBits(u: number): number {
  if ((u & 0x7fffffff) > 0x7f800000) return ((u >>> 16) | 0x0040) & 0xffff;
  return ((u + 0x7fff + ((u >>> 16) & 1)) >>> 16) & 0xffff;
}

export function f32ToBf16(value: number): number {
  f32Scratch[0] = value;
  return bf16FromBits(u32Scratch[0]);
}

export function bf16ToF32(bits: number): number {
  u32Scratch[0] = (bits & 0xffff) << 16;
  return f32Scratch[0];
}

/** f32 bits -> f16 bits, round to nearest even, with subnormals; overflow gives +-Inf. */
function f16FromBits(u: number): number {
  const sign = (u >>> 16) & 0x8000;
  const abs = u & 0x7fffffff;
  if (abs >= 0x7f800000) return sign | (abs > 0x7f800000 ? 0x7e00 : 0x7c00);
  if (abs >= 0x477ff000) return sign | 0x7c00; // >= 65520 rounds past the largest finite half
  if (abs < 0x38800000) {
    // Below 2^-14: a subnormal half. Scale the exact f32 value by 2^24 and round half to even.
    u32Scratch[0] = abs;
    const m = f32Scratch[0] * 16777216;
    let r = Math.floor(m);
    const frac = m - r;
    if (frac > 0.5 || (frac === 0.5 && (r & 1) === 1)) r += 1;
    return sign | r;
  }
  const exponent = (abs >>> 23) - 127 + 15;
  const mantissa = abs & 0x7fffff;
  let half = (exponent << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1) === 1)) half += 1;
  return sign | half;
}

export function f32ToF16(value: number): number {
  f32Scratch[0] = value;
  return f16FromBits(u32Scratch[0]);
}

export function f16ToF32(bits: number): number {
  const sign = (bits & 0x8000) << 16;
  const exponent = (bits >>> 10) & 0x1f;
  const mantissa = bits & 0x3ff;
  if (exponent === 0) {
    const magnitude = mantissa * 2 ** -24; // exact: subnormal halves are normal f32 values
    return sign ? -magnitude : magnitude;
  }
  if (exponent === 0x1f) u32Scratch[0] = sign | 0x7f800000 | (mantissa << 13);
  else u32Scratch[0] = sign | ((exponent - 15 + 127) << 23) | (mantissa << 13);
  return f32Scratch[0];
}

function u32ViewOf(values: Float32Array): Uint32Array {
  return new Uint32Array(values.buffer, values.byteOffset, values.length);
}

/** Float32Array -> bf16 bits. */
export function f32ArrayToBf16(values: Float32Array, out: Uint16Array = new Uint16Array(values.length)): Uint16Array {
  const bits = u32ViewOf(values);
  for (let i = 0; i < bits.length; i++) out[i] = bf16FromBits(bits[i]);
  return out;
}

/** bf16 bits -> Float32Array (exact). */
export function bf16ArrayToF32(bits: Uint16Array, out: Float32Array = new Float32Array(bits.length)): Float32Array {
  const outBits = u32ViewOf(out);
  for (let i = 0; i < bits.length; i++) outBits[i] = bits[i] << 16;
  return out;
}

/** Float32Array -> f16 bits. */
export function f32ArrayToF16(values: Float32Array, out: Uint16Array = new Uint16Array(values.length)): Uint16Array {
  const bits = u32ViewOf(values);
  for (let i = 0; i < bits.length; i++) out[i] = f16FromBits(bits[i]);
  return out;
}

/** f16 bits -> Float32Array (exact). */
export function f16ArrayToF32(bits: Uint16Array, out: Float32Array = new Float32Array(bits.length)): Float32Array {
  for (let i = 0; i < bits.length; i++) out[i] = f16ToF32(bits[i]);
  return out;
}
