/**
 * turbo runs tasks with only the environment variables turbo.json declares, so a variable this
 * package's build, tests or native code read but turbo.json lacks is silently unset under
 * `npm test` (KDTREE_TEST_BACKEND=cuda would run the cpu suite).
 */
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';

const root = fileURLToPath(new URL('../../..', import.meta.url));

function files(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    return statSync(p).isDirectory() ? files(p) : [p];
  });
}

it("every KDTREE_ variable the package, its build and the native code read is in turbo.json's globalEnv", () => {
  const read = new Set<string>();
  for (const dir of ['packages/cuda/src', 'packages/cuda/scripts', 'native/src']) {
    for (const file of files(join(root, dir))) {
      for (const m of readFileSync(file, 'utf8').matchAll(/\benv\.(KDTREE_[A-Z0-9_]+)|getenv\("(KDTREE_[A-Z0-9_]+)"\)/g)) read.add(m[1] ?? m[2]);
    }
  }
  expect([...read]).toEqual(expect.arrayContaining(['KDTREE_TEST_BACKEND', 'KDTREE_GEMM_FORM', 'KDTREE_W4A16_PREFILL', 'KDTREE_CUDA']));
  const globalEnv: string[] = JSON.parse(readFileSync(join(root, 'turbo.json'), 'utf8')).globalEnv;
  expect([...read].filter((name) => !globalEnv.includes(name))).toEqual([]);
});
