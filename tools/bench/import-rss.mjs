// Peak RSS of `kdtree import` on a multi-GiB sharded safetensors checkpoint, against the issue's
// bound (largest tensor + 256 MiB), with the throughput of `cp` of the same files as the I/O peer.
//   node tools/bench/import-rss.mjs [--gib 3]
import { existsSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { writeSafetensors } from '@kdtree/format';
import { benchDir, GB, machine, MiB, run, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { gib: { type: 'string', default: '3' } } });
const dir = benchDir(`import-${values.gib}g`);
const cli = fileURLToPath(new URL('../../packages/cli/dist/bin.js', import.meta.url));
// Kimi K2 shapes in bf16: dense MLP matrices (252 MiB), an expert's projections, and the
// embedding-sized [163840, 1024] slice (320 MiB, the largest tensor).
const shardShapes = [[18432, 7168], [7168, 18432], [2048, 7168], [7168, 2048], [2048, 7168], [163840, 1024]];
const largestShape = shardShapes.reduce((a, b) => (a[0] * a[1] >= b[0] * b[1] ? a : b));
const shardBytes = shardShapes.reduce((s, sh) => s + sh[0] * sh[1] * 2, 0);
const shards = Math.ceil((Number(values.gib) * 1024 ** 3) / shardBytes);
const weightMap = {};
if (!existsSync(join(dir, 'model.safetensors.index.json'))) {
  const fill = new Uint8Array(largestShape[0] * largestShape[1] * 2).map((_, i) => (i * 7) & 0xff);
  for (let s = 0; s < shards; s++) {
    const name = `model-${String(s + 1).padStart(5, '0')}-of-${String(shards).padStart(5, '0')}.safetensors`;
    const tensors = shardShapes.map((shape, i) => ({ name: `layers.${s}.w${i}`, dtype: 'BF16', shape, data: fill.subarray(0, shape[0] * shape[1] * 2) }));
    for (const t of tensors) weightMap[t.name] = name;
    await writeSafetensors(join(dir, name), tensors);
  }
  writeFileSync(join(dir, 'model.safetensors.index.json'), JSON.stringify({ metadata: {}, weight_map: weightMap }));
  writeFileSync(join(dir, 'config.json'), JSON.stringify({ model_type: 'deepseek_v3' }));
}
const total = shards * shardBytes;
const out = join(dir, 'out.kdtr');
rmSync(out, { force: true });
const timed = (args) => {
  run('sync', []); // flush dirty pages of the previous step so each step pays only its own writes
  const r = run('/usr/bin/time', ['-f', '%M %e', ...args]);
  const [kb, seconds] = r.stderr.trim().split('\n').pop().split(' ').map(Number);
  return { rss: kb * 1024, seconds };
};
const cp = timed(['sh', '-c', `cat ${dir}/*.safetensors > ${dir}/cp.bin`]);
rmSync(join(dir, 'cp.bin'));
const imp = timed([process.execPath, cli, 'import', dir, '-o', out, '--quiet']);
const verify = timed([process.execPath, cli, 'verify', out, '--quiet']);
const bound = largestShape[0] * largestShape[1] * 2 + 256 * MiB;
const mib = (b) => (b / MiB).toFixed(0);
console.log(`kdtree import of a ${(total / GB).toFixed(2)} GB sharded safetensors checkpoint (${shards} shards, largest tensor ${mib(bound - 256 * MiB)} MiB)`);
console.log(`machine: ${machine()}`);
console.log(table(['step', 'peak RSS MiB', 'bound MiB', 'seconds', 'GB/s'], [
  ['cat shards > file (I/O peer)', mib(cp.rss), '-', cp.seconds.toFixed(2), (total / cp.seconds / GB).toFixed(2)],
  ['kdtree import', mib(imp.rss), mib(bound), imp.seconds.toFixed(2), (total / imp.seconds / GB).toFixed(2)],
  ['kdtree verify', mib(verify.rss), mib(bound), verify.seconds.toFixed(2), (total / verify.seconds / GB).toFixed(2)],
]));
console.log(imp.rss <= bound ? 'PASS: import peak RSS within largest tensor + 256 MiB' : 'FAIL: import peak RSS above the bound');
rmSync(out, { force: true });
