#!/usr/bin/env node
// Builds the addon from native/ with cmake-js and installs the binaries with their build
// metadata into bin/<platform>-<arch>/ (where the loader looks first). The cpu variant always
// builds; the cuda variant builds where nvcc is found (KDTREE_CUDA=OFF skips it).
//   node scripts/build-native.mjs [--force]
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';

const pkgDir = fileURLToPath(new URL('..', import.meta.url));
const nativeDir = join(pkgDir, '..', '..', 'native');
const pkg = JSON.parse(readFileSync(join(pkgDir, 'package.json'), 'utf8'));
const platformKey = `${process.platform}-${process.arch}`;
const binDir = join(pkgDir, 'bin', platformKey);
const buildDir = join(pkgDir, 'build');
const force = process.argv.includes('--force');

function sourceHash() {
  const h = createHash('sha256');
  const walk = (dir) => {
    for (const name of readdirSync(dir).sort()) {
      const p = join(dir, name);
      if (statSync(p).isDirectory()) walk(p);
      else h.update(relative(nativeDir, p)).update(readFileSync(p));
    }
  };
  walk(nativeDir);
  h.update(pkg.version).update(process.env.KDTREE_CUDA ?? '');
  return h.digest('hex').slice(0, 16);
}

const hash = sourceHash();
const stamp = join(binDir, 'source-hash');
if (!force && existsSync(stamp) && readFileSync(stamp, 'utf8') === hash && existsSync(join(binDir, 'kdtree_cpu.node'))) {
  console.log(`@kdtree/cuda: native addon is current (${platformKey}, sources ${hash})`);
  process.exit(0);
}

// Stale binaries from an earlier build must not be mistaken for this one's (e.g. a cuda variant
// left over when this build has no nvcc).
for (const dir of [buildDir, join(buildDir, 'Release'), binDir]) {
  for (const variant of ['cpu', 'cuda']) for (const ext of ['node', 'json']) rmSync(join(dir, `kdtree_${variant}.${ext}`), { force: true });
}
const cmakeJs = join(pkgDir, 'node_modules', 'cmake-js', 'bin', 'cmake-js');
const definitions = { KDTREE_VERSION: pkg.version, KDTREE_CUDA: process.env.KDTREE_CUDA === 'OFF' ? 'OFF' : 'ON' }; // explicit: CMake caches options
dropStaleCache(join(buildDir, 'CMakeCache.txt'), definitions);
const args = [cmakeJs, 'compile', '--directory', nativeDir, '--out', buildDir, '--config', 'Release', ...Object.entries(definitions).map(([k, v]) => `--CD${k}=${v}`)];
console.log(`@kdtree/cuda: building the native addon (cmake-js, ${platformKey})`);
const started = Date.now();
const r = spawnSync(process.execPath, args, { cwd: pkgDir, stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8', env: { ...process.env, CMAKE_BUILD_PARALLEL_LEVEL: process.env.CMAKE_BUILD_PARALLEL_LEVEL ?? '2' } });
if (r.status !== 0) {
  process.stderr.write(r.stdout.slice(-20000));
  process.stderr.write(r.stderr.slice(-20000));
  console.error(`@kdtree/cuda: the native build failed (exit ${r.status}). It needs cmake >= 3.20 and a C++17 compiler; the cuda variant also nvcc.`);
  process.exit(1);
}
for (const line of r.stdout.split('\n')) if (line.includes('kdtree:')) console.log(`  ${line.replace(/^.*kdtree:/, 'kdtree:').trim()}`);
// ptxas reports only as "info" (C7514-C7518, "Potential Performance Loss") that it serialized a
// kernel's wgmmas because it could not prove which accumulators a wait covers; that slowed the
// prefill kernel by 13% unnoticed until run 202 (docs/gpu/notes.md). A build that does it fails.
const serialized = `${r.stdout}\n${r.stderr}`.split('\n').filter((line) => line.includes('Potential Performance Loss: wgmma'));
if (serialized.length > 0) {
  for (const line of new Set(serialized)) console.error(`  ${line.trim()}`);
  console.error('@kdtree/cuda: ptxas serialized the wgmma instructions of the kernels above. Keep every wgmma wait out of runtime branches and read a wgmma\'s accumulators only after the wait that covers its commit group (native/src/cuda/w4a16_prefill.cu explains the pattern).');
  removeCudaObjects(buildDir); // or the next build would find them current, print nothing and pass
  process.exit(1);
}

mkdirSync(binDir, { recursive: true });
const found = [];
for (const variant of ['cpu', 'cuda']) {
  const built = [join(buildDir, 'Release', `kdtree_${variant}.node`), join(buildDir, `kdtree_${variant}.node`)].find((p) => existsSync(p));
  if (!built) continue;
  const target = join(binDir, `kdtree_${variant}.node`);
  copyFileSync(built, `${target}.tmp`);
  renameSync(`${target}.tmp`, target);
  const cudaVersion = variant === 'cuda' ? nvccVersion(buildDir) : null;
  const meta = {
    name: pkg.name,
    version: pkg.version,
    variant,
    platform: process.platform,
    arch: process.arch,
    napiVersion: 8,
    cudaVersion,
    cudaArchitectures: variant === 'cuda' ? ['90-real', '90-virtual', '90a-real'] : [],
    sourceHash: hash,
    built: new Date().toISOString(),
  };
  writeFileSync(join(binDir, `kdtree_${variant}.json`), `${JSON.stringify(meta, null, 2)}\n`);
  found.push(variant);
}
writeFileSync(stamp, hash);
console.log(`@kdtree/cuda: built ${found.join(' + ')} into ${relative(pkgDir, binDir)} in ${((Date.now() - started) / 1000).toFixed(0)}s`);

// `cmake-js compile` configures only a build directory without a CMakeCache.txt, so in one configured
// before, the definitions it is given do nothing: after a version bump the binary kept the old
// version (which the loader then refuses against its metadata), and KDTREE_CUDA=OFF still built
// the cuda variant. A cache that disagrees with them is removed, so that the build configures
// again (turning the cuda variant off and on again compiled its kernels anew: ~3 min on 2 cores).
function dropStaleCache(cache, wanted) {
  if (!existsSync(cache)) return;
  const cached = new Map();
  for (const line of readFileSync(cache, 'utf8').split('\n')) {
    const m = /^([A-Za-z_][A-Za-z0-9_]*):[A-Z]+=(.*)$/.exec(line);
    if (m) cached.set(m[1], m[2]);
  }
  const stale = Object.entries(wanted).filter(([k, v]) => cached.get(k)?.toUpperCase() !== v.toUpperCase());
  if (stale.length === 0) return;
  console.log(`@kdtree/cuda: reconfiguring (${stale.map(([k, v]) => `${k} ${cached.get(k) ?? 'unset'} -> ${v}`).join(', ')})`);
  rmSync(cache);
}

/** Deletes the compiled CUDA objects under `dir`, so that the next build compiles every kernel again. */
function removeCudaObjects(dir) {
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) removeCudaObjects(p);
    else if (name.endsWith('.cu.o')) rmSync(p, { force: true });
  }
}

/** The CUDA compiler version CMake found (CMakeFiles/<cmake version>/CMakeCUDACompiler.cmake). */
function nvccVersion(buildDir) {
  const files = existsSync(join(buildDir, 'CMakeFiles')) ? readdirSync(join(buildDir, 'CMakeFiles')).map((d) => join(buildDir, 'CMakeFiles', d, 'CMakeCUDACompiler.cmake')) : [];
  for (const f of files.filter((f) => existsSync(f))) {
    const m = /set\(CMAKE_CUDA_COMPILER_VERSION "([^"]+)"\)/.exec(readFileSync(f, 'utf8'));
    if (m) return m[1];
  }
  return null;
}
