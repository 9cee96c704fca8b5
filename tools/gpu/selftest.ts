/**
 * The kernel suite on a GPU host: every check of packages/cuda/src/testing on the cuda variant
 * and on the C++ twin, in one process. Bundled by bundle.mjs into .gpu/selftest.mjs, next to the
 * addon binaries; run there with the carried Node:
 *   xz -dc .gpu/node.xz > /tmp/node && chmod +x /tmp/node && /tmp/node .gpu/selftest.mjs
 * Writes $OUT/selftest.json when OUT is set; exits 1 if any check fails. KDTREE_SELFTEST_ONLY=<regex>
 * runs only the checks whose name matches (a quick run of the kernel under work).
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend } from '../../packages/cuda/src/backend.js';
import { ALL_CHECKS } from '../../packages/cuda/src/testing/index.js';

const here = dirname(fileURLToPath(import.meta.url));
const results: { backend: string; check: string; ok: boolean; ms: number; detail: string }[] = [];
for (const kind of (process.env.KDTREE_SELFTEST_BACKENDS ?? 'cuda,cpu').split(',') as ('cuda' | 'cpu')[]) {
  const backend = createBackend({ backend: kind, searchPaths: [here], onlySearchPaths: true, log: (l) => console.log(l) });
  const info = backend.info();
  console.log(`\n== ${kind}: ${info.name} (compute ${info.computeCapability}, ${info.multiprocessors} SMs, driver ${info.driverVersion}, runtime ${info.runtimeVersion})`);
  const only = process.env.KDTREE_SELFTEST_ONLY ? new RegExp(process.env.KDTREE_SELFTEST_ONLY) : undefined;
  for (const check of ALL_CHECKS.filter((c) => !only || only.test(c.name))) {
    const t = performance.now();
    let ok = true;
    let detail = '';
    try {
      detail = check.run(backend)?.detail ?? '';
      backend.synchronize();
    } catch (error) {
      ok = false;
      detail = (error as Error).message;
    }
    const ms = performance.now() - t;
    results.push({ backend: kind, check: check.name, ok, ms, detail });
    console.log(`${ok ? 'PASS' : 'FAIL'} ${kind} ${check.name} (${ms.toFixed(0)} ms)${detail ? `\n     ${detail}` : ''}`);
  }
}
const failed = results.filter((r) => !r.ok).length;
console.log(`\n${results.length - failed} passed, ${failed} failed`);
if (process.env.OUT) {
  mkdirSync(process.env.OUT, { recursive: true });
  writeFileSync(join(process.env.OUT, 'selftest.json'), `${JSON.stringify(results, null, 1)}\n`);
}
process.exitCode = failed ? 1 : 0;
