import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { AddonLoadError } from './errors.js';
import { loadAddon, PLATFORM_KEY, probeProblem } from './loader.js';
import type { CudaProbe } from './native-types.js';

const built = join(import.meta.dirname, '..', 'bin', PLATFORM_KEY);
const builtMeta = JSON.parse(readFileSync(join(built, 'kdtree_cpu.json'), 'utf8')) as Record<string, unknown>;
const scratch = mkdtempSync(join(tmpdir(), 'kdtree-loader-'));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

/** A directory holding the cpu binary with the given build metadata (none: no .json). */
function candidateDir(name: string, meta: Record<string, unknown> | undefined): string {
  const dir = join(scratch, name);
  mkdirSync(dir, { recursive: true });
  copyFileSync(join(built, 'kdtree_cpu.node'), join(dir, 'kdtree_cpu.node'));
  if (meta) writeFileSync(join(dir, 'kdtree_cpu.json'), JSON.stringify(meta));
  return dir;
}

function loadError(run: () => unknown): AddonLoadError {
  try {
    run();
  } catch (error) {
    if (error instanceof AddonLoadError) return error;
    throw error;
  }
  throw new Error('expected an AddonLoadError');
}

describe('loadAddon', () => {
  it('loads the cpu variant from a search path and says why', () => {
    const lines: string[] = [];
    const loaded = loadAddon({ backend: 'cpu', searchPaths: [candidateDir('good', builtMeta)], onlySearchPaths: true, log: (l) => lines.push(l) });
    expect(loaded.variant).toBe('cpu');
    expect(loaded.reason).toMatch(/^cpu from search path/);
    expect(loaded.source).toBe('search path');
    expect(loaded.skipped).toEqual([]);
    expect(lines.join('\n')).toMatch(/using the cpu backend from search path/);
  });

  it('lists every candidate with its reason, and how to fix it, when nothing loads', () => {
    const empty = join(scratch, 'empty');
    mkdirSync(empty, { recursive: true });
    const noMeta = candidateDir('no-meta', undefined);
    const oldVersion = candidateDir('old', { ...builtMeta, version: '0.0.1' });
    const otherVariant = candidateDir('variant', { ...builtMeta, variant: 'cuda' });
    const error = loadError(() => loadAddon({ backend: 'cpu', searchPaths: [empty, noMeta, oldVersion, otherVariant], onlySearchPaths: true }));
    expect(error.code).toBe('KDTREE_ADDON_LOAD');
    expect(error.requested).toBe('cpu');
    expect(error.attempts.map((a) => a.reason)).toEqual([
      'not built',
      expect.stringMatching(/^no build metadata/),
      expect.stringMatching(/^built for @kdtree\/cuda 0\.0\.1, this is /),
      expect.stringMatching(/^metadata says cuda /),
    ]);
    expect(error.message).toMatch(/could not load a 'cpu' backend/);
    expect(error.message).toContain(join(empty, 'kdtree_cpu.node'));
    expect(error.message).toMatch(/build:native/);
    expect(error.message).toMatch(/KDTREE_BACKEND=cpu\|cuda\|auto/);
    const told = new AddonLoadError(PLATFORM_KEY, 'auto', error.attempts.slice(0, 1), 'name a device from 0 to 1.');
    expect(told.message.split('\n').slice(-2)).toEqual([`  - cpu ${join(empty, 'kdtree_cpu.node')} (search path): not built`, 'Fix: name a device from 0 to 1.']);
  });

  it('auto falls back to cpu when no cuda binary loads, naming what it skipped', () => {
    const dir = candidateDir('auto', builtMeta);
    const loaded = loadAddon({ backend: 'auto', searchPaths: [dir], onlySearchPaths: true });
    expect(loaded.variant).toBe('cpu');
    expect(loaded.reason).toMatch(/skipped cuda .*kdtree_cuda\.node.*not built/);
    expect(loaded.skipped).toEqual([{ candidate: `${join(dir, 'kdtree_cuda.node')} (search path)`, variant: 'cuda', reason: 'not built' }]);
  });

  it('looks for the cuda variant in its own package, after bin/ of @kdtree/cuda, and says how to get it', () => {
    let error: AddonLoadError;
    try {
      loadAddon({ backend: 'cuda' });
      return; // a GPU machine with a cuda build: nothing to fix
    } catch (thrown) {
      if (!(thrown instanceof AddonLoadError)) throw thrown;
      error = thrown;
    }
    // the package is not a dependency here; pnpm's scripts may still resolve it through NODE_PATH
    const last = error.attempts[error.attempts.length - 1];
    expect(last.variant).toBe('cuda');
    expect(last.candidate).toMatch(new RegExp(`^(@kdtree/cuda-${PLATFORM_KEY}-cuda \\(package\\)|.*kdtree_cuda\\.node \\(@kdtree/cuda-${PLATFORM_KEY}-cuda\\))$`));
    if (last.candidate.endsWith('(package)')) expect(last.reason).toBe('not installed');
    expect(error.attempts[0].candidate).toMatch(/\(bin\/ of @kdtree\/cuda\)$/);
    // without a cuda build here: build it; with one (CI builds it) but no driver: install a driver
    expect(error.message).toMatch(/Fix: (The cuda variant is not built: `KDTREE_CUDA=ON pnpm --filter @kdtree\/cuda build:native`|No NVIDIA driver is loaded)/);
  });

  it('rejects an unknown KDTREE_BACKEND', () => {
    const saved = process.env.KDTREE_BACKEND;
    process.env.KDTREE_BACKEND = 'tpu';
    try {
      const error = loadError(() => loadAddon({ searchPaths: [], onlySearchPaths: true }));
      expect(error.attempts[0].reason).toBe("'tpu' is not one of auto, cuda, cpu");
    } finally {
      if (saved === undefined) delete process.env.KDTREE_BACKEND;
      else process.env.KDTREE_BACKEND = saved;
    }
  });
});

describe('probeProblem', () => {
  const h200 = { name: 'NVIDIA H200', computeCapability: '9.0', multiprocessors: 132, totalMemory: 150e9 };
  const probe = (devices: CudaProbe['devices'], ok = true, error = ''): CudaProbe => ({ ok, error, driverVersion: 13000, runtimeVersion: 13000, deviceCount: devices.length, devices });

  it('accepts a device of compute capability 9.0 or newer', () => {
    expect(probeProblem(probe([h200, h200]), 1, true)).toBeUndefined();
  });

  it('lets auto fall back to cpu where no usable GPU is found', () => {
    expect(probeProblem(probe([], false, 'no NVIDIA driver found'), 0, false)).toEqual({ reason: 'no NVIDIA driver found' });
    expect(probeProblem(probe([], false), 0, true)).toEqual({ reason: 'no usable CUDA device' });
    expect(probeProblem(probe([{ ...h200, name: 'NVIDIA A100', computeCapability: '8.0' }]), 0, true)).toEqual({
      reason: 'device 0 (NVIDIA A100) has compute capability 8.0; this binary has sm_90 code (needs 9.0 or newer)',
    });
  });

  it('stops the search when the caller named a device that a machine with GPUs does not have', () => {
    expect(probeProblem(probe([h200, h200]), 2, true)).toEqual({
      reason: 'device 2 does not exist (2 visible)',
      final: true,
      fix: 'name a device from 0 to 1 (CUDA_VISIBLE_DEVICES decides which GPUs this process sees), or choose the cpu backend with KDTREE_BACKEND=cpu.',
    });
    expect(probeProblem(probe([h200]), 1, false)).toEqual({ reason: 'device 1 does not exist (1 visible)', final: false });
    expect(probeProblem(probe([h200]), 1, true)?.fix).toMatch(/^name device 0 \(CUDA_VISIBLE_DEVICES/);
  });
});
