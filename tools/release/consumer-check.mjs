// Run by the release dry run inside an empty project where the packed tarballs were installed
// (not inside the repository): what a user of the published packages meets.
//   node consumer-check.mjs '<JSON array of the packed package.json files>'
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';

const manifests = JSON.parse(process.argv[2]);
const require = createRequire(join(process.cwd(), 'package.json'));
const say = (line) => console.log(`  consumer: ${line}`);
const failures = [];
const check = async (what, fn) => {
  try {
    const detail = await fn();
    say(`ok   ${what}${detail ? `: ${detail}` : ''}`);
  } catch (error) {
    failures.push(what);
    say(`FAIL ${what}: ${error.stack ?? error}`);
  }
};

// every package: its entry point imports (platform packages have none: their package.json resolves)
for (const m of manifests) {
  await check(`import ${m.name}`, async () => {
    if (m.exports?.['.'] || m.main) {
      const mod = await import(m.name);
      return `${Object.keys(mod).length} exports`;
    }
    const dir = require.resolve(`${m.name}/package.json`);
    return `no entry point; ${dir} resolves`;
  });
}

const names = new Set(manifests.map((m) => m.name));
const key = `${process.platform}-${process.arch}`;

if (names.has('@kdtree/format')) {
  await check('@kdtree/format alone: bf16 round trip', async () => {
    const f = await import('@kdtree/format');
    const back = f.bf16ArrayToF32(f.f32ArrayToBf16(Float32Array.of(1.5, -2, 3.25)));
    if (back.join() !== '1.5,-2,3.25') throw new Error(`got ${back.join()}`);
  });
}

if (names.has('@kdtree/cuda')) {
  const cuda = await import('@kdtree/cuda');
  await check('@kdtree/cuda: the cpu backend loads from the platform package and adds', async () => {
    const b = cuda.createBackend({ backend: 'cpu' });
    if (b.loaded.source !== `@kdtree/cuda-${key}`) throw new Error(`loaded from ${b.loaded.source} (${b.addonPath}), not @kdtree/cuda-${key}`);
    const x = b.fromArray('f32', [3], Float32Array.of(1, 2, 3));
    const y = b.fromArray('f32', [3], Float32Array.of(10, 20, 30));
    const out = b.empty('f32', [3]);
    b.native.add({ a: x, b: y, out });
    const got = Array.from(b.toArray(out));
    b.free(x, y, out);
    if (got.join() !== '11,22,33') throw new Error(`add gave ${got.join()}`);
    return `${b.addonPath}; build ${JSON.stringify(b.loaded.meta.requires)}`;
  });
  if (names.has(`@kdtree/cuda-${key}-cuda`)) {
    await check(`@kdtree/cuda: the cuda variant resolves from @kdtree/cuda-${key}-cuda`, async () => {
      try {
        const b = cuda.createBackend({ backend: 'cuda' });
        return `loaded on ${b.info().name}`;
      } catch (error) {
        if (!(error instanceof cuda.AddonLoadError)) throw error;
        const attempt = error.attempts.find((a) => a.candidate.includes(`@kdtree/cuda-${key}-cuda`));
        if (!attempt || /not installed|not built/.test(attempt.reason)) throw new Error(`the cuda package was not found: ${error.message}`);
        return `found, and refused here as it should be without a GPU: ${attempt.reason}`;
      }
    });
  }
}

if (names.has('@kdtree/cli')) {
  await check('the kdtree command: kdtree backend --backend cpu --json', async () => {
    const bin = join(process.cwd(), 'node_modules', '.bin', 'kdtree');
    const r = spawnSync(bin, ['backend', '--backend', 'cpu', '--json'], { encoding: 'utf8' });
    if (r.status !== 0) throw new Error(`exit ${r.status}: ${r.stderr}`);
    const report = JSON.parse(r.stdout);
    if (report.ok !== true || report.backend !== 'cpu') throw new Error(r.stdout);
    return `backend ${report.backend} from ${report.source}`;
  });
}

if (names.has('@kdtree/cuda')) {
  // the one documented command that builds the addon from the installed package's sources
  await check('npx kdtree-build-native (the cpu variant, from the shipped native/ sources)', async () => {
    const r = spawnSync('npx', ['--no-install', 'kdtree-build-native'], { encoding: 'utf8', env: { ...process.env, KDTREE_CUDA: 'OFF' } });
    if (r.status !== 0) throw new Error(`exit ${r.status}: ${r.stdout.slice(-2000)}${r.stderr.slice(-2000)}`);
    const dir = join(process.cwd(), 'node_modules', '@kdtree', 'cuda', 'bin', key);
    if (!existsSync(join(dir, 'kdtree_cpu.node'))) throw new Error(`no binary in ${dir}`);
    const meta = JSON.parse(readFileSync(join(dir, 'kdtree_cpu.json'), 'utf8'));
    const cuda = await import('@kdtree/cuda');
    const b = cuda.createBackend({ backend: 'cpu' });
    if (b.loaded.source !== 'bin/ of @kdtree/cuda') throw new Error(`the loader took ${b.loaded.source}, not the local build`);
    return `${r.stdout.trim().split('\n').pop()}; version ${meta.version}; the loader takes it first`;
  });
}

if (failures.length > 0) {
  console.error(`  consumer: ${failures.length} check(s) failed: ${failures.join('; ')}`);
  process.exit(1);
}
