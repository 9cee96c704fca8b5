import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { platformPackageProblems } from './check-platform-package.mjs';
import { REQUIRED_FIELDS, tarballProblems } from './dry-run.mjs';
import { platformPackages, publicPackages, readJson, ROOT } from './workspace.mjs';

const scratch = mkdtempSync(join(tmpdir(), 'kdtree-release-test-'));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));
const key = `${process.platform}-${process.arch}`;
const built = join(ROOT, 'packages', 'cuda', 'bin', key);
const version = readJson(join(ROOT, 'packages', 'cuda', 'package.json')).version;

/** A copy of the cpu platform package in a scratch dir, with its binary (unless `binary` is false) and its metadata patched by `meta`. */
function platformCopy(name, { binary = true, meta = {}, floor } = {}) {
  // meta: null leaves the metadata out
  const dir = join(scratch, name);
  mkdirSync(join(dir, 'bin'), { recursive: true });
  const manifest = readJson(join(ROOT, 'packages', 'cuda-linux-x64', 'package.json'));
  if (floor) manifest.kdtree.floor = floor;
  writeFileSync(join(dir, 'package.json'), JSON.stringify(manifest));
  if (binary) copyFileSync(join(built, 'kdtree_cpu.node'), join(dir, 'bin', 'kdtree_cpu.node'));
  if (meta !== null) writeFileSync(join(dir, 'bin', 'kdtree_cpu.json'), JSON.stringify({ ...readJson(join(built, 'kdtree_cpu.json')), ...meta }));
  return dir;
}

describe.runIf(key === 'linux-x64')('the pack-time check of a platform package', () => {
  it('passes the staged cpu variant', () => {
    expect(platformPackageProblems(platformCopy('good'), version)).toEqual([]);
  });

  it('refuses a package without its binary or its build metadata', () => {
    expect(platformPackageProblems(platformCopy('no-binary', { binary: false }), version)).toEqual([expect.stringMatching(/^no binary: .*kdtree_cpu\.node \(run node tools\/release\/stage-binaries\.mjs/)]);
    expect(platformPackageProblems(platformCopy('no-meta', { meta: null }), version)).toEqual([expect.stringMatching(/^no build metadata: .*kdtree_cpu\.json$/)]);
  });

  it('refuses metadata of another version, variant or platform, and a version apart from @kdtree/cuda', () => {
    const problems = platformPackageProblems(platformCopy('mismatch', { meta: { version: '0.0.9', variant: 'cuda', arch: 'arm64' } }), version);
    expect(problems).toEqual([
      `build metadata: version is "0.0.9", expected "${version}"`,
      'build metadata: variant is "cuda", expected "cpu"',
      'build metadata: arch is "arm64", expected "x64"',
    ]);
    expect(platformPackageProblems(platformCopy('apart'), '9.9.9')).toEqual([`version ${version} is not @kdtree/cuda's 9.9.9 (they are one changesets fixed group)`]);
  });

  it('refuses a binary that needs a newer glibc than the floor the package states', () => {
    const problems = platformPackageProblems(platformCopy('floor', { floor: { glibc: '2.17', glibcxx: '3.4.30' } }), version);
    expect(problems).toEqual([expect.stringMatching(/^the binary needs glibc 2\.\d+, newer than the stated floor 2\.17/)]);
  });
});

describe('a packed package', () => {
  const license = readFileSync(join(ROOT, 'LICENSE'));
  const manifest = { name: '@kdtree/x', version: '0.1.0', description: 'x', keywords: ['kdtree'], homepage: 'h', bugs: { url: 'b' }, repository: { type: 'git', url: 'r' }, license: 'MIT', main: './dist/index.js' };
  const files = (extra = {}, m = manifest) =>
    new Map([
      ['package.json', Buffer.from(JSON.stringify(m))],
      ['LICENSE', license],
      ['README.md', Buffer.from('# x')],
      ['dist/index.js', Buffer.from('')],
      ...Object.entries(extra).map(([k, v]) => [k, Buffer.from(v)]),
    ]);

  it('passes with its fields, LICENSE, README and entry point', () => {
    expect(tarballProblems(files(), license)).toEqual([]);
  });

  it('is refused with a source map pointing at sources it does not ship, a workspace: range or a missing field', () => {
    expect(tarballProblems(files({ 'dist/index.js.map': JSON.stringify({ version: 3, sources: ['../src/index.ts'] }) }), license)).toEqual(['dist/index.js.map points at src/index.ts, which the package does not ship']);
    expect(tarballProblems(files({ 'dist/index.js.map': JSON.stringify({ version: 3, sources: ['../src/index.ts'] }), 'src/index.ts': '' }), license)).toEqual([]);
    expect(tarballProblems(files({}, { ...manifest, dependencies: { '@kdtree/format': 'workspace:^' } }), license)).toEqual(['package.json still has workspace: ranges']);
    const { keywords, ...noKeywords } = manifest;
    expect(keywords).toBeDefined();
    expect(tarballProblems(files({}, noKeywords), license)).toEqual(['package.json has no keywords']);
    const noLicense = files();
    noLicense.delete('LICENSE');
    expect(tarballProblems(noLicense, license)).toEqual(['no LICENSE file']);
  });
});

describe('the repository', () => {
  it('gives every public package the published fields, its own directory and the MIT LICENSE', () => {
    const license = readFileSync(join(ROOT, 'LICENSE'), 'utf8');
    expect(license).toMatch(/^MIT License/);
    for (const p of publicPackages()) {
      for (const field of REQUIRED_FIELDS) expect(p.manifest[field], `${p.manifest.name}: ${field}`).toBeDefined();
      expect(p.manifest.repository.directory, p.manifest.name).toBe(p.rel);
      expect(p.manifest.files, p.manifest.name).toContain('CHANGELOG.md');
      expect(readFileSync(join(p.dir, 'LICENSE'), 'utf8'), `${p.manifest.name}/LICENSE`).toBe(license);
    }
  });

  it('locks @kdtree/cuda and its platform packages to one version, the cpu ones as its optional dependencies', () => {
    const config = readJson(join(ROOT, '.changeset', 'config.json'));
    const cuda = readJson(join(ROOT, 'packages', 'cuda', 'package.json'));
    const platforms = platformPackages();
    expect(platforms.map((p) => p.manifest.name)).toEqual(expect.arrayContaining(['@kdtree/cuda-linux-x64', '@kdtree/cuda-linux-x64-cuda']));
    expect(config.fixed).toContainEqual(['@kdtree/cuda', ...platforms.map((p) => p.manifest.name)]);
    for (const p of platforms) expect(p.manifest.version).toBe(cuda.version);
    const cpuVariants = platforms.filter((p) => p.manifest.kdtree.variant === 'cpu').map((p) => p.manifest.name);
    expect(Object.keys(cuda.optionalDependencies)).toEqual(cpuVariants);
    for (const range of Object.values(cuda.optionalDependencies)) expect(range).toBe('workspace:*'); // pnpm writes the exact version when packing
    // the cuda variants stay out of @kdtree/cuda's dependencies: a machine without a GPU does not download them
    expect(JSON.stringify({ ...cuda.dependencies, ...cuda.optionalDependencies })).not.toMatch(/-cuda"/);
  });
});
