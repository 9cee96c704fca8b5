#!/usr/bin/env node
// The published @kdtree/cuda carries the addon's C++/CUDA sources, so that a platform without a
// prebuilt binary builds one with `npx kdtree-build-native`. They live at the repository's root
// (native/): `prepack` copies them into the package (`node pack-native-sources.mjs copy`) and
// `postpack` removes the copy (`remove`); build-native.mjs ignores a copy inside the repository.
import { cpSync, existsSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const pkgDir = fileURLToPath(new URL('..', import.meta.url));
const source = join(pkgDir, '..', '..', 'native');
const copy = join(pkgDir, 'native');
const mode = process.argv[2];

if (mode === 'copy') {
  if (!existsSync(join(source, 'CMakeLists.txt'))) {
    console.error(`@kdtree/cuda: no native sources at ${source}; pack @kdtree/cuda from the repository`);
    process.exit(1);
  }
  rmSync(copy, { recursive: true, force: true });
  cpSync(source, copy, { recursive: true });
} else if (mode === 'remove') {
  rmSync(copy, { recursive: true, force: true });
} else {
  console.error('usage: node scripts/pack-native-sources.mjs copy|remove');
  process.exit(2);
}
