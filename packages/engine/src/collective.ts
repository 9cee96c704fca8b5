/**
 * The collectives a tensor-parallel forward pass needs, on device tensors, queued on the step's
 * stream like any op:
 *
 *   allReduceSum   after o_proj and after the MLP / MoE down projections (row-parallel: each rank
 *                  holds a partial sum over its block of K), before the residual add
 *   allGather      lm_head (column-parallel: each rank holds its block of the vocabulary)
 *   broadcast      rank 0's draft tree to every rank before the verify
 *
 * Every rank must end with the same bits, so that argmax, DDTree acceptance and the KV commit
 * make the same decision everywhere and the ranks stay in lockstep without talking about it.
 *
 * HostCollective runs them on the host over a HostTransport (the CPU ranks' shared memory for
 * worker threads, TCP for rank processes: SharedMemoryTransport, SocketTransport). A
 * captured step cannot contain a host call, so while a step is captured (captureStep) each
 * collective ends the capture there, remembers the host call, and begins the next part: the step
 * is replayed as [graph, host call, graph, ...], in order, on one stream. NcclCollective needs no
 * such split: it queues its collectives on the stream itself, so a step stays one graph.
 */
import { DTYPE_BYTES, numel, type DeviceTensor, type Graph, type KdtreeBackend } from '@kdtree/cuda';

export interface Collective {
  readonly rank: number;
  readonly world: number;
  /** t (f32) = the sum over ranks of every rank's t, in rank order: the same bits on every rank. */
  allReduceSum(t: DeviceTensor, stream: number): void;
  /** out [rows, world * cols] = every rank's `local` [rows, cols] side by side, rank r's at columns r * cols. */
  allGather(local: DeviceTensor, out: DeviceTensor, stream: number): void;
  /** Every rank's `tensors` = rank `root`'s (any dtypes; the same shapes on every rank). */
  broadcast(tensors: readonly DeviceTensor[], root: number, stream: number): void;
  /**
   * Runs `work` (forward passes and the host reads after them, which block while a collective
   * waits for a rank) under the transport's watchdog, where it has one (NCCL: work not done
   * within `passes` times its timeout aborts the communicator and `work` throws a RankFailure
   * naming this rank). `passes` (default 1) is how many forward passes `work` runs: a step is one,
   * a prefill one per chunk, so the bound is per pass and a long prompt does not trip it. Host
   * collectives need none: their waits are bounded by the transport itself.
   */
  guard?<T>(work: () => T, passes?: number): T;
}

/** What moves between ranks on the host: blocking calls every rank makes in the same order. */
export interface HostTransport {
  readonly rank: number;
  readonly world: number;
  /** The sum over ranks of `data` (rank order, f32 adds), into `data`. */
  allReduceSum(data: Float32Array): void;
  /** out [rows, world * cols] from every rank's local [rows, cols]. */
  allGather(local: Float32Array, rows: number, cols: number, out: Float32Array): void;
  /** `data` = rank `root`'s bytes. */
  broadcast(data: Uint8Array, root: number): void;
}

/** A host call inside a captured step, run with the stream the step is launched on. */
export type HostCall = (stream: number) => void;

/** One captured step: graphs with the host calls between them, replayed in order. */
export class StepGraph {
  constructor(readonly parts: readonly (Graph | HostCall)[]) {}

  launch(b: KdtreeBackend, stream: number): void {
    for (const part of this.parts) {
      if (typeof part === 'function') part(stream);
      else b.native.launchGraph(part, stream);
    }
  }

  /** Op calls captured, over every part. */
  get calls(): number {
    return this.parts.reduce((s, p) => s + (typeof p === 'function' ? 0 : p.calls), 0);
  }

  free(b: KdtreeBackend): void {
    for (const part of this.parts) if (typeof part !== 'function' && !part.freed) b.native.freeGraph(part);
  }
}

/** Captures `queue(stream)` as a StepGraph; `collective` (when given) splits it at its host calls. */
export function captureStep(b: KdtreeBackend, stream: number, queue: (stream: number) => void, collective?: HostCollective): StepGraph {
  if (collective === undefined) return new StepGraph([b.capture(stream, () => queue(stream))]);
  return collective.captureStep(stream, queue);
}

export class HostCollective implements Collective {
  readonly rank: number;
  readonly world: number;
  /** The capture in progress: its stream and the parts so far. */
  private capturing: { stream: number; parts: (Graph | HostCall)[] } | undefined;
  /** Host staging, grown as needed (downloads cannot target shared memory). */
  private f32 = new Float32Array(0);
  private u8 = new Uint8Array(0);

  constructor(
    private readonly b: KdtreeBackend,
    private readonly transport: HostTransport,
  ) {
    this.rank = transport.rank;
    this.world = transport.world;
  }

  captureStep(stream: number, queue: (stream: number) => void): StepGraph {
    if (this.capturing !== undefined) throw new Error('captureStep: a capture is already in progress');
    const b = this.b;
    const parts: (Graph | HostCall)[] = [];
    this.capturing = { stream, parts };
    b.native.beginCapture(stream);
    try {
      queue(stream);
      parts.push(b.native.endCapture(stream));
    } catch (error) {
      try {
        b.native.freeGraph(b.native.endCapture(stream));
      } catch {
        // the capture is over either way; the first error is the one to report
      }
      new StepGraph(parts).free(b);
      throw error;
    } finally {
      this.capturing = undefined;
    }
    return new StepGraph(parts);
  }

  /** Runs `call` now, or, inside a capture on `stream`, as a host call between two parts of it. */
  private host(stream: number, call: HostCall): void {
    const c = this.capturing;
    if (c === undefined || c.stream !== stream) {
      call(stream);
      return;
    }
    c.parts.push(this.b.native.endCapture(stream), call);
    this.b.native.beginCapture(stream);
  }

  private staging(n: number): Float32Array {
    if (this.f32.length < n) this.f32 = new Float32Array(n);
    return this.f32.subarray(0, n);
  }

  allReduceSum(t: DeviceTensor, stream: number): void {
    if (t.dtype !== 'f32') throw new Error(`allReduceSum: expected an f32 tensor, got ${t.dtype}`);
    const n = numel(t.shape);
    this.host(stream, (s) => {
      const host = this.staging(n);
      this.b.native.download(t.buffer, host, t.offset ?? 0, s);
      this.transport.allReduceSum(host);
      this.b.native.upload(t.buffer, host, t.offset ?? 0, s);
    });
  }

  allGather(local: DeviceTensor, out: DeviceTensor, stream: number): void {
    const [rows, cols] = local.shape;
    if (local.dtype !== 'f32' || out.dtype !== 'f32' || local.shape.length !== 2 || out.shape[0] !== rows || numel(out.shape) !== rows * cols * this.world) {
      throw new Error(`allGather: expected f32 local [rows, cols] and out [rows, ${this.world} * cols], got [${local.shape.join(', ')}] and [${out.shape.join(', ')}]`);
    }
    this.host(stream, (s) => {
      const host = this.staging(rows * cols * (this.world + 1));
      const mine = host.subarray(0, rows * cols);
      const all = host.subarray(rows * cols);
      this.b.native.download(local.buffer, mine, local.offset ?? 0, s);
      this.transport.allGather(mine, rows, cols, all);
      this.b.native.upload(out.buffer, all, out.offset ?? 0, s);
    });
  }

  broadcast(tensors: readonly DeviceTensor[], root: number, stream: number): void {
    const sizes = tensors.map((t) => numel(t.shape) * DTYPE_BYTES[t.dtype]);
    const total = sizes.reduce((s, x) => s + x, 0);
    this.host(stream, (s) => {
      if (this.u8.length < total) this.u8 = new Uint8Array(total);
      const host = this.u8.subarray(0, total);
      let at = 0;
      if (this.rank === root) {
        tensors.forEach((t, i) => {
          this.b.native.download(t.buffer, host.subarray(at, at + sizes[i]), t.offset ?? 0, s);
          at += sizes[i];
        });
      }
      this.transport.broadcast(host, root);
      if (this.rank === root) return;
      at = 0;
      tensors.forEach((t, i) => {
        this.b.native.upload(t.buffer, host.subarray(at, at + sizes[i]), t.offset ?? 0, s);
        at += sizes[i];
      });
    });
  }
}
