#!/usr/bin/env node
// The release: version with changesets, build every platform package of this platform (the cpu
// and cuda variants: KDTREE_CUDA=ON), run the dry run's checks on the packed tarballs, publish
// with `changeset publish`. Run it from a clean checkout of main on linux-x64 with nvcc 13 and
// npm credentials (NPM_TOKEN or npm login); it commits nothing and pushes nothing.
//   node tools/release/release.mjs            version, build, check, publish
//   node tools/release/release.mjs --dry-run  build, stage, pack, install the tarballs and check them (CI)
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { runPnpm } from '../run-pnpm.mjs';
import { dryRun } from './dry-run.mjs';
import { platformPackages, ROOT } from './workspace.mjs';

const say = (line) => console.log(`release: ${line}`);

function step(what, status) {
  if (status !== 0) throw new Error(`${what} failed (exit ${status})`);
}

function git(args) {
  const r = spawnSync('git', args, { cwd: ROOT, encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`git ${args.join(' ')}: ${r.stderr.trim()}`);
  return r.stdout.trim();
}

export function release() {
  if (git(['status', '--porcelain']) !== '') throw new Error('the checkout has uncommitted changes: release from a clean checkout of main');
  const here = `${process.platform}-${process.arch}`;
  const elsewhere = platformPackages().filter((p) => `${p.manifest.os[0]}-${p.manifest.cpu[0]}` !== here);
  if (elsewhere.length > 0) throw new Error(`platform packages for other platforms need their own build machine: ${elsewhere.map((p) => p.manifest.name).join(', ')}`);

  say('versioning (changeset version: package versions, CHANGELOG.md files; the fixed group moves together)');
  step('changeset version', runPnpm(['exec', 'changeset', 'version']));
  say('building every package, the cuda variant included (KDTREE_CUDA=ON)');
  const env = { ...process.env, KDTREE_CUDA: 'ON' };
  step('set-up', spawnSync(process.execPath, ['tools/setup.mjs'], { cwd: ROOT, stdio: 'inherit', env }).status ?? 1);
  const { skipped } = dryRun();
  if (skipped.length > 0) throw new Error(`not every platform package was built: ${skipped.join(', ')}`);
  say('publishing (changeset publish: each package not yet on the registry at its version; prepack checks run again)');
  step('changeset publish', runPnpm(['exec', 'changeset', 'publish'], { env }));
  say('published. Commit the versions and CHANGELOG.md files, and push them with the tags changeset publish made (git push --follow-tags).');
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  try {
    if (process.argv.includes('--dry-run')) dryRun({ keep: process.argv.includes('--keep') });
    else release();
  } catch (error) {
    console.error(`release failed: ${error.message}`);
    process.exit(1);
  }
}
