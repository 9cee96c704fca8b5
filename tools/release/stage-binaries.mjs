#!/usr/bin/env node
// Copies the binaries build-native.mjs put in packages/cuda/bin/<platform>-<arch>/ into the
// platform packages of this platform (the cpu variant into @kdtree/cuda-<platform>-<arch>, the cuda
// variant into @kdtree/cuda-<platform>-<arch>-cuda), replacing what they held.
//   node tools/release/stage-binaries.mjs     prints what it staged and what it could not
import { copyFileSync, existsSync, mkdirSync, renameSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { platformPackages, ROOT } from './workspace.mjs';

/** Stages this platform's variants; returns { staged: names, missing: names whose variant was not built }. */
export function stageBinaries(root = ROOT) {
  const built = join(root, 'packages', 'cuda', 'bin', `${process.platform}-${process.arch}`);
  const staged = [];
  const missing = [];
  for (const p of platformPackages(root)) {
    const { os, cpu, kdtree, name } = p.manifest;
    if (os[0] !== process.platform || cpu[0] !== process.arch) continue;
    const bin = join(p.dir, 'bin');
    rmSync(bin, { recursive: true, force: true });
    const files = [`kdtree_${kdtree.variant}.node`, `kdtree_${kdtree.variant}.json`];
    if (!files.every((f) => existsSync(join(built, f)))) {
      missing.push(name);
      continue;
    }
    mkdirSync(bin, { recursive: true });
    for (const f of files) {
      copyFileSync(join(built, f), join(bin, `${f}.tmp`));
      renameSync(join(bin, `${f}.tmp`), join(bin, f));
    }
    staged.push(name);
  }
  return { staged, missing };
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const { staged, missing } = stageBinaries();
  for (const name of staged) console.log(`staged ${name}`);
  for (const name of missing) console.log(`not staged ${name}: its variant is not built in packages/cuda/bin/${process.platform}-${process.arch}/`);
}
