#!/usr/bin/env node
// The README's set-up step: install the locked dependencies and build every package (turbo caches
// what did not change, so running it before every command costs a second when nothing changed).
import { runPnpm } from './run-pnpm.mjs';

const steps = [
  ['install', '--frozen-lockfile', '--reporter=append-only'],
  ['exec', 'turbo', 'run', 'build', '--output-logs=errors-only'],
];
for (const args of steps) {
  const status = runPnpm(args);
  if (status !== 0) {
    console.error(`kdtree setup: 'pnpm ${args.join(' ')}' failed with exit code ${status}`);
    process.exit(status);
  }
}
