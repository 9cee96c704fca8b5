/**
 * The kernel suite on a GPU host: every check of packages/cuda/src/testing on the cuda variant
 * and on the C++ twin, in one process. Bundled by bundle.mjs into .gpu/selftest.mjs, next to the
 * addon binaries; run there with the carried Node:
 *   xz -dc .gpu/node.xz > /tmp/node && chmod +x /tmp/node && /tmp/node .gpu/selftest.mjs
 * Writes $OUT/selftest.json when OUT is set; exits 1 if any check fails. KDTREE_SELFTEST_ONLY=<regex>
 * runs only the checks whose name matches (a quick run of the kernel under work).
 *
 * Before the cuda checks it builds and runs wgmma_equiv.cu (beside this file, nvcc on the GPU
 * host): the W4A16 and gemm warpgroup kernels give the stream-K kernels' bits only if wgmma rounds
 * chained k16 sums as mma.sync does on this device. Where it does not (or cannot be checked), the
 * batch-invariance checks would fail for a reason they cannot name, so the self-test stops there.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend } from '../../packages/cuda/src/backend.js';
import { ALL_CHECKS } from '../../packages/cuda/src/testing/index.js';

const here = dirname(fileURLToPath(import.meta.url));

/** The precondition: why wgmma's rounding could not be shown equal to mma.sync's, or undefined. */
function wgmmaEquivProblem(): string | undefined {
  const source = join(here, 'wgmma_equiv.cu');
  if (!existsSync(source)) return `${source} is missing: build the payload with node tools/gpu/bundle.mjs`;
  const binary = join(process.env.TMPDIR ?? '/tmp', 'kdtree_wgmma_equiv');
  const build = spawnSync('nvcc', ['-O3', '-std=c++17', '-gencode=arch=compute_90a,code=sm_90a', source, '-o', binary], { encoding: 'utf8' });
  if (build.error) return `nvcc could not be run (${build.error.message}); the GPU host needs the CUDA compiler on PATH for this check`;
  if (build.status !== 0) return `nvcc failed to build ${source} (exit ${build.status}):\n${build.stderr.trim()}`;
  const run = spawnSync(binary, ['1024'], { encoding: 'utf8' }); // 1024 trials per block, as the recorded table
  if (process.env.OUT) {
    mkdirSync(process.env.OUT, { recursive: true });
    writeFileSync(join(process.env.OUT, 'wgmma-equiv.md'), run.stdout ?? '');
  }
  const output = `${(run.stdout ?? '').trim()}\n${(run.stderr ?? '').trim()}`.trim();
  // it prints CUDA failures on stderr (cuda_check.h) and its table on stdout
  if (run.status !== 0 && (run.stderr ?? '').trim() !== '') return `wgmma_equiv could not run here (exit ${run.status ?? run.signal}):\n${output}`;
  if (run.status !== 0) return `wgmma does not round as mma.sync on this device (exit ${run.status ?? run.signal}): the warpgroup kernels cannot keep batch invariance here\n${output}`;
  return undefined;
}

const kinds = (process.env.KDTREE_SELFTEST_BACKENDS ?? 'cuda,cpu').split(',') as ('cuda' | 'cpu')[];
if (kinds.includes('cuda')) {
  const problem = wgmmaEquivProblem();
  if (problem) {
    console.error(`STOP: precondition failed, no check was run. ${problem}`);
    process.exit(2);
  }
  console.log('precondition: wgmma rounds as mma.sync on this device (wgmma_equiv.cu: 0 differences)');
}
const results: { backend: string; check: string; ok: boolean; ms: number; detail: string }[] = [];
for (const kind of kinds) {
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
