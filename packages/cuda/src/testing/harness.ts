/**
 * The kernel suite's harness: checks are plain functions over a backend, so the same suite runs
 * under vitest on the cpu variant (CI) and in the bundled GPU self-test on the cuda variant
 * (tools/gpu/selftest.ts), as ggml's backend-ops test runs every op on every backend.
 */
import { SeededRandom } from '@kdtree/reference';
import type { KdtreeBackend } from '../backend.js';
import { isNativeError } from '../errors.js';
import type { ForcedForms } from '../native-types.js';

export interface CheckResult {
  /** e.g. "rel 3.1e-7 <= 1e-5" */
  detail?: string;
}

export interface KernelCheck {
  name: string;
  run(backend: KdtreeBackend): CheckResult | void;
}

export class CheckFailure extends Error {
  override name = 'CheckFailure';
}

export function fail(message: string): never {
  throw new CheckFailure(message);
}

export function rng(seed: number): SeededRandom {
  return new SeededRandom(seed);
}

export function randomF32(n: number, seed: number, scale = 1): Float32Array {
  const r = rng(seed);
  return Float32Array.from({ length: n }, () => scale * r.normal());
}

/** ||out - ref|| / ||ref|| (2-norms, f64). */
export function relError(out: ArrayLike<number>, ref: ArrayLike<number>): number {
  if (out.length !== ref.length) fail(`length ${out.length} vs reference ${ref.length}`);
  let num = 0;
  let den = 0;
  for (let i = 0; i < ref.length; i++) {
    const d = out[i] - ref[i];
    if (Number.isNaN(out[i])) return Number.POSITIVE_INFINITY;
    num += d * d;
    den += ref[i] * ref[i];
  }
  return Math.sqrt(num) / Math.max(Math.sqrt(den), 1e-30);
}

/**
 * Each row of `rowLength` elements within `tolerance` relative error of the reference's row (one
 * wrong row fails however many others are right); returns the worst row's error. The GEMM checks
 * bound each element instead (tolerance.ts).
 */
export function expectClose(what: string, out: ArrayLike<number>, ref: ArrayLike<number>, tolerance: number, rowLength: number): string {
  if (out.length !== ref.length) fail(`${what}: length ${out.length} vs reference ${ref.length}`);
  if (!(rowLength > 0) || ref.length % rowLength !== 0) fail(`${what}: ${ref.length} values are not rows of ${rowLength}`);
  let worst = 0;
  for (let r = 0; r < ref.length / rowLength; r++) {
    const at = r * rowLength;
    const e = relError(Array.prototype.slice.call(out, at, at + rowLength) as number[], Array.prototype.slice.call(ref, at, at + rowLength) as number[]);
    if (!(e <= tolerance)) fail(`${what}: row ${r} has relative error ${e.toExponential(2)} > ${tolerance}`);
    worst = Math.max(worst, e);
  }
  return `${what}: worst row rel ${worst.toExponential(1)}`;
}

export function expectEqual<T>(what: string, got: ArrayLike<T>, want: ArrayLike<T>): void {
  if (got.length !== want.length) fail(`${what}: length ${got.length}, expected ${want.length}`);
  for (let i = 0; i < want.length; i++) {
    if (!Object.is(got[i], want[i])) fail(`${what}: element ${i} is ${String(got[i])}, expected ${String(want[i])}`);
  }
}

export function sameBits(a: ArrayBufferView, b: ArrayBufferView): boolean {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength));
}

/** Runs fn and requires a native error whose message matches `pattern`. */
export function expectThrows(what: string, fn: () => void, pattern: RegExp): void {
  try {
    fn();
  } catch (error) {
    const message = (error as Error).message;
    if (!isNativeError(error)) fail(`${what}: threw something other than a native error (${String((error as { code?: unknown }).code)}): ${message}`);
    if (!pattern.test(message)) fail(`${what}: message '${message}' does not match ${pattern}`);
    return;
  }
  fail(`${what}: did not throw`);
}

/** Runs `fn` with a fresh set of tensors freed afterwards. */
export function withTensors<T>(backend: KdtreeBackend, fn: (track: <U extends { buffer: { freed: boolean } }>(t: U) => U) => T): T {
  const tracked: { buffer: { freed: boolean } }[] = [];
  try {
    return fn((t) => {
      tracked.push(t);
      return t;
    });
  } finally {
    for (const t of tracked) if (!t.buffer.freed) backend.native.free(t.buffer as never);
  }
}

/**
 * Runs `fn` with kernel forms forced on the backend (setForcedForms), then restores the previous
 * setting. On cuda the last gemm / w4a16Gemm / moeGemm call of `fn` must have run the forced form
 * (lastForm: the gemm form forced, or 'prefill' for w4a16Prefill 'always'), so a check named for
 * a form fails where another form ran; `expectForm: false` for calls expected to throw.
 */
export function withForcedForms<T>(b: KdtreeBackend, forms: ForcedForms, fn: () => T, { expectForm = true } = {}): T {
  const previous = b.native.setForcedForms(forms);
  try {
    const result = fn();
    const expected = forms.gemm ?? (forms.w4a16Prefill === 'always' ? 'prefill' : undefined);
    const ran = b.native.lastForm();
    if (expectForm && b.kind === 'cuda' && expected !== undefined && ran !== expected) fail(`forced the ${expected} form, but the last call ran ${ran ?? 'nothing'}`);
    return result;
  } finally {
    b.native.setForcedForms(previous);
  }
}
