/**
 * Finds and loads the addon. Candidates per variant, in order: the caller's search paths,
 * bin/<platform>-<arch>/ of this package (a build from source: `build:native` in the repository,
 * `npx kdtree-build-native` where it is installed), then the variant's prebuilt package:
 * @kdtree/cuda-<platform>-<arch> (the cpu variant, an optional dependency of this package) or
 * @kdtree/cuda-<platform>-<arch>-cuda (the cuda variant, which a machine with a GPU installs
 * beside it), resolved from this package and then from the application's directory.
 * A binary is accepted only with a build-metadata file of the same package version and variant.
 * A cuda binary is first probed in a child process (an incompatible binary or driver can take
 * down only the probe), and must see a device of compute capability >= 9.0 with a driver at
 * least as new as its runtime. `auto` tries cuda, then cpu, logging each fallback; a device
 * ordinal the caller named that a machine with GPUs does not have is an error, not a fallback.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { AddonLoadError, type LoadAttempt } from './errors.js';
import { howToFix, prebuiltPackage, type FixContext } from './load-fix.js';
import type { BuildMeta, CudaProbe, NativeBackend, NativeModule } from './native-types.js';

export type BackendKind = 'auto' | 'cuda' | 'cpu';
export const BACKEND_KINDS: readonly BackendKind[] = ['auto', 'cuda', 'cpu'];

export interface LoadOptions {
  /** Default: the KDTREE_BACKEND environment variable, else 'auto'. */
  backend?: BackendKind;
  /** CUDA device ordinal (default 0). */
  device?: number;
  /** Where fallbacks and the final choice are reported (default: nothing). */
  log?: (line: string) => void;
  /** Extra directories holding kdtree_{cuda,cpu}.node + .json, tried first (tests, custom builds). */
  searchPaths?: string[];
  /** Only search `searchPaths`. */
  onlySearchPaths?: boolean;
}

export interface LoadedAddon {
  native: NativeBackend;
  module: NativeModule;
  variant: 'cpu' | 'cuda';
  /** The CUDA device ordinal the backend runs on (0 for the cpu variant). */
  device: number;
  path: string;
  meta: BuildMeta;
  /** Where the binary came from: 'search path', 'bin/ of @kdtree/cuda', '@kdtree/cuda-<platform>-<arch>' or '@kdtree/cuda-<platform>-<arch>-cuda'. */
  source: string;
  /** Why this one was chosen (and what was skipped before it). */
  reason: string;
  /** The candidates tried before it and why each was unusable (missing ones included: 'not built'). */
  skipped: LoadAttempt[];
  probe?: CudaProbe;
}

const require = createRequire(import.meta.url);
const PACKAGE_DIR = join(dirname(fileURLToPath(import.meta.url)), '..');

/** This package's version; undefined inside a bundle (the GPU self-test), where only the binary's own metadata is checked. */
function packageVersion(): string | undefined {
  try {
    const pkg = JSON.parse(readFileSync(join(PACKAGE_DIR, 'package.json'), 'utf8'));
    return pkg.name === '@kdtree/cuda' ? pkg.version : undefined;
  } catch {
    return undefined;
  }
}
const PACKAGE_VERSION = packageVersion();
export const PLATFORM_KEY = `${process.platform}-${process.arch}`;

interface Candidate {
  /** undefined: a prebuilt package that is not installed */
  dir: string | undefined;
  source: string;
}

/** The directory of an installed package: resolved from this package, else from the application's directory. */
function packageDir(name: string): string | undefined {
  for (const from of [require, createRequire(join(process.cwd(), 'package.json'))]) {
    try {
      return dirname(from.resolve(`${name}/package.json`));
    } catch {
      // not installed where this base resolves from
    }
  }
  return undefined;
}

function candidateDirs(variant: 'cpu' | 'cuda', options: LoadOptions): Candidate[] {
  const dirs: Candidate[] = (options.searchPaths ?? []).map((dir) => ({ dir, source: 'search path' }));
  if (options.onlySearchPaths) return dirs;
  dirs.push({ dir: join(PACKAGE_DIR, 'bin', PLATFORM_KEY), source: 'bin/ of @kdtree/cuda' });
  const name = prebuiltPackage(PLATFORM_KEY, variant);
  const dir = packageDir(name);
  dirs.push({ dir: dir === undefined ? undefined : join(dir, 'bin'), source: name });
  return dirs;
}

/** Whether this is the repository's packages/cuda (built with pnpm) rather than an installed copy. */
function inRepository(): boolean {
  return existsSync(join(PACKAGE_DIR, '..', '..', 'pnpm-workspace.yaml')) && existsSync(join(PACKAGE_DIR, '..', '..', 'native', 'CMakeLists.txt'));
}

function fixContext(): FixContext {
  return { platformKey: PLATFORM_KEY, version: PACKAGE_VERSION, inRepository: inRepository() };
}

function readMeta(path: string): BuildMeta | string {
  const metaPath = path.replace(/\.node$/, '.json');
  if (!existsSync(metaPath)) return `no build metadata (${metaPath})`;
  try {
    return JSON.parse(readFileSync(metaPath, 'utf8')) as BuildMeta;
  } catch (error) {
    return `unreadable build metadata: ${(error as Error).message}`;
  }
}

/** Runs cudaProbe() of a cuda binary in a child process. */
function probeInChild(path: string): CudaProbe | string {
  const script = `const m = require(${JSON.stringify(path)}); process.stdout.write(JSON.stringify(m.cudaProbe()));`;
  const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', timeout: 60_000 });
  if (r.error) return `probe could not run: ${r.error.message}`;
  if (r.status !== 0) return `probe process failed (${r.signal ?? `exit ${r.status}`}): ${(r.stderr || '').trim().split('\n').slice(-3).join(' ')}`;
  try {
    return JSON.parse(r.stdout) as CudaProbe;
  } catch {
    return `probe printed no result: ${r.stdout.slice(0, 200)}`;
  }
}

/** Why a candidate cannot be used; `final` stops the search (falling back to cpu would hide a mistake), and `fix` says what to do instead. */
interface Unusable {
  reason: string;
  final?: boolean;
  fix?: string;
}

/**
 * Why a probed cuda binary cannot serve `device`. A machine without a usable GPU falls back to
 * cpu under `auto`; a machine with GPUs but not the ordinal the caller named does not (a rank
 * started on device 3 of 2 would otherwise run on the cpu twin, thousands of times slower).
 */
export function probeProblem(probe: CudaProbe, device: number, deviceNamed: boolean): Unusable | undefined {
  if (!probe.ok) return { reason: probe.error || 'no usable CUDA device' };
  const d = probe.devices[device];
  if (d === undefined) {
    const final = deviceNamed && probe.deviceCount > 0;
    const valid = probe.deviceCount === 1 ? 'device 0' : `a device from 0 to ${probe.deviceCount - 1}`;
    const fix = `name ${valid} (CUDA_VISIBLE_DEVICES decides which GPUs this process sees), or choose the cpu backend with KDTREE_BACKEND=cpu.`;
    return { reason: `device ${device} does not exist (${probe.deviceCount} visible)`, final, ...(final ? { fix } : {}) };
  }
  const [major] = d.computeCapability.split('.').map(Number);
  if (major < 9) return { reason: `device ${device} (${d.name}) has compute capability ${d.computeCapability}; this binary has sm_90 code (needs 9.0 or newer)` };
  return undefined;
}

function tryCandidate(path: string, variant: 'cpu' | 'cuda', source: string, options: LoadOptions): LoadedAddon | Unusable {
  if (!existsSync(path)) return { reason: 'not built' };
  const meta = readMeta(path);
  if (typeof meta === 'string') return { reason: meta };
  if (PACKAGE_VERSION !== undefined && meta.version !== PACKAGE_VERSION) return { reason: `built for @kdtree/cuda ${meta.version}, this is ${PACKAGE_VERSION} (rebuild it)` };
  if (meta.variant !== variant || meta.platform !== process.platform || meta.arch !== process.arch) return { reason: `metadata says ${meta.variant} ${meta.platform}-${meta.arch}` };
  let probe: CudaProbe | undefined;
  const device = options.device ?? 0;
  if (variant === 'cuda') {
    const p = probeInChild(path);
    if (typeof p === 'string') return { reason: p };
    const problem = probeProblem(p, device, options.device !== undefined);
    if (problem) return problem;
    probe = p;
  }
  let module: NativeModule;
  try {
    module = require(path) as NativeModule;
  } catch (error) {
    return { reason: `cannot load: ${(error as Error).message.split('\n')[0]}` };
  }
  if (module.build.version !== meta.version || module.build.variant !== variant) {
    return { reason: `binary reports ${module.build.variant} ${module.build.version}, its metadata ${meta.variant} ${meta.version}` };
  }
  try {
    const native = module.createBackend(variant, device);
    return { native, module, variant, device: variant === 'cuda' ? device : 0, path, meta, source, reason: '', skipped: [], probe };
  } catch (error) {
    return { reason: (error as Error).message };
  }
}

export function resolveBackendKind(requested: string | undefined): BackendKind {
  const kind = requested ?? process.env.KDTREE_BACKEND ?? 'auto';
  if (!(BACKEND_KINDS as readonly string[]).includes(kind)) {
    throw new AddonLoadError(PLATFORM_KEY, kind, [{ candidate: 'KDTREE_BACKEND', variant: 'cpu', reason: `'${kind}' is not one of auto, cuda, cpu` }], 'set KDTREE_BACKEND (or the backend option) to auto, cuda or cpu.');
  }
  return kind as BackendKind;
}

/** Loads the addon and creates a backend of the requested kind. */
export function loadAddon(options: LoadOptions = {}): LoadedAddon {
  const requested = resolveBackendKind(options.backend);
  const variants: ('cuda' | 'cpu')[] = requested === 'auto' ? ['cuda', 'cpu'] : [requested];
  const attempts: LoadAttempt[] = [];
  for (const variant of variants) {
    for (const { dir, source } of candidateDirs(variant, options)) {
      if (dir === undefined) {
        attempts.push({ candidate: `${source} (package)`, variant, reason: 'not installed' });
        continue;
      }
      const path = join(dir, `kdtree_${variant}.node`);
      const result = tryCandidate(path, variant, source, options);
      if ('native' in result) {
        const skipped = attempts.map((a) => `${a.variant} ${a.candidate}: ${a.reason}`).join('; ');
        result.reason = `${variant} from ${source}${skipped ? ` (skipped ${skipped})` : ''}`;
        result.skipped = attempts;
        options.log?.(`@kdtree/cuda: using the ${variant} backend from ${source} (${path})`);
        return result;
      }
      attempts.push({ candidate: `${path} (${source})`, variant, reason: result.reason });
      if (result.final) throw new AddonLoadError(PLATFORM_KEY, requested, attempts, result.fix);
      if (existsSync(path)) options.log?.(`@kdtree/cuda: ${variant} from ${source} unusable: ${result.reason}`);
    }
  }
  throw new AddonLoadError(PLATFORM_KEY, requested, attempts, howToFix(requested, attempts, fixContext()));
}
