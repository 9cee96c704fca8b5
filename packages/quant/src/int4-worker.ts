/**
 * Worker side of quantizeInt4Parallel: quantizes a row range of a weight in shared memory.
 * Messages: { weights, packed, scales (SharedArrayBuffer views), rowStart, rowEnd, cols, options,
 * stats } -> { ok: true, stats } or { ok: false, message }.
 */
import { parentPort } from 'node:worker_threads';
import { quantizeRowsInto, type ErrorStats, type ResolvedQuantizeOptions } from './int4.js';

interface Job {
  weights: Float32Array;
  packed: Int32Array;
  scales: Uint16Array | Float32Array;
  rowStart: number;
  rowEnd: number;
  cols: number;
  options: ResolvedQuantizeOptions;
  stats: boolean;
}

parentPort!.on('message', (job: Job) => {
  try {
    const stats: ErrorStats | undefined = job.stats ? { maxAbsError: 0, sumAbsError: 0, count: 0 } : undefined;
    quantizeRowsInto(job.weights, job.rowStart, job.rowEnd, job.cols, job.options, job.packed, job.scales, stats);
    parentPort!.postMessage({ ok: true, stats });
  } catch (error) {
    parentPort!.postMessage({ ok: false, message: (error as Error).message, name: (error as Error).name });
  }
});
