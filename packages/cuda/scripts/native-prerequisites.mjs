// What building the addon from source needs, checked before anything is built so that a missing
// tool is named in one line instead of surfacing as a cmake-js exit code minutes later. Plain
// Node (no dependencies): the repository's set-up step imports it before installing anything.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { delimiter, join } from 'node:path';

export const CMAKE_MIN = [3, 20];

/** The first of `names` on PATH (or an absolute path that exists), else undefined. */
function onPath(names) {
  for (const name of names) {
    if (!name) continue;
    if (name.includes('/')) {
      if (existsSync(name)) return name;
      continue;
    }
    for (const dir of (process.env.PATH ?? '').split(delimiter)) {
      if (dir && existsSync(join(dir, name))) return join(dir, name);
    }
  }
  return undefined;
}

function run(cmd, args) {
  const r = spawnSync(cmd, args, { encoding: 'utf8' });
  return r.error ? { status: 1, out: '' } : { status: r.status ?? 1, out: `${r.stdout}${r.stderr}` };
}

/** cmake >= 3.20: { path, version } or { problem }. */
export function findCmake() {
  const path = onPath(['cmake']);
  if (!path) return { problem: 'cmake >= 3.20 (not on PATH; e.g. apt install cmake)' };
  const m = /cmake version (\d+)\.(\d+)(?:\.(\d+))?/.exec(run(path, ['--version']).out);
  if (!m) return { problem: `cmake >= 3.20 (${path} printed no version)` };
  const version = [Number(m[1]), Number(m[2])];
  if (version[0] < CMAKE_MIN[0] || (version[0] === CMAKE_MIN[0] && version[1] < CMAKE_MIN[1])) return { problem: `cmake >= 3.20 (found ${m[0].slice(14)} at ${path})` };
  return { path, version: m[0].slice(14) };
}

/** A C++ compiler that compiles C++17 (CXX, else c++, g++, clang++): { path } or { problem }. */
export function findCxx17() {
  const path = onPath([process.env.CXX, 'c++', 'g++', 'clang++']);
  if (!path) return { problem: 'a C++17 compiler (no CXX, c++, g++ or clang++ on PATH; e.g. apt install g++)' };
  const dir = mkdtempSync(join(tmpdir(), 'kdtree-cxx17-'));
  try {
    const src = join(dir, 'probe.cc');
    writeFileSync(src, '#include <optional>\nint main() { std::optional<int> v{1}; if constexpr (sizeof(int) > 0) return *v - 1; }\n');
    const r = run(path, ['-std=c++17', '-fsyntax-only', src]);
    if (r.status !== 0) return { problem: `a C++17 compiler (${path} rejects -std=c++17: ${r.out.trim().split('\n')[0] ?? ''})` };
    return { path };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/** nvcc, where CMake looks for it (CUDACXX, PATH, /usr/local/cuda): its path and release, or undefined. */
export function findNvcc() {
  const path = onPath([process.env.CUDACXX, 'nvcc', '/usr/local/cuda/bin/nvcc']);
  if (!path) return undefined;
  const m = /release (\d+\.\d+)/.exec(run(path, ['--version']).out);
  return { path, release: m ? m[1] : 'unknown' };
}

/** Whether this machine has an NVIDIA GPU with its kernel driver loaded (Linux: /proc/driver/nvidia). */
export function hasNvidiaGpu() {
  return existsSync('/proc/driver/nvidia/version') || existsSync('/dev/nvidiactl');
}

/**
 * Whether to build the cuda variant: KDTREE_CUDA=ON asks for it (an error without nvcc), OFF
 * skips it. Unset, `withNvcc` (the repository's explicit `build:native`) builds it wherever nvcc is
 * found; otherwise (the set-up step, `npx kdtree-build-native`) only where nvcc is found and the
 * machine has an NVIDIA GPU, since elsewhere it could not run and costs minutes of compiling.
 * Returns { cuda, why, unasked, problem? }; `unasked`: the choice was made for lack of a GPU, so an
 * existing cuda build of the same sources may stay.
 */
export function cudaDecision(env = process.env, nvcc = findNvcc(), gpu = hasNvidiaGpu(), withNvcc = false) {
  const asked = (env.KDTREE_CUDA ?? '').toUpperCase();
  if (asked !== '' && asked !== 'ON' && asked !== 'OFF') return { cuda: false, why: '', problem: `KDTREE_CUDA must be ON or OFF, got '${env.KDTREE_CUDA}'` };
  if (asked === 'OFF') return { cuda: false, why: 'KDTREE_CUDA=OFF' };
  if (asked === 'ON') {
    if (!nvcc) return { cuda: false, why: '', problem: 'nvcc 13 for KDTREE_CUDA=ON (not in CUDACXX, on PATH or in /usr/local/cuda/bin)' };
    return { cuda: true, why: `KDTREE_CUDA=ON, nvcc ${nvcc.release}` };
  }
  if (!nvcc) return { cuda: false, why: 'no nvcc found (KDTREE_CUDA=ON with nvcc 13 builds it)' };
  if (withNvcc) return { cuda: true, why: `nvcc ${nvcc.release} found (KDTREE_CUDA=OFF skips it)` };
  if (!gpu) return { cuda: false, why: 'no NVIDIA GPU on this machine (KDTREE_CUDA=ON builds it anyway)', unasked: true };
  return { cuda: true, why: `an NVIDIA GPU and nvcc ${nvcc.release}` };
}

/**
 * Everything a native build needs, checked: { cmake, cxx, cuda } or { problems: string[] }
 * (`withNvcc`: see cudaDecision)
 * (each names the tool, the version wanted and how to get it).
 */
export function checkPrerequisites(env = process.env, { withNvcc = false } = {}) {
  const cmake = findCmake();
  const cxx = findCxx17();
  const cuda = cudaDecision(env, findNvcc(), hasNvidiaGpu(), withNvcc);
  const problems = [cmake.problem, cxx.problem, cuda.problem].filter(Boolean);
  return problems.length > 0 ? { problems } : { cmake, cxx, cuda };
}

/** The one line that says what is missing. */
export function missingLine(problems) {
  return `@kdtree/cuda: cannot build the native addon: missing ${problems.join('; ')}.`;
}
