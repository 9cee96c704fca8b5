import { existsSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { runCli } from './test-support/run-cli.js';

/** What `kdtree backend --json` prints when a backend loads. */
interface BackendReport {
  schema: 'kdtree.backend/1';
  ok: true;
  backend: 'cpu' | 'cuda';
  source: string;
  path: string;
  build: { version: string; variant: string; platform: string; arch: string };
  device: { kind: string; name: string; threads?: number };
  skipped: { candidate: string; variant: string; reason: string }[];
}

describe('kdtree backend', () => {
  it('reports the cpu backend, its binary, build and device', () => {
    const r = runCli(['backend', '--backend', 'cpu', '--json']);
    expect(r.status, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout) as BackendReport;
    expect(Object.keys(report)).toEqual(['schema', 'ok', 'backend', 'source', 'path', 'build', 'device', 'skipped']);
    expect(report).toMatchObject({ schema: 'kdtree.backend/1', ok: true, backend: 'cpu', source: 'bin/ of @kdtree/cuda', skipped: [] });
    expect(report.path).toMatch(/kdtree_cpu\.node$/);
    expect(existsSync(report.path)).toBe(true);
    expect(report.build).toMatchObject({ variant: 'cpu', platform: process.platform, arch: process.arch });
    expect(Object.keys(report.device)).toEqual(['kind', 'name', 'threads']);
    expect(report.device.kind).toBe('cpu');
    expect(report.device.name).toBe(`cpu (${report.device.threads} threads)`);

    const text = runCli(['backend', '--backend', 'cpu']);
    expect(text.status, text.stderr).toBe(0);
    expect(text.stdout).toMatch(/^backend {2}cpu, from bin\/ of @kdtree\/cuda\n/);
    expect(text.stdout).toContain(`binary   ${report.path}\n`);
    expect(text.stdout).toMatch(/\nbuild {4}@kdtree\/cuda \d+\.\d+\.\d+\S* \(cpu, /);
    expect(text.stdout).toMatch(/\ndevice {3}cpu \(\d+ threads\)\n$/);
  });

  it('auto names every cuda candidate it skipped, or reports the GPU it chose', () => {
    const report = JSON.parse(runCli(['backend', '--backend', 'auto', '--json']).stdout) as BackendReport;
    if (report.backend === 'cuda') {
      expect(Object.keys(report.device)).toEqual(['kind', 'index', 'name', 'compute_capability', 'multiprocessors', 'total_memory', 'driver_version', 'runtime_version']);
      expect(report.device).toMatchObject({ kind: 'cuda', index: 0 });
      expect(report.build.variant).toBe('cuda');
    } else {
      expect(report.backend).toBe('cpu');
      expect(report.skipped.length).toBeGreaterThan(0);
      for (const s of report.skipped) {
        expect(s.variant).toBe('cuda');
        expect(s.candidate).toMatch(/kdtree_cuda\.node \(.+\)$/);
        expect(s.reason.length).toBeGreaterThan(0);
      }
      const text = runCli(['backend', '--backend', 'auto']).stdout;
      expect(text).toContain(`\nskipped  cuda ${report.skipped[0].candidate}: ${report.skipped[0].reason}`);
    }
  });

  it('lists every candidate and how to fix it when the requested backend does not load', () => {
    const loaded = JSON.parse(runCli(['backend', '--backend', 'cuda', '--json']).stdout) as BackendReport | { ok: false; requested: string; platform: string; attempts: unknown[] };
    if (loaded.ok) return expect(loaded.backend).toBe('cuda'); // a machine with a GPU and a cuda build
    expect(loaded).toMatchObject({ schema: 'kdtree.backend/1', ok: false, requested: 'cuda', platform: `${process.platform}-${process.arch}` });
    expect(loaded.attempts.length).toBeGreaterThan(0);
    const r = runCli(['backend', '--backend', 'cuda']);
    expect(r.status).toBe(1);
    expect(r.stdout).toBe('');
    expect(r.stderr).toMatch(/^kdtree: error: @kdtree\/cuda: could not load a 'cuda' backend on \S+\. Tried:\n {2}- cuda /);
    // the fix follows the reason: without a cuda build, the command that builds it; with one (CI
    // builds it) on a machine without a driver, installing the driver
    expect(r.stderr).toMatch(/\nFix: (The cuda variant is not built: `KDTREE_CUDA=ON pnpm --filter @kdtree\/cuda build:native`|No NVIDIA driver is loaded on this machine)/);
  });

  it('rejects a bad --backend, --device or KDTREE_BACKEND', () => {
    const kind = runCli(['backend', '--backend', 'gpu']);
    expect(kind.status).toBe(2);
    expect(kind.stderr).toMatch(/--backend: expected one of auto, cuda, cpu, got 'gpu'/);
    const device = runCli(['backend', '--device=-1']);
    expect(device.status).toBe(2);
    expect(device.stderr).toMatch(/--device: must be in \[0, \d+\], got '-1'/);
    expect(runCli(['backend', '--device', '-1']).stderr).toMatch(/--device: must be in \[0, \d+\], got '-1'/);
    const env = runCli(['backend'], { env: { KDTREE_BACKEND: 'tpu' } });
    expect(env.status).toBe(1);
    expect(env.stderr).toMatch(/'tpu' is not one of auto, cuda, cpu/);
  });
});
