/**
 * The few dense operations of the forward pass, on row-major f32 buffers with f64 arithmetic
 * (every JavaScript number is a double, so accumulating in f64 costs nothing). Each output row
 * depends only on its own input row, summed in a fixed order: results are batch-invariant.
 */

/**
 * out[M, N] = x[M, K] . w[N, K]^T  (w is nn.Linear.weight: [out, in]). Tiles of 4 rows x 4
 * columns: each loaded x value feeds 4 sums and each w value 4 sums (16 multiply-adds per 8
 * loads). Every output is still one f64 sum over k in order, rounded to f32 once, so the result
 * does not depend on the tiling or on M (batch invariance).
 */
export function matmulT(x: Float32Array, m: number, k: number, w: Float32Array, n: number, out: Float32Array = new Float32Array(m * n)): Float32Array {
  let r = 0;
  for (; r + 4 <= m; r += 4) {
    const x0 = r * k;
    const x1 = x0 + k;
    const x2 = x1 + k;
    const x3 = x2 + k;
    let c = 0;
    for (; c + 4 <= n; c += 4) {
      const w0 = c * k;
      const w1 = w0 + k;
      const w2 = w1 + k;
      const w3 = w2 + k;
      let s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
      let s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;
      for (let i = 0; i < k; i++) {
        const a0 = x[x0 + i];
        const a1 = x[x1 + i];
        const a2 = x[x2 + i];
        const a3 = x[x3 + i];
        const b0 = w[w0 + i];
        const b1 = w[w1 + i];
        const b2 = w[w2 + i];
        const b3 = w[w3 + i];
        s00 += a0 * b0; s01 += a0 * b1; s02 += a0 * b2; s03 += a0 * b3;
        s10 += a1 * b0; s11 += a1 * b1; s12 += a1 * b2; s13 += a1 * b3;
        s20 += a2 * b0; s21 += a2 * b1; s22 += a2 * b2; s23 += a2 * b3;
        s30 += a3 * b0; s31 += a3 * b1; s32 += a3 * b2; s33 += a3 * b3;
      }
      const o = r * n + c;
      out[o] = s00; out[o + 1] = s01; out[o + 2] = s02; out[o + 3] = s03;
      out[o + n] = s10; out[o + n + 1] = s11; out[o + n + 2] = s12; out[o + n + 3] = s13;
      out[o + 2 * n] = s20; out[o + 2 * n + 1] = s21; out[o + 2 * n + 2] = s22; out[o + 2 * n + 3] = s23;
      out[o + 3 * n] = s30; out[o + 3 * n + 1] = s31; out[o + 3 * n + 2] = s32; out[o + 3 * n + 3] = s33;
    }
    for (; c < n; c++) for (let rr = r; rr < r + 4; rr++) out[rr * n + c] = dot(x, rr * k, w, c * k, k);
  }
  for (; r < m; r++) matvecRow(x, r * k, k, w, n, out, r * n);
  return out;
}

function dot(x: Float32Array, xo: number, w: Float32Array, wo: number, k: number): number {
  let s = 0;
  for (let i = 0; i < k; i++) s += x[xo + i] * w[wo + i];
  return s;
}

/** One row against every column, 4 columns at a time (the decode shape, M = 1). */
function matvecRow(x: Float32Array, xo: number, k: number, w: Float32Array, n: number, out: Float32Array, oo: number): void {
  let c = 0;
  for (; c + 4 <= n; c += 4) {
    const w0 = c * k;
    const w1 = w0 + k;
    const w2 = w1 + k;
    const w3 = w2 + k;
    let s0 = 0;
    let s1 = 0;
    let s2 = 0;
    let s3 = 0;
    for (let i = 0; i < k; i++) {
      const xv = x[xo + i];
      s0 += xv * w[w0 + i];
      s1 += xv * w[w1 + i];
      s2 += xv * w[w2 + i];
      s3 += xv * w[w3 + i];
    }
    out[oo + c] = s0;
    out[oo + c + 1] = s1;
    out[oo + c + 2] = s2;
    out[oo + c + 3] = s3;
  }
  for (; c < n; c++) out[oo + c] = dot(x, xo, w, c * k, k);
}

/** RMSNorm per row: x * rsqrt(mean(x^2) + eps) * weight. */
export function rmsNorm(x: Float32Array, rows: number, dim: number, weight: Float32Array, eps: number, out: Float32Array = new Float32Array(rows * dim), inOffset = 0, inStride = dim): Float32Array {
  for (let r = 0; r < rows; r++) {
    const o = inOffset + r * inStride;
    let ss = 0;
    for (let i = 0; i < dim; i++) ss += x[o + i] * x[o + i];
    const inv = 1 / Math.sqrt(ss / dim + eps);
    for (let i = 0; i < dim; i++) out[r * dim + i] = x[o + i] * inv * weight[i];
  }
  return out;
}

export function silu(x: number): number {
  return x / (1 + Math.exp(-x));
}

export function sigmoid(x: number): number {
  return 1 / (1 + Math.exp(-x));
}

/** Index of the largest value; the lowest index wins ties (as torch.argmax). */
export function argmax(values: Float32Array, offset = 0, length = values.length - offset): number {
  let best = 0;
  let bestValue = -Infinity;
  for (let i = 0; i < length; i++) {
    const v = values[offset + i];
    if (v > bestValue) {
      bestValue = v;
      best = i;
    }
  }
  return best;
}

/** Top-2 margin (largest minus second largest) of one row: how robust an argmax is to rounding. */
export function top2Margin(values: Float32Array, offset = 0, length = values.length - offset): number {
  let a = -Infinity;
  let b = -Infinity;
  for (let i = 0; i < length; i++) {
    const v = values[offset + i];
    if (v > a) {
      b = a;
      a = v;
    } else if (v > b) b = v;
  }
  return a - b;
}
