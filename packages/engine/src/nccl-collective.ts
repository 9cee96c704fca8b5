/**
 * The GPU ranks' collectives: NCCL, queued on the step's stream like any op. Nothing runs on the
 * host, so a captured step stays one CUDA graph with its all-reduces and all-gathers inside it
 * (HostCollective's splitting is not needed).
 *
 * Determinism: NCCL's sum has the same bits on every rank of one communicator (every rank ends
 * with the one reduced buffer), which is what argmax, DDTree acceptance and the KV commit need.
 *
 * Faults: the communicator's native watchdog thread (ncclInit) polls ncclCommGetAsyncError and,
 * while the work is guarded (guard: a step, a prefill or a teacher-forced pass, one timeout per
 * forward pass), a deadline; on an error or a stall it aborts the communicator, which ends the
 * wait this rank is blocked in. The error that follows names this rank and why; rank 0's group
 * names the rank that died or whose connection closed (tp.ts).
 */
import { DTYPE_BYTES, numel, type DeviceTensor, type KdtreeBackend } from '@kdtree/cuda';
import type { Collective } from './collective.js';
import { RankFailure } from './shared-memory-transport.js';
import { argumentError } from './errors.js';

export interface NcclCollectiveOptions {
  /** This rank and the ranks in all. */
  rank: number;
  world: number;
  /** rank 0's ncclUniqueId (128 bytes): every rank gets it with the run's setup (tp.ts). */
  id: Uint8Array;
  /** How long guarded work may block before the watchdog aborts the communicator. */
  timeoutMs: number;
  /**
   * The largest all-gather's f32 values on this rank ([rows, cols] of a pass's lm_head block):
   * NCCL gathers rank-major ([world, rows, cols]), so rows > 1 go through a staging buffer of
   * world times that, allocated here because a capture cannot allocate.
   */
  gatherFloats: number;
  /** The watchdog's poll interval (default 50 ms). */
  watchdogMs?: number;
}

/**
 * The watchdog's deadline for guarded work of `passes` forward passes: `timeoutMs` per pass (a
 * prefill of many chunks gets as many bounds, a step one), at most what ncclArm takes (2^31 - 1 ms).
 */
export function guardDeadlineMs(timeoutMs: number, passes = 1): number {
  return Math.min(timeoutMs * Math.max(1, Math.ceil(passes)), 2 ** 31 - 1);
}

export class NcclCollective implements Collective {
  readonly rank: number;
  readonly world: number;
  readonly timeoutMs: number;
  private readonly comm: number;
  private readonly staging: DeviceTensor | undefined;
  private closed = false;

  /** ncclCommInitRank: blocks until all `world` ranks have joined. */
  constructor(
    private readonly b: KdtreeBackend,
    options: NcclCollectiveOptions,
  ) {
    this.rank = options.rank;
    this.world = options.world;
    this.timeoutMs = options.timeoutMs;
    this.comm = b.native.ncclInit({ world: options.world, rank: options.rank, id: options.id, watchdogMs: options.watchdogMs });
    try {
      this.staging = options.world > 1 && options.gatherFloats > 0 ? b.zeros('f32', [options.world * options.gatherFloats]) : undefined;
      this.warmUp();
    } catch (error) {
      b.native.ncclAbort(this.comm);
      throw error;
    }
  }

  /**
   * One of each collective, uncaptured: NCCL connects ranks lazily, at a communicator's first use
   * of each algorithm, and that setup is not a thing to leave for the first captured step.
   */
  private warmUp(): void {
    const b = this.b;
    const t = b.zeros('f32', [this.world]);
    try {
      const one: DeviceTensor = { ...t, shape: [1, 1] };
      this.allReduceSum(one, 0);
      this.allGather(one, { ...t, shape: [1, this.world] }, 0);
      this.broadcast([one], 0, 0);
      b.synchronize(0);
    } finally {
      b.free(t);
    }
  }

  allReduceSum(t: DeviceTensor, stream: number): void {
    if (t.dtype !== 'f32') throw argumentError('allReduceSum', `expected an f32 tensor, got ${t.dtype}`);
    this.b.native.ncclAllReduce({ comm: this.comm, send: t, recv: t, stream });
  }

  allGather(local: DeviceTensor, out: DeviceTensor, stream: number): void {
    const [rows, cols] = local.shape;
    const world = this.world;
    if (local.dtype !== 'f32' || out.dtype !== 'f32' || local.shape.length !== 2 || out.shape[0] !== rows || numel(out.shape) !== rows * cols * world) {
      throw argumentError('allGather', `expected f32 local [rows, cols] and out [rows, ${world} * cols], got [${local.shape.join(', ')}] and [${out.shape.join(', ')}]`);
    }
    // one row (a decode step) or one rank: NCCL's rank-major order is already [rows, world * cols]
    if (rows === 1 || world === 1) {
      this.b.native.ncclAllGather({ comm: this.comm, send: local, recv: out, stream });
      return;
    }
    const staging = this.staging;
    if (staging === undefined || numel(staging.shape) < world * rows * cols) {
      throw argumentError('allGather', `[${rows}, ${cols}] per rank exceeds the staging of ${staging ? numel(staging.shape) / world : 0} values (gatherFloats)`);
    }
    const gathered: DeviceTensor = { ...staging, shape: [world * rows * cols] };
    this.b.native.ncclAllGather({ comm: this.comm, send: local, recv: gathered, stream });
    // [world, rows, cols] -> [rows, world, cols]: one device copy per (row, rank) block
    const block = cols * 4;
    for (let row = 0; row < rows; row++) {
      for (let r = 0; r < world; r++) {
        this.b.native.copy({ dst: out.buffer, src: staging.buffer, bytes: block, dstOffset: (out.offset ?? 0) + (row * world + r) * block, srcOffset: (staging.offset ?? 0) + (r * rows + row) * block, stream });
      }
    }
  }

  broadcast(tensors: readonly DeviceTensor[], root: number, stream: number): void {
    for (const t of tensors) {
      const bytes: DeviceTensor = { buffer: t.buffer, dtype: 'u8', shape: [numel(t.shape) * DTYPE_BYTES[t.dtype]], offset: t.offset };
      this.b.native.ncclBroadcast({ comm: this.comm, send: bytes, recv: bytes, root, stream });
    }
  }

  /**
   * Runs `work` (which may block on the device: `passes` forward passes and their downloads) with
   * the watchdog armed: if it has not returned within guardDeadlineMs(timeoutMs, passes) the
   * communicator is aborted and `work` throws. The error thrown is then a RankFailure naming this
   * rank.
   */
  guard<T>(work: () => T, passes = 1): T {
    this.b.native.ncclArm(this.comm, guardDeadlineMs(this.timeoutMs, passes));
    try {
      return work();
    } catch (error) {
      throw this.failure() ?? error;
    } finally {
      if (!this.closed) this.b.native.ncclArm(this.comm, 0);
    }
  }

  /** The communicator's failure (an asynchronous NCCL error, or the watchdog's abort), if any. */
  failure(): RankFailure | undefined {
    if (this.closed) return undefined;
    const e = this.b.native.ncclAsyncError(this.comm);
    if (!e.aborted && (e.result === 0 || e.result === 7)) return undefined;
    return new RankFailure(this.rank, e.message || `failed: ncclResult ${e.result}`);
  }

  /**
   * Destroys the communicator; aborts it instead after its own failure or when `abort` (the group
   * recorded a rank's failure): ncclCommDestroy may wait on a peer that is gone, ncclCommAbort
   * does not.
   */
  close(abort = false): void {
    if (this.closed) return;
    const failed = abort || this.failure() !== undefined;
    this.closed = true;
    if (this.staging) this.b.free(this.staging.buffer);
    if (failed) this.b.native.ncclAbort(this.comm);
    else this.b.native.ncclDestroy(this.comm);
  }
}
