// Reading every tensor of a >= 1 GiB KDTR bundle on a hot page cache, against `cat FILE > /dev/null`
// on the same file in the same run (the target: >= 0.9x of cat's throughput).
//   node tools/bench/format-read.mjs [--gib 2] [--reps 5]
import './threadpool.mjs';
import { existsSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { KdtrWriter, openBundle } from '@kdtree/format';
import { benchDir, GB, machine, median, MiB, run, table, timeIt } from './bench-util.mjs';

const { values } = parseArgs({ options: { gib: { type: 'string', default: '2' }, reps: { type: 'string', default: '5' } } });
const targetBytes = Number(values.gib) * 1024 ** 3;
const reps = Number(values.reps);
const file = join(benchDir('format-read'), `bundle-${values.gib}g.kdtr`);

// Kimi K2-like tensor sizes (bf16): an expert's gate/up/down (28 MiB), attention projections, a
// dense MLP matrix (252 MiB), norms.
const shapes = [[2048, 7168], [7168, 2048], [2048, 7168], [1536, 7168], [64 * 192, 1536], [18432, 7168], [7168]];
if (!existsSync(file)) {
  const w = await KdtrWriter.create(file);
  const pattern = new Uint8Array(256 * MiB);
  for (let i = 0; i < pattern.length; i += 4096) pattern[i] = i >>> 12;
  let written = 0;
  for (let i = 0; written < targetBytes; i++) {
    const shape = shapes[i % shapes.length];
    const size = shape.reduce((a, b) => a * b, 2);
    await w.add({ name: `t${i}`, dtype: 'BF16', shape }, pattern.subarray(0, size));
    written += size;
  }
  await w.close();
}
const fileBytes = statSync(file).size;
const bundle = await openBundle(file);
const tensorBytes = bundle.totalBytes;
const largest = Math.max(...bundle.tensors.map((t) => t.size));
const target = new Uint8Array(largest);

// Reads check each tensor's CRC-32 by default; the raw rows opt out to show the I/O alone.
const readAll = async () => {
  for (const t of bundle.tensors) await bundle.readInto(t.name, target, { verify: false });
};
const readVerify = async () => {
  for (const t of bundle.tensors) await bundle.readInto(t.name, target);
};
const streamAll = async () => {
  for (const t of bundle.tensors) for await (const _ of bundle.chunks(t.name, { verify: false })) void _;
};
const streamVerify = async () => {
  for (const t of bundle.tensors) for await (const _ of bundle.chunks(t.name)) void _;
};
const verifyAll = () => bundle.verify();
// The physical floor of readInto: landing bytes in a buffer larger than the caches costs a DRAM
// read and a DRAM write per byte; a plain memcpy of the same bytes between two such buffers.
const source = new Uint8Array(largest).fill(1);
const memcpy = () => {
  for (let done = 0; done < tensorBytes; done += largest) target.set(source.subarray(0, Math.min(largest, tensorBytes - done)));
};
const cat = () => run('sh', ['-c', `cat '${file}' > /dev/null`]);

// Warm the page cache, then interleave the variants so drift hits all of them alike.
cat();
await readAll();
const times = { cat: [], readInto: [], chunks: [], verify: [], chunksVerify: [], verifyAll: [], memcpy: [] };
for (let r = 0; r < reps; r++) {
  times.cat.push(await timeIt(cat));
  times.readInto.push(await timeIt(readAll));
  times.chunks.push(await timeIt(streamAll));
  times.verify.push(await timeIt(readVerify));
  times.chunksVerify.push(await timeIt(streamVerify));
  times.verifyAll.push(await timeIt(verifyAll));
  times.memcpy.push(await timeIt(memcpy));
}
await bundle.close();
const catRate = fileBytes / median(times.cat);
const rows = [
  ['cat FILE > /dev/null (whole file)', fileBytes, median(times.cat), catRate, 1],
  ['readInto, verify: false (caller buffer)', tensorBytes, median(times.readInto)],
  ['chunks(), verify: false (1 MiB x 4 ring)', tensorBytes, median(times.chunks)],
  ['readInto (default: CRC-32 checked)', tensorBytes, median(times.verify)],
  ['chunks() (default: CRC-32 checked)', tensorBytes, median(times.chunksVerify)],
  ['verify() every tensor (streamed CRC-32)', tensorBytes, median(times.verifyAll)],
  ['memcpy of the same bytes (readInto floor)', tensorBytes, median(times.memcpy)],
].map(([name, bytes, s]) => [name, (bytes / GB).toFixed(2), s.toFixed(3), (bytes / s / GB).toFixed(2), (bytes / s / catRate).toFixed(2)]);
console.log(`KDTR read throughput, hot page cache, ${bundle.tensors.length} tensors (largest ${(largest / MiB).toFixed(0)} MiB), median of ${reps}`);
console.log(`machine: ${machine()}, UV_THREADPOOL_SIZE=${process.env.UV_THREADPOOL_SIZE}`);
console.log(table(['variant', 'GB', 'seconds', 'GB/s', 'x cat'], rows));
