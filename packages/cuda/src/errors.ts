/** Errors of @kdtree/cuda. Native ops throw plain Errors with a `code` (KDTREE_INVALID_ARGUMENT, ...). */
export interface LoadAttempt {
  candidate: string;
  variant: 'cuda' | 'cpu';
  reason: string;
}

/** Nothing could be loaded: lists every candidate tried, why each failed, and how to fix it. */
export class AddonLoadError extends Error {
  readonly code = 'KDTREE_ADDON_LOAD';
  constructor(
    readonly platformKey: string,
    readonly requested: string,
    readonly attempts: LoadAttempt[],
    /** How to fix it (the loader derives it from the attempts: load-fix.ts). */
    fix?: string,
  ) {
    const lines = attempts.length
      ? attempts.map((a) => `  - ${a.variant} ${a.candidate}: ${a.reason}`)
      : ['  (no candidate binary exists for this platform)'];
    super(
      [
        `@kdtree/cuda: could not load a '${requested}' backend on ${platformKey}. Tried:`,
        ...lines,
        `Fix: ${
          fix ??
          'install @kdtree/cuda with its optional dependencies (the prebuilt cpu variant), or build the addon from source: `npx kdtree-build-native` where it is installed, `pnpm --filter @kdtree/cuda build:native` in the repository; or choose another backend with KDTREE_BACKEND=cpu|cuda|auto.'
        }`,
      ].join('\n'),
    );
    this.name = 'AddonLoadError';
  }
}

/** The codes of the errors a native op throws (the binding's Status codes). */
export const NATIVE_ERROR_CODES = ['KDTREE_INVALID_ARGUMENT', 'KDTREE_UNSUPPORTED', 'KDTREE_DEVICE_ERROR', 'KDTREE_OUT_OF_MEMORY'] as const;
export type NativeErrorCode = (typeof NATIVE_ERROR_CODES)[number];

/** A native op failed: the message names the op and every tensor with its dtype and shape. */
export interface NativeError extends Error {
  code: NativeErrorCode;
}

/** Whether `error` is an op's error (one of NATIVE_ERROR_CODES); an AddonLoadError, or any other KDTREE_ code, is not. */
export function isNativeError(error: unknown): error is NativeError {
  const code = error instanceof Error ? (error as Error & { code?: unknown }).code : undefined;
  return typeof code === 'string' && (NATIVE_ERROR_CODES as readonly string[]).includes(code);
}
