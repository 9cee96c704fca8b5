/**
 * quantizeInt4 across threads: rows split evenly over a pool of worker threads that share the
 * weight and output buffers (SharedArrayBuffer, no copies back). Same bytes as quantizeInt4.
 */
import { availableParallelism } from 'node:os';
import { Worker } from 'node:worker_threads';
import { NonFiniteWeightError, QuantError } from './errors.js';
import { quantizeInt4, resolveQuantizeOptions, type ErrorStats, type Int4Matrix, type QuantizeOptions } from './int4.js';

/** Below this many weights one thread is faster than the hand-off. */
const PARALLEL_MIN_WEIGHTS = 1 << 20;

let pool: Worker[] | undefined;

function workerUrl(): URL {
  // From dist/ the worker is a sibling; from src/ (tests run TypeScript) use the built copy.
  return import.meta.url.endsWith('.ts') ? new URL('../dist/int4-worker.js', import.meta.url) : new URL('./int4-worker.js', import.meta.url);
}

function getPool(threads: number): Worker[] {
  pool ??= [];
  while (pool.length < threads) {
    const w = new Worker(workerUrl());
    w.unref(); // an idle pool never keeps the process alive
    pool.push(w);
  }
  return pool.slice(0, threads);
}

function shared<T extends Float32Array | Int32Array | Uint16Array>(ctor: { new (b: SharedArrayBuffer): T; BYTES_PER_ELEMENT: number }, length: number): T {
  return new ctor(new SharedArrayBuffer(length * ctor.BYTES_PER_ELEMENT));
}

function runJob(worker: Worker, job: object): Promise<ErrorStats | undefined> {
  return new Promise((resolve, reject) => {
    const onMessage = (m: { ok: boolean; stats?: ErrorStats; message?: string; name?: string }) => {
      worker.off('error', onError);
      if (m.ok) resolve(m.stats);
      else reject(m.name === 'NonFiniteWeightError' ? new NonFiniteWeightError(m.message!.replace(/^tensor '[^']*': /, ''), { tensor: (job as { options: { name: string } }).options.name }) : new QuantError(m.message!));
    };
    const onError = (e: Error) => {
      worker.off('message', onMessage);
      reject(e);
    };
    worker.once('message', onMessage);
    worker.once('error', onError);
    worker.ref();
    worker.postMessage(job);
  });
}

export async function quantizeInt4Parallel(
  weights: Float32Array,
  rows: number,
  cols: number,
  options: QuantizeOptions & { threads?: number } = {},
  stats?: ErrorStats,
): Promise<Int4Matrix> {
  const q = resolveQuantizeOptions(weights, rows, cols, options);
  const threads = Math.max(1, Math.min(options.threads ?? availableParallelism(), rows, 16));
  if (threads === 1 || rows * cols < PARALLEL_MIN_WEIGHTS) return quantizeInt4(weights, rows, cols, options, stats);
  let w = weights;
  if (!(weights.buffer instanceof SharedArrayBuffer)) {
    w = shared(Float32Array, weights.length);
    w.set(weights);
  }
  const packed = shared(Int32Array, (rows * cols) / 8);
  const scales = q.scaleDtype === 'BF16' ? shared(Uint16Array, (rows * cols) / q.groupSize) : shared(Float32Array, (rows * cols) / q.groupSize);
  const workers = getPool(threads);
  const per = Math.ceil(rows / threads);
  try {
    const results = await Promise.all(
      workers.map((worker, i) =>
        runJob(worker, { weights: w, packed, scales, rowStart: Math.min(rows, i * per), rowEnd: Math.min(rows, (i + 1) * per), cols, options: q, stats: stats !== undefined }),
      ),
    );
    if (stats) {
      for (const r of results) {
        if (!r) continue;
        stats.maxAbsError = Math.max(stats.maxAbsError, r.maxAbsError);
        stats.sumAbsError += r.sumAbsError;
        stats.count += r.count;
      }
    }
  } finally {
    for (const worker of workers) worker.unref();
  }
  return { rows, cols, groupSize: q.groupSize, scaleDtype: q.scaleDtype, packed, scales };
}
