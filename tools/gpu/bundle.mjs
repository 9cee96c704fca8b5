#!/usr/bin/env node
// Builds the GPU payload in .gpu/ (git-ignored; carried to the GPU host by the device runner):
//   selftest.mjs, bench.mjs   the kernel suite and benchmark, bundled (no node_modules needed)
//   engine-check.mjs          the engine's exactness suite on cuda (chain / DDTree == greedy, forward vs reference)
//   nccl-check.mjs            NCCL on one GPU: version, a world-1 communicator, collectives in a graph, tp-1 decode over NCCL
//   engine-bench.mjs          the engine's benchmark at Kimi K2's dimensions (docs/benchmarks/engine.md)
//   walk-bench.mjs            the demo's models (walk target, draft model, built DFlash drafter): chain vs DDTree
//   hf_peer.py                transformers' DeepseekV3 in bf16 on the same architecture, its peer
//   profile.mjs               the hot kernels once each, for Nsight Compute (run.sh profile)
//   host-cost.mjs             host time per native call (tools/bench/host-cost.mjs; --backend cuda)
//   kdtree_{cuda,cpu}.node    the addon binaries with their build metadata (.json)
//   dense_baseline.py         the torch/cuBLAS peer of the benchmark
//   int4_peer.py              the torch int4 (tinygemm) peer of the benchmark
//   peers.py                  what the two peers share (shapes, token counts, timing)
//   stream_floor.cu           the pure-read floor under the W4A16 GEMM (built there with nvcc)
//   wgmma_equiv.cu            whether wgmma rounds as mma.sync on the GEMM's operands (nvcc there)
//   ddtree_phases.cu          the cluster DDTree build's phases (nvcc there, with native/src: run.sh ddtree-phases)
//   cuda_check.h              the CHECK macro of those two
//   node.xz                   this machine's Node, compressed (../shared/gpu/pack-node.sh)
//   run.sh                    what to run there (tools/gpu/run.sh)
//   dflash/model.py           the public DFlash drafter (github z-lab/dflash), read from a local git mirror
//                             (KDTREE_DFLASH_GIT, default /work/.mirror/z-lab+dflash/repo), the oracle of
//                             tools/fixtures/gen_dflash_fixtures.py; never committed here
// `node tools/gpu/bundle.mjs dflash` writes only dflash/model.py (the fixture run needs nothing else).
import { spawnSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, renameSync, writeFileSync } from 'node:fs';
import { basename, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { rolldown } from 'rolldown';

const root = fileURLToPath(new URL('../..', import.meta.url));
const out = join(root, '.gpu');
const DFLASH_GIT = process.env.KDTREE_DFLASH_GIT ?? '/work/.mirror/z-lab+dflash/repo';

/** Copies dflash/model.py out of the mirror's HEAD; `required` makes a missing mirror an error. */
function copyDflash(required) {
  const show = spawnSync('git', ['-C', DFLASH_GIT, 'show', 'HEAD:dflash/model.py'], { encoding: 'utf8', maxBuffer: 16 << 20 });
  if (show.status !== 0) {
    const why = `${DFLASH_GIT}: cannot read HEAD:dflash/model.py (${(show.stderr || show.error?.message || '').trim()}); set KDTREE_DFLASH_GIT to a git directory of github z-lab/dflash`;
    if (required) {
      console.error(why);
      process.exit(1);
    }
    console.warn(`${why}; .gpu/dflash/ left out`);
    return;
  }
  mkdirSync(join(out, 'dflash'), { recursive: true });
  writeFileSync(join(out, 'dflash', 'model.py.tmp'), show.stdout);
  renameSync(join(out, 'dflash', 'model.py.tmp'), join(out, 'dflash', 'model.py'));
  const rev = spawnSync('git', ['-C', DFLASH_GIT, 'rev-parse', 'HEAD'], { encoding: 'utf8' });
  writeFileSync(join(out, 'dflash', 'REVISION'), `github z-lab/dflash ${rev.stdout.trim()}\n`);
}

mkdirSync(out, { recursive: true });
if (process.argv[2] === 'dflash') {
  copyDflash(true);
  console.log(`DFlash oracle in ${join(out, 'dflash')}`);
  process.exit(0);
}
copyDflash(false);
const bin = join(root, 'packages', 'cuda', 'bin', `${process.platform}-${process.arch}`);
for (const variant of ['cuda', 'cpu']) {
  for (const ext of ['node', 'json']) {
    const file = join(bin, `kdtree_${variant}.${ext}`);
    if (!existsSync(file)) {
      console.error(`missing ${file}: build the addon first (pnpm --filter @kdtree/cuda build:native: the cuda variant needs nvcc)`);
      process.exit(1);
    }
    copyFileSync(file, join(out, `kdtree_${variant}.${ext}`));
  }
}
// The GPU host has no node_modules: an import rolldown cannot resolve (a workspace package whose
// dist/ is not built yet) would be left as a bare import and fail there, so it fails here instead,
// before that bundle is written (each bundle lands whole, through a temp file and a rename).
for (const input of ['gpu/selftest.ts', 'gpu/bench.ts', 'gpu/profile.ts', 'gpu/engine-check.ts', 'gpu/nccl-check.ts', 'gpu/engine-bench.ts', 'gpu/walk-bench.ts', 'bench/host-cost.mjs']) {
  const unresolved = new Set();
  const bundle = await rolldown({
    input: join(root, 'tools', input),
    platform: 'node',
    external: [/^node:/],
    logLevel: 'warn',
    onLog(level, log, handler) {
      if (log.code === 'UNRESOLVED_IMPORT') unresolved.add(log.message.split('\n')[0].replace(/\x1b\[[0-9;]*m/g, ''));
      else handler(level, log);
    },
  });
  const { output } = await bundle.generate({ format: 'esm', codeSplitting: false });
  await bundle.close();
  const bare = output[0].imports.filter((name) => !name.startsWith('node:'));
  if (unresolved.size > 0 || bare.length > 0) {
    console.error(`tools/${input}: imports left unresolved (${bare.join(', ')}):\n  ${[...unresolved].join('\n  ')}`);
    console.error('Build the workspace packages first: pnpm install && pnpm exec turbo run build (or .ci/run).');
    process.exit(1);
  }
  const file = join(out, `${basename(input).replace(/\.[mt]s$|\.mjs$/, '')}.mjs`);
  writeFileSync(`${file}.tmp`, output[0].code);
  renameSync(`${file}.tmp`, file);
}
for (const file of ['dense_baseline.py', 'int4_peer.py', 'hf_peer.py', 'peers.py', 'ab_table.py', 'stream_floor.cu', 'wgmma_equiv.cu', 'ddtree_phases.cu', 'cuda_check.h']) copyFileSync(join(root, 'tools', 'gpu', file), join(out, file));
const pack = spawnSync('bash', [join(root, '..', 'shared', 'gpu', 'pack-node.sh'), out], { stdio: 'inherit' });
if (pack.status !== 0) process.exit(pack.status ?? 1);
copyFileSync(join(root, 'tools', 'gpu', 'run.sh'), join(out, 'run.sh'));
console.log(`GPU payload in ${out}`);
