#!/usr/bin/env node
// `pnpm kdtree <args>` at the repository (the root package.json's "kdtree" script): a package
// manager runs scripts in the repository root, so the CLI would resolve relative paths there.
// INIT_CWD (set by pnpm and npm) is the directory the user ran the command from.
if (process.env.INIT_CWD) process.chdir(process.env.INIT_CWD);
await import('../packages/cli/dist/bin.js');
