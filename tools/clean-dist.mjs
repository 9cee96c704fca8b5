#!/usr/bin/env node
// Removes a package's dist/ before tsc writes it again: tsc never deletes outputs, so files of a
// renamed or removed source (or maps from an earlier configuration) would otherwise be published.
//   node ../../tools/clean-dist.mjs     (from a package directory)
import { rmSync } from 'node:fs';

rmSync('dist', { recursive: true, force: true });
