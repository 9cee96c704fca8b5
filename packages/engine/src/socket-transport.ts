/**
 * The cpu ranks' transport across processes: TCP between rank 0 and each other rank (a star), so
 * ranks need share nothing but a port. The forward pass calls a HostTransport synchronously, and
 * a Node thread cannot block on a socket, so each process runs its sockets on a relay thread
 * (socket-relay.ts): the rank's own thread writes its part into memory it shares with the relay,
 * wakes it and sleeps in Atomics.wait; the relay sends the part, and rank 0's relay, holding every
 * rank's part, computes the result once, sends it to every rank and wakes its own.
 *
 * Determinism: rank 0's relay sums the parts in rank order with f32 adds (a Float32Array store of
 * a double sum of two f32 values is the correctly rounded f32 sum), the same adds the
 * shared-memory transport makes, and every rank receives those bits.
 *
 * Faults: the relay records a failure here (a rank's connection closed, a rank reported one, or
 * rank 0's relay waited `timeoutMs` for a rank's part) and wakes the waiting thread, whose
 * collective then throws RankFailure naming the rank.
 */
import { EngineError } from './errors.js';
import type { HostTransport } from './collective.js';
import { RankFailure } from './shared-memory-transport.js';

/** Control words shared by a rank's thread and its relay. */
export const REQUEST = 0;
export const DONE = 1;
export const FAILED = 2;
export const FAILED_RANK = 3;
export const MESSAGE_LENGTH = 4;
export const OP = 5;
export const SIZE = 6;
export const ROWS = 7;
export const COLS = 8;
export const ROOT = 9;
/**
 * Rank 0, when its ranks' collectives are NCCL's (which no host-side failure can wake): 1 while
 * its thread is in NCCL's init, when its relay ends the process on a rank's failure or after
 * timeoutMs; 2 while it runs steps, when the relay ends the process if a rank's failure is not
 * taken up by rank 0's thread within timeoutMs (it is then blocked in a collective).
 */
export const GUARD = 10;
export const GUARD_INIT = 1;
export const GUARD_STEPS = 2;
/** Per rank from PROGRESS: its load progress counter, moved on by rank 0's relay. */
export const PROGRESS = 12;
export const MESSAGE_BYTES = 4096;

export const OPS = ['all-reduce', 'all-gather', 'broadcast'] as const;
export type Op = (typeof OPS)[number];

/** The memory one rank's thread shares with its relay. */
export interface RelayMemory {
  world: number;
  /** f32 elements of the largest part (a pass's all-reduce or all-gather block). */
  slotFloats: number;
  control: SharedArrayBuffer;
  message: SharedArrayBuffer;
  /** The part at [0, slotFloats), the result from slotFloats on (world blocks for an all-gather). */
  data: SharedArrayBuffer;
}

export function relayMemory(world: number, slotFloats: number): RelayMemory {
  return {
    world,
    slotFloats,
    control: new SharedArrayBuffer(4 * (PROGRESS + world)),
    message: new SharedArrayBuffer(MESSAGE_BYTES),
    data: new SharedArrayBuffer(4 * slotFloats * (world + 1)),
  };
}

/** Records the first failure in `memory` and wakes the waiting thread (used by both sides). */
export function recordFailure(memory: RelayMemory, rank: number, what: string): void {
  const control = new Int32Array(memory.control);
  if (Atomics.compareExchange(control, FAILED, 0, 1) === 0) {
    Atomics.store(control, FAILED_RANK, rank);
    const bytes = new TextEncoder().encode(what).subarray(0, MESSAGE_BYTES);
    new Uint8Array(memory.message).set(bytes);
    Atomics.store(control, MESSAGE_LENGTH, bytes.length);
  }
  Atomics.notify(control, DONE);
}

export function recordedFailure(memory: RelayMemory): RankFailure | undefined {
  const control = new Int32Array(memory.control);
  if (Atomics.load(control, FAILED) === 0) return undefined;
  const length = Atomics.load(control, MESSAGE_LENGTH);
  const text = new TextDecoder().decode(new Uint8Array(memory.message).slice(0, length));
  return new RankFailure(Atomics.load(control, FAILED_RANK), text || 'failed');
}

export class SocketTransport implements HostTransport {
  readonly world: number;
  private readonly control: Int32Array;
  private readonly part: Float32Array;
  private readonly result: Float32Array;
  private calls = 0;

  constructor(
    private readonly memory: RelayMemory,
    readonly rank: number,
    /** Called as each collective begins, with its number (fault injection for the tests). */
    private readonly onCollective?: (call: number) => void,
  ) {
    this.world = memory.world;
    this.control = new Int32Array(memory.control);
    this.part = new Float32Array(memory.data, 0, memory.slotFloats);
    this.result = new Float32Array(memory.data, 4 * memory.slotFloats);
  }

  failure(): RankFailure | undefined {
    return recordedFailure(this.memory);
  }

  fail(rank: number, what: string): void {
    recordFailure(this.memory, rank, what);
  }

  /** Rank `rank`'s load progress counter (rank 0's relay moves it on as that rank reports parts). */
  progressOf(rank: number): number {
    return Atomics.load(this.control, PROGRESS + rank);
  }

  /**
   * Runs `work`, which blocks this thread where no failure can wake it (ncclCommInitRank waits for
   * every rank, unbounded): meanwhile rank 0's relay ends this process, with the failure on
   * stderr, if a rank fails or `work` has not returned within the timeout.
   */
  blocking<T>(work: () => T): T {
    const before = Atomics.exchange(this.control, GUARD, GUARD_INIT);
    try {
      return work();
    } finally {
      Atomics.store(this.control, GUARD, before);
    }
  }

  /** From now on a failure that rank 0's thread does not take up within the timeout ends the process (NCCL steps). */
  guardSteps(): void {
    Atomics.store(this.control, GUARD, GUARD_STEPS);
  }

  /** Rank 0's thread has seen the failure (its event loop runs: it is not blocked in a collective). */
  takeUp(): void {
    Atomics.compareExchange(this.control, GUARD, GUARD_STEPS, 0);
  }

  /** Hands the part in `part` to the relay and sleeps until the result is in `result`. */
  private exchange(op: Op, floats: number, rows = 0, cols = 0, root = 0): void {
    const c = this.control;
    Atomics.store(c, OP, OPS.indexOf(op));
    Atomics.store(c, SIZE, floats);
    Atomics.store(c, ROWS, rows);
    Atomics.store(c, COLS, cols);
    Atomics.store(c, ROOT, root);
    Atomics.store(c, REQUEST, this.calls);
    Atomics.notify(c, REQUEST);
    // unbounded here: rank 0's relay bounds every wait for a rank, and a rank's relay records a
    // failure when its connection to rank 0 closes
    for (;;) {
      const failed = this.failure();
      if (failed) throw failed;
      const done = Atomics.load(c, DONE);
      if (done === this.calls) return;
      Atomics.wait(c, DONE, done, 1000);
    }
  }

  private begin(floats: number, what: string): void {
    const call = ++this.calls;
    this.onCollective?.(call);
    const failed = this.failure();
    if (failed) throw failed;
    if (floats > this.part.length) throw new EngineError('KDTREE_ENGINE_ARGUMENT', `${what} of ${floats} values exceeds the transport's slots of ${this.part.length}`, 'tp');
  }

  allReduceSum(data: Float32Array): void {
    this.begin(data.length, 'an all-reduce');
    this.part.set(data);
    this.exchange('all-reduce', data.length);
    data.set(this.result.subarray(0, data.length));
  }

  allGather(local: Float32Array, rows: number, cols: number, out: Float32Array): void {
    this.begin(rows * cols, 'an all-gather');
    this.part.set(local.subarray(0, rows * cols));
    this.exchange('all-gather', rows * cols, rows, cols);
    out.set(this.result.subarray(0, rows * cols * this.world));
  }

  broadcast(data: Uint8Array, root: number): void {
    const floats = Math.ceil(data.byteLength / 4);
    this.begin(floats, 'a broadcast');
    if (this.rank === root) new Uint8Array(this.part.buffer, 0, data.byteLength).set(data);
    this.exchange('broadcast', floats, data.byteLength, 0, root);
    if (this.rank !== root) data.set(new Uint8Array(this.result.buffer, this.result.byteOffset, data.byteLength));
  }
}
