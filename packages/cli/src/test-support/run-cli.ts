import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';

const BIN = fileURLToPath(new URL('../../dist/bin.js', import.meta.url));

export interface CliResult {
  status: number;
  stdout: string;
  stderr: string;
}

/** Runs the built `kdtree` binary as a user would (a real process, real exit code). */
export function runCli(args: string[], options: { cwd?: string; env?: NodeJS.ProcessEnv; timeoutMs?: number } = {}): CliResult {
  // timeoutMs: a process still running then is killed (status -1), so a hang fails the test instead of stalling it
  const r = spawnSync(process.execPath, [BIN, ...args], { encoding: 'utf8', cwd: options.cwd, env: { ...process.env, ...options.env }, maxBuffer: 64 << 20, timeout: options.timeoutMs });
  return { status: r.status ?? -1, stdout: r.stdout, stderr: r.stderr };
}
