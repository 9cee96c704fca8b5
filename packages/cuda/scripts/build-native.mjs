#!/usr/bin/env node
// Builds the addon from its C++/CUDA sources with cmake-js and installs the binaries with their
// build metadata into bin/<platform>-<arch>/ of this package, where the loader looks first. The
// cpu variant always builds; the cuda variant where KDTREE_CUDA=ON asks for it, or (unset) where
// nvcc is found and the machine has an NVIDIA GPU (with --with-nvcc: wherever nvcc is found);
// KDTREE_CUDA=OFF skips it.
//   in the repository:                  pnpm --filter @kdtree/cuda build:native   (--force --with-nvcc)
//   in a project that installed it:     npx kdtree-build-native
//   node scripts/build-native.mjs [--force] [--with-nvcc]   (--force: rebuild even when current)
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { elfNeeds } from './elf-needs.mjs';
import { checkPrerequisites, findNvcc, missingLine } from './native-prerequisites.mjs';

const pkgDir = fileURLToPath(new URL('..', import.meta.url));
// The repository keeps the sources at its root; the published package carries a copy in native/
// (pack-native-sources.mjs writes it at pack time; in the repository such a copy is ignored).
const repoRoot = join(pkgDir, '..', '..');
const inRepository = existsSync(join(repoRoot, 'pnpm-workspace.yaml')) && existsSync(join(repoRoot, 'native', 'CMakeLists.txt'));
const nativeDir = inRepository ? join(repoRoot, 'native') : join(pkgDir, 'native');
const pkg = JSON.parse(readFileSync(join(pkgDir, 'package.json'), 'utf8'));
const platformKey = `${process.platform}-${process.arch}`;
const binDir = join(pkgDir, 'bin', platformKey);
const buildDir = join(pkgDir, 'build');
const force = process.argv.includes('--force');
const withNvcc = process.argv.includes('--with-nvcc');
const say = (line) => console.log(`@kdtree/cuda: ${line}`);

if (!existsSync(join(nativeDir, 'CMakeLists.txt'))) {
  console.error(`@kdtree/cuda: no native sources at ${nativeDir} (this copy of @kdtree/cuda was packed without native/)`);
  process.exit(1);
}
const prerequisites = checkPrerequisites(process.env, { withNvcc });
if (prerequisites.problems) {
  console.error(missingLine(prerequisites.problems));
  process.exit(1);
}
const { cuda } = prerequisites;

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
  return h.digest('hex').slice(0, 16);
}

// What a build is of: the sources, the version the binaries record and the variants. The stamp in
// bin/ holds the last build's, so a build says which of them changed.
const wanted = { sources: sourceHash(), version: pkg.version, variants: cuda.cuda ? 'cpu + cuda' : 'cpu' };
const hash = createHash('sha256').update(JSON.stringify(wanted)).digest('hex').slice(0, 16);
const stamp = join(binDir, 'build-stamp.json');
let previous;
try {
  previous = JSON.parse(readFileSync(stamp, 'utf8'));
} catch {
  previous = undefined; // no build yet, or one from before the stamp
}
// a cuda build of the same sources stays where the cuda variant is skipped only for lack of a GPU
// (an explicit build made it, and the set-up step after it should not throw it away)
const keepsCuda = cuda.unasked && previous?.variants === 'cpu + cuda' && existsSync(join(binDir, 'kdtree_cuda.node'));
const changed = previous ? Object.keys(wanted).filter((k) => previous[k] !== wanted[k] && !(k === 'variants' && keepsCuda)) : [];
if (!force && previous && changed.length === 0 && existsSync(join(binDir, 'kdtree_cpu.node'))) {
  say(`native addon is current (${platformKey}, ${wanted.variants}, sources ${wanted.sources})`);
  process.exit(0);
}

// Stale binaries from an earlier build must not be mistaken for this one's (e.g. a cuda variant
// left over when this build skips it).
for (const dir of [buildDir, join(buildDir, 'Release'), binDir]) {
  for (const variant of ['cpu', 'cuda']) for (const ext of ['node', 'json']) rmSync(join(dir, `kdtree_${variant}.${ext}`), { force: true });
}
const requireHere = createRequire(join(pkgDir, 'package.json'));
const cmakeJs = join(dirname(requireHere.resolve('cmake-js/package.json')), 'bin', 'cmake-js');
// node-addon-api gives its directory relative to the working directory; CMake wants it absolute
const nodeAddonApi = resolve(requireHere('node-addon-api').include_dir);
// explicit, since CMake caches options
const definitions = { KDTREE_VERSION: pkg.version, KDTREE_CUDA: cuda.cuda ? 'ON' : 'OFF' };
const extra = { NODE_ADDON_API_DIR: nodeAddonApi, ...(cuda.cuda ? { CMAKE_CUDA_COMPILER: findNvcc().path } : {}) };
dropForeignBuild(buildDir, nativeDir);
dropStaleCache(join(buildDir, 'CMakeCache.txt'), definitions);
const args = [cmakeJs, 'compile', '--directory', nativeDir, '--out', buildDir, '--config', 'Release', ...Object.entries({ ...definitions, ...extra }).map(([k, v]) => `--CD${k}=${v}`)];

const why = force
  ? '--force'
  : previous === undefined
    ? 'no build yet'
    : changed.map((k) => (k === 'sources' ? 'the native sources changed' : `${k} ${previous[k]} -> ${wanted[k]}`)).join(', ');
say(`building the native addon for ${platformKey} (${why}): the cpu variant${cuda.cuda ? ` and the cuda variant (${cuda.why}; ~3 minutes of nvcc on 2 cores)` : `; the cuda variant is skipped: ${cuda.why}`}`);
const started = Date.now();
const output = await runBuild(process.execPath, args, { cwd: pkgDir, env: { ...process.env, CMAKE_BUILD_PARALLEL_LEVEL: process.env.CMAKE_BUILD_PARALLEL_LEVEL ?? '2' } });
if (output.status !== 0) {
  process.stderr.write(output.text.slice(-20000));
  console.error(`@kdtree/cuda: the native build failed (exit ${output.status}); the compiler's messages are above.`);
  process.exit(1);
}
// ptxas reports only as "info" (C7514-C7518, "Potential Performance Loss") that it serialized a
// kernel's wgmmas because it could not prove which accumulators a wait covers, which slows the
// kernel without failing anything. A build that does it fails.
const serialized = output.text.split('\n').filter((line) => line.includes('Potential Performance Loss: wgmma'));
if (serialized.length > 0) {
  for (const line of new Set(serialized)) console.error(`  ${line.trim()}`);
  console.error("@kdtree/cuda: ptxas serialized the wgmma instructions of the kernels above. Keep every wgmma wait out of runtime branches and read a wgmma's accumulators only after the wait that covers its commit group (native/src/cuda/w4a16_prefill.cu explains the pattern).");
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
  const meta = {
    name: pkg.name,
    version: pkg.version,
    variant,
    platform: process.platform,
    arch: process.arch,
    napiVersion: 8,
    cudaVersion: variant === 'cuda' ? nvccVersion(buildDir) : null,
    cudaArchitectures: variant === 'cuda' ? ['90-real', '90-virtual', '90a-real'] : [],
    // the newest glibc / libstdc++ symbol versions the binary needs: its platform floor
    requires: elfNeeds(target) ?? {},
    sourceHash: wanted.sources,
    built: new Date().toISOString(),
  };
  const metaPath = join(binDir, `kdtree_${variant}.json`);
  writeFileSync(`${metaPath}.tmp`, `${JSON.stringify(meta, null, 2)}\n`);
  renameSync(`${metaPath}.tmp`, metaPath);
  found.push(variant);
}
if (cuda.cuda && !found.includes('cuda')) {
  console.error('@kdtree/cuda: the build produced no cuda variant although nvcc was found (see CMake\'s "kdtree:" lines above)');
  process.exit(1);
}
writeFileSync(`${stamp}.tmp`, `${JSON.stringify({ ...wanted, hash }, null, 2)}\n`);
renameSync(`${stamp}.tmp`, stamp);
rmSync(join(binDir, 'source-hash'), { force: true }); // the stamp of earlier builds
say(`built ${found.join(' + ')} into ${relative(pkgDir, binDir)} in ${((Date.now() - started) / 1000).toFixed(0)}s`);

/**
 * Runs the build, printing its progress as it goes (CMake's "kdtree:" status lines and one line
 * per compiled file, and a line every 30 s while one compiles), and returns its whole output.
 */
function runBuild(cmd, argv, options) {
  return new Promise((resolve) => {
    const child = spawn(cmd, argv, { ...options, stdio: ['ignore', 'pipe', 'pipe'] });
    let text = '';
    let pending = '';
    let last = Date.now();
    const heartbeat = setInterval(() => {
      if (Date.now() - last >= 30_000) {
        say(`  still compiling (${((Date.now() - started) / 1000).toFixed(0)}s so far)`);
        last = Date.now();
      }
    }, 5_000);
    const onData = (chunk) => {
      text += chunk;
      pending += chunk;
      const lines = pending.split('\n');
      pending = lines.pop() ?? '';
      for (const line of lines) {
        // Makefiles print "[ 40%] Building CUDA object ...", Ninja "[3/20] Building CUDA object ..."
        const step = /^\[\s*([\d/]+%?)\] Building (CXX|CUDA) object .*?([^/]+)\.o$/.exec(line);
        if (step) {
          say(`  [${step[1].padStart(5)}] ${step[3]}${step[2] === 'CUDA' ? ' (nvcc)' : ''}`);
          last = Date.now();
        } else if (/^-- kdtree: /.test(line)) {
          say(`  ${line.replace(/^-- kdtree: /, 'cmake: ')}`);
        }
      }
    };
    child.stdout.setEncoding('utf8').on('data', onData);
    child.stderr.setEncoding('utf8').on('data', (chunk) => (text += chunk));
    child.on('error', (error) => {
      clearInterval(heartbeat);
      resolve({ status: 1, text: `${text}\n${error.message}` });
    });
    child.on('close', (status) => {
      clearInterval(heartbeat);
      resolve({ status: status ?? 1, text });
    });
  });
}

// `cmake-js compile` configures only a build directory without a CMakeCache.txt, so in one configured
// before, the definitions it is given do nothing: after a version bump the binary kept the old
// version (which the loader then refuses against its metadata), and KDTREE_CUDA=OFF still built
// the cuda variant. A cache that disagrees with them is removed, so that the build configures
// again (turning the cuda variant off and on again compiles its kernels anew).
/**
 * Deletes a build directory configured for another copy of the native sources: turbo's cache
 * restores build/ as the checkout that filled the cache left it (another worktree, another clone),
 * and CMake would then compile that copy's sources, not these.
 */
function dropForeignBuild(dir, sources) {
  const cache = join(dir, 'CMakeCache.txt');
  if (!existsSync(cache)) return;
  const home = /^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$/m.exec(readFileSync(cache, 'utf8'))?.[1];
  if (home === undefined || resolve(home) === resolve(sources)) return;
  say(`reconfiguring from scratch (the build directory was configured for ${home})`);
  rmSync(dir, { recursive: true, force: true });
}

function dropStaleCache(cache, wanted) {
  if (!existsSync(cache)) return;
  const cached = new Map();
  for (const line of readFileSync(cache, 'utf8').split('\n')) {
    const m = /^([A-Za-z_][A-Za-z0-9_]*):[A-Z]+=(.*)$/.exec(line);
    if (m) cached.set(m[1], m[2]);
  }
  const stale = Object.entries(wanted).filter(([k, v]) => cached.get(k)?.toUpperCase() !== v.toUpperCase());
  if (stale.length === 0) return;
  say(`reconfiguring (${stale.map(([k, v]) => `${k} ${cached.get(k) ?? 'unset'} -> ${v}`).join(', ')})`);
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
function nvccVersion(dir) {
  const files = existsSync(join(dir, 'CMakeFiles')) ? readdirSync(join(dir, 'CMakeFiles')).map((d) => join(dir, 'CMakeFiles', d, 'CMakeCUDACompiler.cmake')) : [];
  for (const f of files.filter((f) => existsSync(f))) {
    const m = /set\(CMAKE_CUDA_COMPILER_VERSION "([^"]+)"\)/.exec(readFileSync(f, 'utf8'));
    if (m) return m[1];
  }
  return null;
}
