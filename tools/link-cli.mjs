#!/usr/bin/env node
// Puts a `kdtree` command on PATH that runs this checkout's CLI (after the set-up step): a small
// shell script in ~/.local/bin (or --dir DIR) that execs Node on packages/cli/dist/bin.js. It works
// offline, needs no global package install, and follows the checkout: rebuilds take effect at once.
//   node tools/link-cli.mjs [--dir DIR]      then `kdtree --help` from any directory
//   node tools/link-cli.mjs --remove [--dir DIR]
import { chmodSync, existsSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { delimiter, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const MARK = '# kdtree: written by tools/link-cli.mjs';
const args = process.argv.slice(2);
const at = args.indexOf('--dir');
if (at >= 0 && !args[at + 1]) {
  console.error('link-cli: --dir needs a directory');
  process.exit(2);
}
const dir = resolve(at >= 0 ? args[at + 1] : join(homedir(), '.local', 'bin'));
const target = join(dir, 'kdtree');
const bin = fileURLToPath(new URL('../packages/cli/dist/bin.js', import.meta.url));

if (existsSync(target) && !readFileSync(target, 'utf8').includes(MARK)) {
  console.error(`link-cli: ${target} exists and was not written by this script; remove it or choose another --dir`);
  process.exit(1);
}
if (args.includes('--remove')) {
  rmSync(target, { force: true });
  console.log(`link-cli: removed ${target}`);
  process.exit(0);
}
if (!existsSync(bin)) {
  console.error(`link-cli: ${bin} is not built: run \`npm run setup\` first`);
  process.exit(1);
}
mkdirSync(dir, { recursive: true });
const quote = (s) => `'${s.replace(/'/g, `'\\''`)}'`;
writeFileSync(`${target}.tmp`, `#!/bin/sh\n${MARK}\nexec ${quote(process.execPath)} ${quote(bin)} "$@"\n`);
chmodSync(`${target}.tmp`, 0o755);
renameSync(`${target}.tmp`, target);
const onPath = (process.env.PATH ?? '').split(delimiter).some((d) => resolve(d) === dir);
console.log(`link-cli: ${target} runs ${bin}${onPath ? '' : `\nlink-cli: ${dir} is not on your PATH; add it (e.g. export PATH="${dir}:$PATH" in your shell profile)`}`);
