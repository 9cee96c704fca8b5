/**
 * The kernel suite on this machine's backend: the cpu variant in CI (KDTREE_BACKEND=cpu by
 * default here), the cuda variant where the environment asks for it. The GPU self-test
 * (tools/gpu/selftest.ts) runs the same checks on an H200.
 */
import { afterAll, describe, it } from 'vitest';
import { createBackend } from './backend.js';
import { ALL_CHECKS } from './testing/index.js';

const backend = createBackend({ backend: (process.env.KDTREE_TEST_BACKEND as 'cpu' | 'cuda' | 'auto' | undefined) ?? 'cpu' });
afterAll(() => backend.synchronize());

describe(`kernel suite on the ${backend.kind} backend`, () => {
  for (const check of ALL_CHECKS) it(check.name, () => void check.run(backend));
});
