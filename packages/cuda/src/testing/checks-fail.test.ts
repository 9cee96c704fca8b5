/**
 * The GEMM checks must fail on a kernel that gets one output column wrong: here a backend whose
 * packing zeroes the scales of one weight row (y[:, row] = 0 for every token), which the
 * relative L2 error over a whole output (1 / sqrt(N) = 0.0083 at N = 14496) could not see
 * beside a 1e-2 tolerance.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { createBackend, KdtreeBackend, type DeviceTensor, type PackedW4A16 } from '../backend.js';
import { EPILOGUE_CHECKS } from './epilogue-checks.js';
import { FLOAT_GEMM_CHECKS } from './float-gemm-checks.js';
import { GEMM_CHECKS } from './gemm-checks.js';
import { CheckFailure, type KernelCheck } from './harness.js';
import { expectGemmClose, expectWithin, gemmBound, unitRoundoff } from './tolerance.js';

const backend = createBackend({ backend: 'cpu' });
afterAll(() => backend.synchronize());

/** A backend whose packW4A16 zeroes the scales of checkpoint row `row` (of the first matrix) before packing. */
class ZeroedRowBackend extends KdtreeBackend {
  constructor(
    base: KdtreeBackend,
    readonly row: number,
  ) {
    super(base.loaded);
  }

  override packW4A16(qw: DeviceTensor, sc: DeviceTensor, group: number, stream?: number, options: { interleaveGateUp?: boolean } = {}): PackedW4A16 {
    const scales = this.toArray(sc);
    const perRow = sc.shape[sc.shape.length - 1];
    scales.fill(0, this.row * perRow, (this.row + 1) * perRow);
    const zeroed = this.fromArray(sc.dtype, sc.shape, scales);
    try {
      return super.packW4A16(qw, zeroed, group, stream, options);
    } finally {
      this.free(zeroed);
    }
  }
}

function check(list: KernelCheck[], nameHas: string): KernelCheck {
  const found = list.find((c) => c.name.includes(nameHas));
  if (!found) throw new Error(`no check named with '${nameHas}'`);
  return found;
}

describe('the GEMM checks fail on one wrong output column', () => {
  it('the stream-K check over N = 14496 fails with weight row 4321 zeroed, naming the element', () => {
    const streamK = check(GEMM_CHECKS, 'N 14496 x K 896');
    expect(() => streamK.run(new ZeroedRowBackend(backend, 4321))).toThrow(CheckFailure);
    expect(() => streamK.run(new ZeroedRowBackend(backend, 4321))).toThrow(/element \[0, 4321\]/);
    expect(streamK.run(backend)?.detail).toMatch(/of the bound/);
  });

  it('the bf16-output W4A16 check, the MoE check and the SiLU epilogue check fail with one zeroed row', () => {
    const zeroed = new ZeroedRowBackend(backend, 7);
    expect(() => check(GEMM_CHECKS, 'w4a16_gemm x bf16, scales bf16, y bf16').run(zeroed)).toThrow(/element \[\d+, 7\]/);
    expect(() => check(GEMM_CHECKS, 'moe_gemm x bf16, K 96: gather').run(zeroed)).toThrow(CheckFailure);
    // packed with interleaveGateUp, checkpoint row 7 is gate row 7: y[:, 7] = silu(0) * up = 0
    expect(() => check(EPILOGUE_CHECKS, 'w4a16_gemm siluMul epilogue: I 100').run(zeroed)).toThrow(/element \[\d+, 7\]/);
  });

  it('every GEMM check still passes on the cpu backend', () => {
    for (const c of [check(GEMM_CHECKS, 'w4a16_gemm x f32, scales bf16, y f32'), check(FLOAT_GEMM_CHECKS, 'gemm w bf16, x bf16, y bf16')]) expect(() => c.run(backend)).not.toThrow();
  });
});

describe('error bounds', () => {
  it('are the rounding of the output dtype plus a sqrt(k) walk of f32 roundings', () => {
    expect(unitRoundoff('bf16')).toBe(2 ** -8);
    expect(unitRoundoff('f16')).toBe(2 ** -11);
    const b = gemmBound('bf16', 'f32', 896);
    expect(b.rel).toBe(2 * 2 ** -24);
    expect(b.acc).toBeCloseTo(4 * Math.sqrt(896) * 2 ** -24, 20);
    expect(gemmBound('f32', 'f32', 896).acc).toBeCloseTo(4 * Math.sqrt(2 * 896) * 2 ** -24, 20);
  });

  it('fail on one element past its bound and pass on elements within it, naming row and column', () => {
    const ref = Float32Array.of(1, 2, 3, 4, 5, 6);
    const magnitude = Float32Array.of(1, 2, 3, 4, 5, 6);
    const bound = gemmBound('bf16', 'bf16', 16);
    const within = ref.map((v) => v * (1 + 2 ** -9));
    expect(expectGemmClose('y', within, ref, magnitude, 3, bound)).toMatch(/^y: worst 0\.\d\d of the bound/);
    const off = ref.slice();
    off[4] = 5 * (1 + 2 ** -6);
    expect(() => expectGemmClose('y', off, ref, magnitude, 3, bound)).toThrow(/y: element \[1, 1\] is 5\.07/);
    expect(() => expectWithin('y', Float32Array.of(Number.NaN), Float32Array.of(1), 1, () => 1)).toThrow(/element \[0, 0\] is NaN/);
  });
});
