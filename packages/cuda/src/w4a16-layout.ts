/**
 * Shapes of the packed W4A16 layout the GEMM kernels read (native/include/kdtree/w4a16_layout.h
 * has the element order). Checkpoint weights (qw [N, K/8] int32, sc [N, K/G]) are packed once at
 * load time with `KdtreeBackend.packW4A16`; rows and k are padded to 16 and 128.
 */
export const W4A16_LAYOUT_VERSION = 2;

export interface PackedW4A16Shapes {
  /** i32 [(E,) ceil(N/16), ceil(K/128), 256] */
  qw: number[];
  /** the scales' dtype, [(E,) ceil(N/16), ceil(ceil(K/128) * 128/G / 4), 64] */
  sc: number[];
}

export function packedW4A16Shapes(n: number, k: number, group: number, experts?: number): PackedW4A16Shapes {
  const tiles = Math.ceil(n / 16);
  const steps = Math.ceil(k / 128);
  const blocks = Math.ceil((steps * (128 / group)) / 4);
  const lead = experts === undefined ? [] : [experts];
  return { qw: [...lead, tiles, steps, 256], sc: [...lead, tiles, blocks, 64] };
}
