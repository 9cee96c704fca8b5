import { describe, expect, it } from 'vitest';
import { createBackend } from './backend.js';
import { AddonLoadError, isNativeError, NATIVE_ERROR_CODES } from './errors.js';

describe('isNativeError', () => {
  it("is true for an op's error", () => {
    const b = createBackend({ backend: 'cpu' });
    let thrown: unknown;
    try {
      b.native.w4a16Gemm({ x: b.zeros('bf16', [3, 64]), qw: b.zeros('i32', [1, 1, 256]), sc: b.zeros('bf16', [1, 1, 64]), y: b.zeros('f32', [3, 16]), group: 48 });
    } catch (error) {
      thrown = error;
    }
    expect(isNativeError(thrown)).toBe(true);
    expect(NATIVE_ERROR_CODES).toContain((thrown as { code: string }).code);
  });

  it('is false for a load error, other KDTREE_ codes, plain errors and non-errors', () => {
    expect(isNativeError(new AddonLoadError('linux-x64', 'cuda', []))).toBe(false);
    expect(isNativeError(Object.assign(new Error('x'), { code: 'KDTREE_BAD_BUNDLE' }))).toBe(false);
    expect(isNativeError(new Error('x'))).toBe(false);
    expect(isNativeError({ code: 'KDTREE_INVALID_ARGUMENT', message: 'not an Error' })).toBe(false);
    expect(isNativeError(Object.assign(new Error('x'), { code: 'KDTREE_UNSUPPORTED' }))).toBe(true);
  });
});
