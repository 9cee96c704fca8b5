/**
 * Error bounds of the GEMM checks (W4A16, MoE, the SiLU epilogue, the GEMM on 16-bit weights),
 * derived from what the reference models and what it leaves out.
 *
 * The reference multiplies x rounded to x's dtype by the weights as the kernel sees them
 * (dequantized exactly: q * scale; or the bf16/f16 values), accumulating in f64. So it models the
 * kernel's inputs exactly, and its products too: a bf16 or f16 x times an int4 code, or a bf16
 * times a bf16 (16 significant bits), is exact in f32; an f32 x is split into three bf16 planes
 * that sum back to x to within f32 rounding. What it leaves out:
 *  1. the kernel's f32 accumulation, in its own order: each sum, scale multiply and range merge
 *     rounds once. Rounding errors of random sign grow as sqrt(k) over k terms, so an element of
 *     y may differ by c sqrt(k) u32 times sum_k |x_k w_k| (u32 = 2^-24; c = 4 for margin). The
 *     deterministic bound (k u32 instead of sqrt(k)) would be sqrt(k) times looser and let a
 *     wrong range order through at k = 18432.
 *  2. rounding y to its dtype: at most u(y) |y| (round to nearest even).
 * Each element is checked against its own bound, so a zeroed weight row (one column of y) or a
 * dropped token row fails however many other elements are right.
 */
import type { Dtype } from '../backend.js';
import { fail } from './harness.js';

/** The largest relative error of rounding to `dtype` (round to nearest even): half its epsilon. */
export function unitRoundoff(dtype: Dtype): number {
  if (dtype === 'f32') return 2 ** -24;
  if (dtype === 'bf16') return 2 ** -8;
  if (dtype === 'f16') return 2 ** -11;
  if (dtype === 'f64') return 2 ** -53;
  return 0;
}

/** Margin over the expected size of a random-sign rounding walk (see the module comment). */
const WALK_MARGIN = 4;

export interface ErrorBound {
  /** Allowed error relative to |ref| (rounding the output to its dtype). */
  rel: number;
  /** Allowed error relative to the element's magnitude, sum_k |x_k w_k| (the f32 accumulation). */
  acc: number;
}

/**
 * The bound of a GEMM of inner dimension `k` writing `y`: an f32 x rounds once more per product
 * (its three bf16 planes), so its walk has twice the terms.
 */
export function gemmBound(xDtype: Dtype, yDtype: Dtype, k: number): ErrorBound {
  const terms = xDtype === 'f32' ? 2 * k : k;
  // the reference's own f32 result rounds once more
  return { rel: unitRoundoff(yDtype) + unitRoundoff('f32'), acc: WALK_MARGIN * Math.sqrt(terms) * unitRoundoff('f32') };
}

/**
 * Every element of `out` ([rows, cols], row-major) within `allowed(i)` of `ref[i]`; fails naming
 * the first element outside it (its row and column, the values and the bound). Returns a detail
 * with the worst ratio of error to bound and the relative L2 error of the whole.
 */
export function expectWithin(what: string, out: ArrayLike<number>, ref: ArrayLike<number>, cols: number, allowed: (i: number) => number): string {
  if (out.length !== ref.length) fail(`${what}: length ${out.length}, reference ${ref.length}`);
  let worst = 0;
  let num = 0;
  let den = 0;
  for (let i = 0; i < ref.length; i++) {
    const err = Math.abs(out[i] - ref[i]);
    const bound = allowed(i);
    if (!(err <= bound)) {
      fail(`${what}: element [${Math.floor(i / cols)}, ${i % cols}] is ${out[i]}, reference ${ref[i]} (error ${err.toExponential(2)} > bound ${bound.toExponential(2)})`);
    }
    if (bound > 0) worst = Math.max(worst, err / bound);
    num += err * err;
    den += ref[i] * ref[i];
  }
  return `${what}: worst ${worst.toFixed(2)} of the bound, rel ${(Math.sqrt(num) / Math.max(Math.sqrt(den), 1e-30)).toExponential(1)}`;
}

/** expectWithin for a GEMM's y against `ref`, with `magnitude` = sum_k |x_k w_k| per element. */
export function expectGemmClose(what: string, out: ArrayLike<number>, ref: ArrayLike<number>, magnitude: ArrayLike<number>, cols: number, bound: ErrorBound): string {
  return expectWithin(what, out, ref, cols, (i) => bound.rel * Math.abs(ref[i]) + bound.acc * magnitude[i]);
}

/**
 * The bound of y = silu(gate) * up where gate and up are GEMM outputs, each rounded to y's dtype
 * before the product (the epilogue's order), then the product rounded: first order in each
 * rounding and in each accumulation error,
 *   |silu'(g) up| (u |g| + a mag_g) + |silu(g)| (u |up| + a mag_up) + u |y| + e |y|
 * with u = u(y), a = the accumulation bound, and e the f32 evaluation of silu (expf, a division,
 * two products: 16 u32, several times what they can lose).
 */
export function siluMulAllowed(bound: ErrorBound, gate: number, up: number, magGate: number, magUp: number): number {
  const sig = 1 / (1 + Math.exp(-gate));
  const silu = gate * sig;
  const dsilu = sig * (1 + gate * (1 - sig));
  const y = Math.abs(silu * up);
  return Math.abs(dsilu * up) * (bound.rel * Math.abs(gate) + bound.acc * magGate) + Math.abs(silu) * (bound.rel * Math.abs(up) + bound.acc * magUp) + bound.rel * y + 16 * unitRoundoff('f32') * y;
}
