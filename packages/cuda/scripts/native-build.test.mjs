// The native build's own logic: which variants it builds, what it checks first, what floor a
// binary sets. (The build itself runs in the set-up step; the release dry run builds from an
// installed package.)
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { compareVersions, elfNeeds } from './elf-needs.mjs';
import { cudaDecision } from './native-prerequisites.mjs';

const nvcc = { path: '/usr/local/cuda/bin/nvcc', release: '13.0' };

describe('cudaDecision', () => {
  it('builds the cuda variant unasked only where nvcc and an NVIDIA GPU are both present', () => {
    expect(cudaDecision({}, nvcc, true)).toEqual({ cuda: true, why: 'an NVIDIA GPU and nvcc 13.0' });
    expect(cudaDecision({}, nvcc, false)).toEqual({ cuda: false, why: 'no NVIDIA GPU on this machine (KDTREE_CUDA=ON builds it anyway)', unasked: true });
    // the repository's explicit build:native builds it wherever nvcc is
    expect(cudaDecision({}, nvcc, false, true)).toEqual({ cuda: true, why: 'nvcc 13.0 found (KDTREE_CUDA=OFF skips it)' });
    expect(cudaDecision({ KDTREE_CUDA: 'OFF' }, nvcc, false, true)).toEqual({ cuda: false, why: 'KDTREE_CUDA=OFF' });
    expect(cudaDecision({}, null, true)).toEqual({ cuda: false, why: 'no nvcc found (KDTREE_CUDA=ON with nvcc 13 builds it)' });
  });

  it('follows KDTREE_CUDA, and asking for the cuda variant without nvcc is an error', () => {
    expect(cudaDecision({ KDTREE_CUDA: 'ON' }, nvcc, false)).toEqual({ cuda: true, why: 'KDTREE_CUDA=ON, nvcc 13.0' });
    expect(cudaDecision({ KDTREE_CUDA: 'off' }, nvcc, true)).toEqual({ cuda: false, why: 'KDTREE_CUDA=OFF' });
    expect(cudaDecision({ KDTREE_CUDA: 'ON' }, null, true).problem).toMatch(/^nvcc 13 for KDTREE_CUDA=ON/);
    expect(cudaDecision({ KDTREE_CUDA: 'yes' }, nvcc, true).problem).toBe("KDTREE_CUDA must be ON or OFF, got 'yes'");
  });
});

describe('build-native.mjs', () => {
  it('names every missing tool in one line before building anything', () => {
    const r = spawnSync(process.execPath, [join(import.meta.dirname, 'build-native.mjs')], { encoding: 'utf8', env: { PATH: '/nonexistent', KDTREE_CUDA: 'ON' } });
    expect(r.status).toBe(1);
    const lines = r.stderr.trim().split('\n');
    expect(lines).toHaveLength(1);
    expect(lines[0]).toBe(
      '@kdtree/cuda: cannot build the native addon: missing cmake >= 3.20 (not on PATH; e.g. apt install cmake); a C++17 compiler (no CXX, c++, g++ or clang++ on PATH; e.g. apt install g++); nvcc 13 for KDTREE_CUDA=ON (not in CUDACXX, on PATH or in /usr/local/cuda/bin).'.replace(
        /; nvcc 13 .*$/,
        existsSync('/usr/local/cuda/bin/nvcc') ? '.' : '; nvcc 13 for KDTREE_CUDA=ON (not in CUDACXX, on PATH or in /usr/local/cuda/bin).',
      ),
    );
  });
});

describe('elfNeeds', () => {
  const binary = join(import.meta.dirname, '..', 'bin', `${process.platform}-${process.arch}`, 'kdtree_cpu.node');
  it.runIf(process.platform === 'linux' && existsSync(binary))('reads the newest glibc and GLIBCXX versions the built addon needs', () => {
    const needs = elfNeeds(binary);
    expect(needs.glibc).toMatch(/^2\.\d+$/);
    expect(needs.glibcxx).toMatch(/^3\.4\.\d+$/);
  });

  it('is null for a file that is not an ELF object, and compares versions numerically', () => {
    expect(elfNeeds(join(import.meta.dirname, 'elf-needs.mjs'))).toBeNull();
    expect(compareVersions('2.34', '2.4')).toBeGreaterThan(0);
    expect(compareVersions('3.4.30', '3.4.30')).toBe(0);
    expect(compareVersions('2.17', '2.32')).toBeLessThan(0);
  });
});
