/**
 * Checks that could crash the process, each run in a child process of its own: a crash (SIGSEGV,
 * an abort) is then a failed check that names the case and the signal, instead of the end of the
 * test runner or of the GPU self-test.
 *
 * A case is a self-contained function: the child runs its source text (fn.toString()), so it may
 * use only its parameters and JavaScript globals, never imports or names from this module. The
 * same text runs under vitest (TypeScript transformed to JavaScript) and from the bundled
 * self-test (tools/gpu/selftest.ts), on whichever variant the parent's backend is.
 */
import { spawnSync } from 'node:child_process';
import type { KdtreeBackend } from '../backend.js';
import type { NativeBackend, NativeBuffer, NativeDtype, NativeModule, TensorArg } from '../native-types.js';
import { fail, type KernelCheck } from './harness.js';

/** What the child hands every case besides the backend. */
export interface ChildHelpers {
  /** The loaded addon module (createBackend for a second backend, build). */
  addon: NativeModule;
  /** Where the addon was loaded from (for a worker thread to load it). */
  addonPath: string;
  kind: 'cpu' | 'cuda';
  device: number;
  /** The child's require (node: modules, e.g. worker_threads). */
  require(id: string): unknown;
  /** A tensor argument over `buffer`. */
  tensor(buffer: NativeBuffer, dtype: NativeDtype, shape: number[], offset?: number): TensorArg;
  /** A new buffer holding `values`' bytes. */
  upload(values: ArrayBufferView): NativeBuffer;
  /** A buffer's contents as f32 (or into `into`, returned). */
  download<T extends ArrayBufferView = Float32Array>(buffer: NativeBuffer, into?: T): T;
  /** Throws a plain Error unless `ok`: the case failed. */
  assert(ok: unknown, message: string): void;
  /** Requires fn to throw an Error whose `code: message` matches `pattern`; returns that text. */
  expectThrows(what: string, fn: () => unknown, pattern: RegExp): string;
  /** Runs the garbage collector until finalizers have run (the child has --expose-gc). */
  collect(): Promise<void>;
}

export interface ChildCase {
  name: string;
  /** Self-contained (see above). Returns normally when it holds; throws otherwise. */
  run(native: NativeBackend, h: ChildHelpers): unknown;
  /** The case must throw an Error whose `code: message` matches this (and nothing else may happen). */
  throws?: RegExp;
}

// The child's side, as JavaScript text: loads the addon, makes the helpers, runs one case, prints
// its outcome on one marked line.
const CHILD_PRELUDE = String.raw`
const [addonPath, kind, device, caseSource] = JSON.parse(process.env.KDTREE_CHILD_CASE);
const addon = require(addonPath);
const native = addon.createBackend(kind, device);
const describeError = (e) => (e && typeof e === 'object' ? (e.code ?? e.name ?? 'Error') + ': ' + e.message : 'non-error ' + String(e));
const h = {
  addon, addonPath, kind, device, require,
  tensor: (buffer, dtype, shape, offset) => (offset === undefined ? { buffer, dtype, shape } : { buffer, dtype, shape, offset }),
  upload(values) { const b = native.alloc(values.byteLength); native.upload(b, values); return b; },
  download(buffer, into) { const out = into ?? new Float32Array(buffer.bytes / 4); native.download(buffer, out); return out; },
  assert(ok, message) { if (!ok) throw new Error('check failed: ' + message); },
  expectThrows(what, fn, pattern) {
    let text;
    try { fn(); } catch (e) { text = describeError(e); }
    if (text === undefined) throw new Error(what + ': did not throw');
    if (!pattern.test(text)) throw new Error(what + ': threw "' + text + '", expected ' + pattern);
    return text;
  },
  async collect() {
    for (let i = 0; i < 4; i++) { globalThis.gc(); await new Promise((r) => setImmediate(r)); }
  },
};
const report = (outcome) => process.stdout.write('\nKDTREE_CHILD_RESULT ' + JSON.stringify(outcome) + '\n');
(async () => {
  const run = (0, eval)('(' + caseSource + ')');
  try {
    await run(native, h);
    native.synchronize();
    report({ threw: false });
  } catch (e) {
    report({ threw: true, text: describeError(e) });
  }
})();
`;

interface Outcome {
  threw: boolean;
  text?: string;
}

/** Runs one case in a child process; returns why it failed, or undefined. */
export function runChildCase(b: KdtreeBackend, c: ChildCase): string | undefined {
  // a case written as a method (`run(native, h) { ... }`) prints as one: made a function expression
  const source = c.run.toString().replace(/^(async\s+)?run\s*\(/, (_, async?: string) => `${async ?? ''}function run(`);
  const env = { ...process.env, KDTREE_CHILD_CASE: JSON.stringify([b.loaded.path, b.kind, b.loaded.device, source]) };
  const r = spawnSync(process.execPath, ['--expose-gc', '-e', CHILD_PRELUDE], { env, encoding: 'utf8', timeout: 120_000, maxBuffer: 1 << 24 });
  const stderr = (r.stderr ?? '').trim().split('\n').slice(0, 8).join(' | ');
  if (r.error) return `the child could not run: ${r.error.message}`;
  if (r.signal) return `crashed the process (${r.signal})${stderr ? `: ${stderr}` : ''}`;
  const line = (r.stdout ?? '').split('\n').find((l) => l.startsWith('KDTREE_CHILD_RESULT '));
  if (!line) return `the child exited ${r.status} without a result${stderr ? `: ${stderr}` : ''}`;
  const outcome = JSON.parse(line.slice('KDTREE_CHILD_RESULT '.length)) as Outcome;
  if (c.throws) {
    if (!outcome.threw) return `did not throw (expected ${c.throws})`;
    if (!c.throws.test(outcome.text ?? '')) return `threw "${outcome.text}", expected ${c.throws}`;
    return undefined;
  }
  return outcome.threw ? `${outcome.text ?? 'threw'}${stderr ? ` (stderr: ${stderr})` : ''}` : undefined;
}

/** A kernel check running each case in its own child process; it fails listing every case that failed. */
export function childCheck(name: string, cases: ChildCase[]): KernelCheck {
  return {
    name,
    run(b) {
      const failures: string[] = [];
      for (const c of cases) {
        const why = runChildCase(b, c);
        if (why !== undefined) failures.push(`${c.name}: ${why}`);
      }
      if (failures.length > 0) fail(`${failures.length} of ${cases.length} cases failed (each in a child process):\n  ${failures.join('\n  ')}`);
      return { detail: `${cases.length} case${cases.length === 1 ? '' : 's'}, each in a child process` };
    },
  };
}
