#!/usr/bin/env node
// The release dry run (CI runs it after `npm test`): everything a release does short of versioning
// and publishing, checked from the outside as a user would meet it.
//  1. stage this platform's built binaries into its platform packages;
//  2. pack every public package with pnpm (as `changeset publish` would: workspace: ranges
//     replaced, prepack checks run) and check each tarball's files and package.json;
//  3. install the tarballs into an empty project outside the repository (third-party
//     dependencies come from the npm registry), import each package there, load the cpu backend,
//     check that the cuda package resolves, run the `kdtree` command, and build the addon from
//     the installed package's sources with its one documented command.
//   node tools/release/dry-run.mjs [--keep]     (--keep: leave the temporary project and print its path)
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, posix } from 'node:path';
import { fileURLToPath } from 'node:url';
import { runPnpm } from '../run-pnpm.mjs';
import { platformPackageProblems } from './check-platform-package.mjs';
import { stageBinaries } from './stage-binaries.mjs';
import { readTarball } from './tarball.mjs';
import { publicPackages, ROOT } from './workspace.mjs';

const say = (line) => console.log(`release dry run: ${line}`);

/** Fields every published package.json carries (npm shows them; the release check requires them). */
export const REQUIRED_FIELDS = ['name', 'version', 'description', 'keywords', 'homepage', 'bugs', 'repository', 'license'];

/** Every reason a packed package (`files`: path -> bytes, as in the tarball) is not fit to publish. */
export function tarballProblems(files, license) {
  const problems = [];
  const manifestBytes = files.get('package.json');
  if (!manifestBytes) return ['no package.json'];
  const manifest = JSON.parse(manifestBytes.toString('utf8'));
  for (const field of REQUIRED_FIELDS) {
    const v = manifest[field];
    if (v === undefined || (Array.isArray(v) && v.length === 0)) problems.push(`package.json has no ${field}`);
  }
  if (manifest.license !== 'MIT') problems.push(`license is ${manifest.license}, not MIT`);
  if (!files.has('LICENSE')) problems.push('no LICENSE file');
  else if (license !== undefined && !files.get('LICENSE').equals(license)) problems.push("LICENSE differs from the repository's");
  if (!files.has('README.md')) problems.push('no README.md');
  if (manifestBytes.toString('utf8').includes('workspace:')) problems.push('package.json still has workspace: ranges');
  for (const path of files.keys()) {
    if (/\.test\.[cm]?[jt]s$/.test(path) || path.startsWith('dist/testing/')) problems.push(`ships a test file: ${path}`);
    if (path.endsWith('.map')) {
      // a source map must point at sources the package ships
      const map = JSON.parse(files.get(path).toString('utf8'));
      for (const source of map.sources ?? []) {
        const target = posix.normalize(posix.join(posix.dirname(path), map.sourceRoot ?? '', source));
        if (!files.has(target)) problems.push(`${path} points at ${target}, which the package does not ship`);
      }
    }
  }
  const entries = [manifest.main, manifest.types, ...Object.values(manifest.bin ?? {})].filter(Boolean).map((p) => posix.normalize(p));
  for (const entry of entries) if (!files.has(entry)) problems.push(`package.json names ${entry}, which the package does not ship`);
  if (manifest.name === '@kdtree/cuda') {
    if (!files.has('native/CMakeLists.txt')) problems.push('no native/ sources (kdtree-build-native builds from them)');
    if ([...files.keys()].some((p) => p.startsWith('bin/'))) problems.push('ships bin/: the binaries belong in the platform packages');
    for (const [dep, range] of Object.entries(manifest.optionalDependencies ?? {})) {
      if (range !== manifest.version) problems.push(`optionalDependencies.${dep} is ${range}, not the exact version ${manifest.version}`);
    }
  }
  if (manifest.kdtree?.variant) {
    const extra = [...files.keys()].filter((p) => !['package.json', 'README.md', 'LICENSE', ...(manifest.files ?? [])].includes(p));
    if (extra.length > 0) problems.push(`ships files beyond its binary and metadata: ${extra.join(', ')}`);
  }
  return problems;
}

function run(cmd, args, options) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', ...options });
  if (r.error) throw r.error;
  return r;
}

export function dryRun({ keep = false } = {}) {
  const work = mkdtempSync(join(tmpdir(), 'kdtree-release-'));
  try {
    // 1. binaries into the platform packages of this platform
    const { staged, missing } = stageBinaries();
    for (const name of staged) say(`staged ${name}`);
    const packages = publicPackages();
    const skipped = new Set();
    for (const name of missing) {
      const p = packages.find((q) => q.manifest.name === name);
      if (p.manifest.kdtree.variant === 'cpu') throw new Error(`${name}: the cpu variant is not built (run the set-up step first)`);
      say(`not packing ${name}: the cuda variant is not built here (KDTREE_CUDA=ON builds it; a release requires it)`);
      skipped.add(name);
    }
    for (const p of packages.filter((q) => q.manifest.kdtree?.variant && !skipped.has(q.manifest.name))) {
      if (p.manifest.os[0] !== process.platform || p.manifest.cpu[0] !== process.arch) {
        say(`not packing ${p.manifest.name}: it is built on ${p.manifest.os[0]}-${p.manifest.cpu[0]}`);
        skipped.add(p.manifest.name);
        continue;
      }
      const problems = platformPackageProblems(p.dir);
      if (problems.length > 0) throw new Error(`${p.manifest.name}:\n  ${problems.join('\n  ')}`);
    }

    // 2. pack and check every tarball
    const tarballs = join(work, 'tarballs');
    mkdirSync(tarballs);
    const license = readFileSync(join(ROOT, 'LICENSE'));
    const packed = [];
    for (const p of packages.filter((q) => !skipped.has(q.manifest.name))) {
      const before = new Set(readdirSync(tarballs));
      const status = runPnpm(['pack', '--pack-destination', tarballs], { cwd: p.dir, stdio: ['ignore', 'ignore', 'inherit'] });
      if (status !== 0) throw new Error(`pnpm pack of ${p.manifest.name} failed (exit ${status})`);
      const file = readdirSync(tarballs).find((f) => !before.has(f));
      const files = readTarball(join(tarballs, file));
      const problems = tarballProblems(files, license);
      if (problems.length > 0) throw new Error(`${file}:\n  ${problems.join('\n  ')}`);
      const bytes = readFileSync(join(tarballs, file)).length;
      say(`packed ${file} (${files.size} files, ${(bytes / 1e6).toFixed(2)} MB)`);
      packed.push({ name: p.manifest.name, file: join(tarballs, file), manifest: JSON.parse(files.get('package.json').toString('utf8')) });
    }

    // 3. an empty project outside the repository
    const project = join(work, 'consumer');
    mkdirSync(project);
    writeFileSync(join(project, 'package.json'), `${JSON.stringify({ name: 'kdtree-consumer', private: true, type: 'module' }, null, 2)}\n`);
    say(`installing ${packed.length} tarballs into ${project} (third-party dependencies from the registry)`);
    const install = run('npm', ['install', '--no-audit', '--no-fund', '--loglevel=error', ...packed.map((p) => p.file)], { cwd: project, stdio: ['ignore', 'inherit', 'inherit'] });
    if (install.status !== 0) throw new Error(`npm install of the tarballs failed (exit ${install.status})`);
    copyFileSync(join(dirname(fileURLToPath(import.meta.url)), 'consumer-check.mjs'), join(project, 'consumer-check.mjs'));
    const env = { ...process.env };
    for (const name of Object.keys(env)) if (name.startsWith('KDTREE_') || name === 'INIT_CWD') delete env[name];
    const check = run(process.execPath, ['consumer-check.mjs', JSON.stringify(packed.map((p) => p.manifest))], { cwd: project, env, stdio: ['ignore', 'inherit', 'inherit'] });
    if (check.status !== 0) throw new Error(`the installed packages failed their checks (exit ${check.status})`);
    say(`passed: ${packed.map((p) => `${p.name}@${p.manifest.version}`).join(', ')}`);
    return { packed: packed.map((p) => p.name), skipped: [...skipped] };
  } finally {
    if (keep) say(`kept ${work}`);
    else rmSync(work, { recursive: true, force: true });
  }
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  try {
    dryRun({ keep: process.argv.includes('--keep') });
  } catch (error) {
    console.error(`release dry run failed: ${error.message}`);
    process.exit(1);
  }
}
