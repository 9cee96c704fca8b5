/**
 * What to do when no binary loads, from why each candidate failed: a missing NVIDIA driver, an old
 * driver, no visible GPU and an old GPU each get their own fix, distinct from a variant that is not
 * installed or not built (which says the install or build command for this platform).
 */
import type { LoadAttempt } from './errors.js';

/** Platforms with prebuilt packages (@kdtree/cuda-<platform>-<arch> and its -cuda twin). */
export const PREBUILT_PLATFORMS: readonly string[] = ['linux-x64'];

/** The package holding a variant's prebuilt binary on a platform. */
export function prebuiltPackage(platformKey: string, variant: 'cpu' | 'cuda'): string {
  return `@kdtree/cuda-${platformKey}${variant === 'cuda' ? '-cuda' : ''}`;
}

export interface FixContext {
  platformKey: string;
  /** @kdtree/cuda's version (undefined inside a bundle). */
  version: string | undefined;
  /** Whether @kdtree/cuda is the repository's packages/cuda (builds with pnpm), not an installed copy. */
  inRepository: boolean;
}

/** The command that builds the addon from source where @kdtree/cuda is. */
export function buildCommand(context: FixContext, cuda: boolean): string {
  const prefix = cuda ? 'KDTREE_CUDA=ON ' : '';
  return context.inRepository ? `${prefix}pnpm --filter @kdtree/cuda build:native` : `${prefix}npx kdtree-build-native`;
}

const NEEDS = 'cmake >= 3.20 and a C++17 compiler';
const MISSING = /^(not built|not installed)$/;

/** One or more lines of fixes, most specific first, ending with the choice of another backend. */
export function howToFix(requested: string, attempts: readonly LoadAttempt[], context: FixContext): string {
  const fixes: string[] = [];
  const prebuilt = PREBUILT_PLATFORMS.includes(context.platformKey);
  const at = context.version ? `@${context.version}` : '';
  const cuda = attempts.filter((a) => a.variant === 'cuda');
  const cpu = attempts.filter((a) => a.variant === 'cpu');
  const reasons = cuda.map((a) => a.reason);
  if (reasons.some((r) => r.startsWith('no NVIDIA driver'))) {
    fixes.push('No NVIDIA driver is loaded on this machine: install the NVIDIA driver (580 or newer, for CUDA 13) for its GPU, or run on the cpu backend.');
  } else if (reasons.some((r) => /^the NVIDIA driver supports CUDA/.test(r))) {
    fixes.push('The NVIDIA driver is older than the CUDA 13 runtime in the cuda variant: update it to 580 or newer, or run on the cpu backend.');
  } else if (reasons.some((r) => /^no CUDA device is visible|^cudaGetDeviceCount|^no usable CUDA device/.test(r))) {
    fixes.push('The driver sees no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES, or run on the cpu backend.');
  } else if (reasons.some((r) => /has compute capability/.test(r))) {
    fixes.push('This GPU is older than the cuda variant supports (compute capability 9.0 or newer: H100, H200): run on the cpu backend.');
  } else if (cuda.length > 0 && cuda.every((a) => MISSING.test(a.reason))) {
    fixes.push(
      context.inRepository
        ? `The cuda variant is not built: \`${buildCommand(context, true)}\` (nvcc 13; the set-up step builds it only on a machine with an NVIDIA GPU).`
        : prebuilt
        ? `The cuda variant is not installed: \`npm install ${prebuiltPackage(context.platformKey, 'cuda')}${at}\` (prebuilt, for an NVIDIA GPU of compute capability 9.0+ and driver 580+), or build it from source: \`${buildCommand(context, true)}\` (${NEEDS}, and nvcc 13).`
        : `No prebuilt cuda variant exists for ${context.platformKey}: build it from source with \`${buildCommand(context, true)}\` (${NEEDS}, and nvcc 13).`,
    );
  }
  if (cpu.length > 0 && cpu.every((a) => MISSING.test(a.reason))) {
    fixes.push(
      context.inRepository
        ? `The cpu variant is not built: \`${buildCommand(context, false)}\` (${NEEDS}).`
        : prebuilt
          ? `The cpu variant is missing: reinstall @kdtree/cuda with its optional dependencies (\`npm install --include=optional\`; it brings ${prebuiltPackage(context.platformKey, 'cpu')}), or build it from source: \`${buildCommand(context, false)}\` (${NEEDS}).`
          : `No prebuilt binaries exist for ${context.platformKey}: build them from source with \`${buildCommand(context, false)}\` in the project that installed @kdtree/cuda (${NEEDS}; nvcc 13 adds the cuda variant).`,
    );
  }
  if (attempts.some((a) => /^built for @kdtree\/cuda /.test(a.reason))) {
    fixes.push(`A binary is from another version of @kdtree/cuda${at ? ` than ${context.version}` : ''}: rebuild it (\`${buildCommand(context, false)}\`), or install the platform packages at @kdtree/cuda's version.`);
  }
  fixes.push(`Or choose another backend: KDTREE_BACKEND=cpu|cuda|auto (requested: ${requested}).`);
  return fixes.join('\n     ');
}
