#!/usr/bin/env node
// The pack-time check of a platform package (its `prepack`): it is refused unless it holds its
// binary and build metadata, both for this version of @kdtree/cuda and this platform, and the
// binary needs no newer glibc / libstdc++ than the floor its package.json (and README) state.
//   node tools/release/check-platform-package.mjs [package dir]     (default: the current directory)
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { compareVersions, elfNeeds } from '../../packages/cuda/scripts/elf-needs.mjs';

/** Every reason the package in `dir` must not be packed (empty: it may). */
export function platformPackageProblems(dir, mainVersion = readMainVersion(dir)) {
  const pkg = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8'));
  const problems = [];
  const variant = pkg.kdtree?.variant;
  if (variant !== 'cpu' && variant !== 'cuda') return [`package.json: kdtree.variant must be 'cpu' or 'cuda', got ${JSON.stringify(variant)}`];
  const [os, cpu] = [pkg.os?.[0], pkg.cpu?.[0]];
  if (!os || !cpu || !Array.isArray(pkg.libc)) problems.push('package.json: os, cpu and libc must each name the platform');
  const expectedName = `@kdtree/cuda-${os}-${cpu}${variant === 'cuda' ? '-cuda' : ''}`;
  if (pkg.name !== expectedName) problems.push(`package.json: the ${variant} variant for ${os}-${cpu} must be named ${expectedName}, got ${pkg.name}`);
  if (mainVersion !== undefined && pkg.version !== mainVersion) problems.push(`version ${pkg.version} is not @kdtree/cuda's ${mainVersion} (they are one changesets fixed group)`);
  const binary = join(dir, 'bin', `kdtree_${variant}.node`);
  const metaPath = join(dir, 'bin', `kdtree_${variant}.json`);
  for (const f of [binary, metaPath]) if (!pkg.files?.includes(`bin/${f.split('/').pop()}`)) problems.push(`package.json: files must list bin/${f.split('/').pop()}`);
  if (!existsSync(binary) || statSync(binary).size === 0) {
    problems.push(`no binary: ${binary} (run node tools/release/stage-binaries.mjs after building the ${variant} variant)`);
  }
  if (!existsSync(metaPath)) {
    problems.push(`no build metadata: ${metaPath}`);
    return problems;
  }
  let meta;
  try {
    meta = JSON.parse(readFileSync(metaPath, 'utf8'));
  } catch (error) {
    return [...problems, `unreadable build metadata ${metaPath}: ${error.message}`];
  }
  const want = { name: '@kdtree/cuda', version: pkg.version, variant, platform: os, arch: cpu };
  for (const [key, value] of Object.entries(want)) if (meta[key] !== value) problems.push(`build metadata: ${key} is ${JSON.stringify(meta[key])}, expected ${JSON.stringify(value)}`);
  if (variant === 'cuda' && !meta.cudaVersion) problems.push('build metadata: a cuda variant must record its cudaVersion');
  if (existsSync(binary) && os === 'linux') {
    const needs = elfNeeds(binary);
    if (needs === null) problems.push(`${binary} is not a 64-bit ELF shared object`);
    else {
      for (const lib of ['glibc', 'glibcxx']) {
        const floor = pkg.kdtree?.floor?.[lib];
        if (!floor) problems.push(`package.json: kdtree.floor.${lib} (the platform floor the README states) is missing`);
        else if (needs[lib] && compareVersions(needs[lib], floor) > 0) problems.push(`the binary needs ${lib} ${needs[lib]}, newer than the stated floor ${floor} (build it on an older system, or raise the floor in package.json and the README)`);
      }
    }
  }
  return problems;
}

function readMainVersion(dir) {
  const main = join(dir, '..', 'cuda', 'package.json');
  return existsSync(main) ? JSON.parse(readFileSync(main, 'utf8')).version : undefined;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const dir = resolve(process.argv[2] ?? process.cwd());
  const problems = platformPackageProblems(dir);
  if (problems.length > 0) {
    const name = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8')).name;
    console.error(`${name} cannot be packed:\n${problems.map((p) => `  - ${p}`).join('\n')}`);
    process.exit(1);
  }
}
