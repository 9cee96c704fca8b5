import { describe, expect, it } from 'vitest';
import type { LoadAttempt } from './errors.js';
import { howToFix, prebuiltPackage } from './load-fix.js';

const installed = { platformKey: 'linux-x64', version: '0.1.0', inRepository: false };
const repo = { ...installed, inRepository: true };
const cuda = (reason: string, candidate = '/app/node_modules/@kdtree/cuda-linux-x64-cuda/bin/kdtree_cuda.node'): LoadAttempt => ({ candidate, variant: 'cuda', reason });
const cpu = (reason: string): LoadAttempt => ({ candidate: '/app/node_modules/@kdtree/cuda/bin/linux-x64/kdtree_cpu.node', variant: 'cpu', reason });

describe('howToFix', () => {
  it('names the packages of each variant', () => {
    expect(prebuiltPackage('linux-x64', 'cpu')).toBe('@kdtree/cuda-linux-x64');
    expect(prebuiltPackage('linux-x64', 'cuda')).toBe('@kdtree/cuda-linux-x64-cuda');
  });

  it('tells a machine without an NVIDIA driver to install one, not to build or install the binary', () => {
    const fix = howToFix('cuda', [cuda('no NVIDIA driver found (libcuda.so.1 is not loadable)')], installed);
    expect(fix).toMatch(/^No NVIDIA driver is loaded on this machine: install the NVIDIA driver \(580 or newer, for CUDA 13\)/);
    expect(fix).not.toMatch(/kdtree-build-native|npm install/);
    expect(fix).toMatch(/KDTREE_BACKEND=cpu\|cuda\|auto \(requested: cuda\)\.$/);
  });

  it('tells an old driver, no visible GPU and an old GPU apart', () => {
    expect(howToFix('cuda', [cuda('the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0 runtime this addon was built with')], installed)).toMatch(/^The NVIDIA driver is older .* update it to 580 or newer/);
    expect(howToFix('cuda', [cuda('no CUDA device is visible')], installed)).toMatch(/^The driver sees no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES/);
    expect(howToFix('cuda', [cuda('device 0 (NVIDIA A100) has compute capability 8.0; this binary has sm_90 code (needs 9.0 or newer)')], installed)).toMatch(/^This GPU is older than the cuda variant supports/);
  });

  it('tells an installed package without the cuda variant how to install it or build it', () => {
    const fix = howToFix('cuda', [cuda('not built'), cuda('not installed', '@kdtree/cuda-linux-x64-cuda (package)')], installed);
    expect(fix).toContain('`npm install @kdtree/cuda-linux-x64-cuda@0.1.0`');
    expect(fix).toContain('`KDTREE_CUDA=ON npx kdtree-build-native`');
  });

  it('tells the repository to build, and an installed copy without its cpu package to reinstall or build', () => {
    expect(howToFix('cpu', [cpu('not built'), cpu('not installed')], repo)).toMatch(/^The cpu variant is not built: `pnpm --filter @kdtree\/cuda build:native`/);
    expect(howToFix('cuda', [cuda('not built'), cuda('not installed')], repo)).toMatch(/^The cuda variant is not built: `KDTREE_CUDA=ON pnpm --filter @kdtree\/cuda build:native`/);
    const fix = howToFix('cpu', [cpu('not built'), cpu('not installed')], installed);
    expect(fix).toMatch(/reinstall @kdtree\/cuda with its optional dependencies .*@kdtree\/cuda-linux-x64\)/);
    expect(fix).toContain('`npx kdtree-build-native`');
  });

  it('tells a platform without prebuilt packages to build from source', () => {
    const fix = howToFix('auto', [cuda('not built'), cuda('not installed'), cpu('not built'), cpu('not installed')], { ...installed, platformKey: 'darwin-arm64' });
    expect(fix).toContain('No prebuilt cuda variant exists for darwin-arm64');
    expect(fix).toContain('No prebuilt binaries exist for darwin-arm64: build them from source with `npx kdtree-build-native`');
  });

  it('says to rebuild a binary of another version', () => {
    expect(howToFix('cpu', [cpu('built for @kdtree/cuda 0.0.9, this is 0.1.0 (rebuild it)')], installed)).toMatch(/^A binary is from another version of @kdtree\/cuda than 0\.1\.0: rebuild it \(`npx kdtree-build-native`\)/);
  });
});
