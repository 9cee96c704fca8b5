// Quantize+pack throughput of @kdtree/quant against a vectorized numpy implementation of the same
// algorithm, in the same run, on the same weights; outputs are checked identical before timing counts.
//   node tools/bench/quant-throughput.mjs [--rows 4096] [--cols 7168] [--reps 3]
import { createHash } from 'node:crypto';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { availableParallelism } from 'node:os';
import { quantizeInt4, quantizeInt4Parallel } from '@kdtree/quant';
import { benchDir, machine, median, run, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { rows: { type: 'string', default: '4096' }, cols: { type: 'string', default: '7168' }, reps: { type: 'string', default: '3' } } });
const [n, k, reps] = [Number(values.rows), Number(values.cols), Number(values.reps)];
const dir = benchDir('quant');
const w = new Float32Array(n * k);
let x = 12345;
for (let i = 0; i < w.length; i++) {
  x = (Math.imul(x, 1103515245) + 12345) >>> 0;
  w[i] = ((x / 2 ** 32 - 0.5) * 0.1) * (i % 97 === 0 ? 8 : 1);
}
writeFileSync(join(dir, 'w.f32'), new Uint8Array(w.buffer));

// Warm-up: V8 compiles the loop on the first call (a cold call runs at ~60% speed).
quantizeInt4(w, n, k, { groupSize: 32, rule: 'minmax', scaleDtype: 'BF16' });
const times = [];
let m;
for (let r = 0; r < reps; r++) {
  const t = performance.now();
  m = quantizeInt4(w, n, k, { groupSize: 32, rule: 'minmax', scaleDtype: 'BF16' });
  times.push((performance.now() - t) / 1000);
}
const threads = availableParallelism();
// Weights in shared memory, as `kdtree quantize` reads them, so the threads need no copy.
const ws = new Float32Array(new SharedArrayBuffer(w.byteLength));
ws.set(w);
await quantizeInt4Parallel(ws, n, k, { threads }); // start and warm the pool outside the timing
const ptimes = [];
let mp;
for (let r = 0; r < reps; r++) {
  const t = performance.now();
  mp = await quantizeInt4Parallel(ws, n, k, { groupSize: 32, rule: 'minmax', scaleDtype: 'BF16', threads });
  ptimes.push((performance.now() - t) / 1000);
}
const script = fileURLToPath(new URL('./quant_numpy.py', import.meta.url));
const env = { ...process.env };
// OpenBLAS core-type overrides slow current numpy (no BLAS is used here, but keep numpy at its best).
delete env.OPENBLAS_CORETYPE;
delete env.OPENBLAS_L2_SIZE;
const py = run('python3', [script, join(dir, 'w.f32'), join(dir, 'packed.i32'), join(dir, 'scales.u16'), String(n), String(k), String(reps)], { env });
const numpySeconds = Number(py.stdout.trim());
const hash = (b) => createHash('sha256').update(b).digest('hex');
const same = [m, mp].every((x) => hash(new Uint8Array(x.packed.buffer)) === hash(readFileSync(join(dir, 'packed.i32'))) && hash(new Uint8Array(x.scales.buffer)) === hash(readFileSync(join(dir, 'scales.u16'))));
if (!same) throw new Error('numpy and @kdtree/quant disagree: the comparison is void');
const numpyVersion = run('python3', ['-c', 'import numpy; print(numpy.__version__)']).stdout.trim();
const ours = median(times);
const weights = n * k;
console.log(`INT4 quantize + pack, W [${n}, ${k}] f32 -> minmax, group 32, bf16 scales; median of ${reps}; outputs identical: ${same}`);
console.log(`machine: ${machine()}, numpy ${numpyVersion}`);
console.log(table(['implementation', 'seconds', 'Mweights/s', 'x numpy'], [
  ['numpy (vectorized, same algorithm)', numpySeconds.toFixed(3), (weights / numpySeconds / 1e6).toFixed(1), '1.00'],
  ['@kdtree/quant quantizeInt4 (1 thread)', ours.toFixed(3), (weights / ours / 1e6).toFixed(1), (numpySeconds / ours).toFixed(2)],
  [`@kdtree/quant quantizeInt4Parallel (${threads} threads)`, median(ptimes).toFixed(3), (weights / median(ptimes) / 1e6).toFixed(1), (numpySeconds / median(ptimes)).toFixed(2)],
]));
