import { readFileSync } from 'node:fs';
import { Progress, type ProgressOptions } from './progress.js';

/** Where a command writes: injectable so tests can run commands in-process. */
export interface CommandIO {
  out(text: string): void;
  /** stdout without a newline (tokens streaming as they are decoded). */
  write(text: string): void;
  err(text: string): void;
  progress(label: string, total: number, options?: ProgressOptions): Progress;
}

export function processIO(options: { quiet?: boolean } = {}): CommandIO {
  return {
    out: (text) => process.stdout.write(`${text}\n`),
    write: (text) => process.stdout.write(text),
    err: (text) => process.stderr.write(`${text}\n`),
    progress: (label, total, progressOptions) => new Progress(label, total, { enabled: !options.quiet, ...progressOptions }),
  };
}

export const CLI_VERSION: string = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')).version;

/** Stable JSON for scripts: two-space indented, one trailing newline added by `out`. */
export function json(value: unknown): string {
  return JSON.stringify(value, null, 2);
}
