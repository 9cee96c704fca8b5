import { readFileSync } from 'node:fs';
import { Progress, type ProgressOptions } from './progress.js';

/** Where a command writes: injectable so tests can run commands in-process. */
export interface CommandIO {
  out(text: string): void;
  /** stdout without a newline (tokens streaming as they are decoded). */
  write(text: string): void;
  err(text: string): void;
  progress(label: string, total: number, options?: ProgressOptions): Progress;
  /**
   * stdout and stderr are one terminal: a stderr line written while streamed tokens leave a
   * stdout line open must end that line first. Elsewhere (pipes, files, tests) that newline would
   * be a blank line in the stderr log.
   */
  sharedTerminal?: boolean;
}

const closedStreams = new WeakSet<NodeJS.WritableStream>();
const guardedStreams = new WeakSet<NodeJS.WritableStream>();

/**
 * A reader that goes away (`kdtree inspect big.kdtr | head -3`) makes the next write fail with
 * EPIPE, which Node raises as an unhandled 'error' event: a stack trace and exit 1 for what is
 * the reader's normal way of saying "enough". Such a stream is marked closed and later writes to
 * it are dropped; the command finishes and exits as it would have.
 */
export function quietOnClosedPipe(stream: NodeJS.WritableStream): void {
  if (guardedStreams.has(stream)) return;
  guardedStreams.add(stream);
  stream.on('error', (error: NodeJS.ErrnoException) => {
    if (error.code === 'EPIPE') closedStreams.add(stream);
    else throw error;
  });
}

function writeLine(stream: NodeJS.WritableStream, text: string): void {
  if (!closedStreams.has(stream)) stream.write(`${text}\n`);
}

export function processIO(options: { quiet?: boolean } = {}): CommandIO {
  quietOnClosedPipe(process.stdout);
  quietOnClosedPipe(process.stderr);
  return {
    out: (text) => writeLine(process.stdout, text),
    write: (text) => {
      if (!closedStreams.has(process.stdout)) process.stdout.write(text);
    },
    err: (text) => writeLine(process.stderr, text),
    progress: (label, total, progressOptions) => new Progress(label, total, { enabled: !options.quiet, ...progressOptions }),
    sharedTerminal: Boolean(process.stdout.isTTY && process.stderr.isTTY),
  };
}

export const CLI_VERSION: string = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')).version;

/** Stable JSON for scripts: two-space indented, one trailing newline added by `out`. */
export function json(value: unknown): string {
  return JSON.stringify(value, null, 2);
}

/**
 * A command's --json output: `schema` first (`kdtree.<command>/<version>`; the version changes
 * only when a field is removed or changes meaning, fields are only ever added), then the fields,
 * snake_case throughout. The schemas are documented in packages/cli/README.md.
 */
export function jsonReport(schema: `kdtree.${string}/${number}`, fields: Record<string, unknown>): string {
  return json({ schema, ...fields });
}
