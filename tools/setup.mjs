#!/usr/bin/env node
// The README's set-up step: check the native build's prerequisites, install the locked
// dependencies, build the native addon (showing what it builds and why), then build every package
// (turbo caches what did not change, so running it before every command costs a second when
// nothing changed).
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { checkPrerequisites, missingLine } from '../packages/cuda/scripts/native-prerequisites.mjs';
import { runPnpm } from './run-pnpm.mjs';

const root = fileURLToPath(new URL('..', import.meta.url));

// before anything is installed: the one line that says what is missing
const prerequisites = checkPrerequisites();
if (prerequisites.problems) {
  console.error(missingLine(prerequisites.problems));
  console.error('kdtree setup: Node.js 20 and npm install and build the TypeScript packages; the @kdtree/cuda addon also needs the tools above.');
  process.exit(1);
}

const steps = [
  ['pnpm', ['install', '--frozen-lockfile', '--reporter=append-only']],
  // its own step, so that its progress shows (turbo below prints only errors)
  ['node', ['packages/cuda/scripts/build-native.mjs']],
  ['pnpm', ['exec', 'turbo', 'run', 'build', '--output-logs=errors-only']],
];
for (const [tool, args] of steps) {
  const status = tool === 'pnpm' ? runPnpm(args) : (spawnSync(process.execPath, args, { cwd: root, stdio: 'inherit' }).status ?? 1);
  if (status !== 0) {
    console.error(`kdtree setup: '${tool} ${args.join(' ')}' failed with exit code ${status}`);
    process.exit(status);
  }
}
