#!/usr/bin/env node
// Runs the pinned pnpm with the given arguments. Machines with only Node 20 and npm have no pnpm,
// so fall back to `npx pnpm@<pinned>`; a pnpm already on PATH is used only when it is the pinned one.
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const root = fileURLToPath(new URL('..', import.meta.url));
const pinned = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8'))
  .packageManager.replace(/^pnpm@/, '');

function pnpmCommand() {
  const probe = spawnSync('pnpm', ['--version'], { encoding: 'utf8' });
  if (probe.status === 0 && probe.stdout.trim() === pinned) return ['pnpm', []];
  return ['npx', ['--yes', `pnpm@${pinned}`]];
}

export function runPnpm(args, options = {}) {
  const [cmd, prefix] = pnpmCommand();
  const result = spawnSync(cmd, [...prefix, ...args], { stdio: 'inherit', cwd: root, ...options });
  if (result.error) throw result.error;
  return result.status ?? 1;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  process.exit(runPnpm(process.argv.slice(2)));
}
