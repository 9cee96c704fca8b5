/**
 * The CPU ranks' transport: threads of one process over SharedArrayBuffers, synchronized with
 * Atomics. Each collective is: every rank writes its part into its own slot, one barrier, then
 * every rank reads what it needs. Slots come in two sets used alternately, so a rank that races
 * ahead into the next collective writes into the set nobody is still reading: it can only get two
 * collectives ahead by passing the barrier of the one in between, which every rank reaches only
 * after finishing its reads.
 *
 * Determinism: an all-reduce sums the slots in rank order with f32 adds (a Float32Array store of
 * a double sum of two f32 values is the correctly rounded f32 sum), and every rank does the same
 * adds on the same bits, so every rank holds the same result.
 *
 * Faults: a rank that fails calls fail() (its message goes into shared memory and every waiter is
 * woken); a waiter that passes `timeoutMs` without the barrier completing names the ranks that
 * never arrived. Either way every rank's next (or current) collective throws RankFailure.
 */
import { EngineError } from './errors.js';
import type { HostTransport } from './collective.js';

const COUNT = 0;
const GENERATION = 1;
const FAILED = 2;
const FAILED_RANK = 3;
const MESSAGE_LENGTH = 4;
const ARRIVED = 8;
/** Per rank after ARRIVED: a counter a loading rank moves on after each part (the load watchdog reads it). */
const progressWord = (world: number, rank: number) => ARRIVED + world + rank;
const MESSAGE_BYTES = 4096;

/** The shared memory of one group of ranks (created by rank 0, handed to the workers). */
export interface TransportMemory {
  world: number;
  /** f32 elements per slot. */
  slotFloats: number;
  control: SharedArrayBuffer;
  message: SharedArrayBuffer;
  data: SharedArrayBuffer;
}

export function transportMemory(world: number, slotFloats: number): TransportMemory {
  return {
    world,
    slotFloats,
    control: new SharedArrayBuffer(4 * (ARRIVED + 2 * world)),
    message: new SharedArrayBuffer(MESSAGE_BYTES),
    data: new SharedArrayBuffer(4 * slotFloats * world * 2),
  };
}

/** What ended a group: which rank, and what happened to it. */
export class RankFailure extends EngineError {
  constructor(
    readonly rank: number,
    readonly what: string,
  ) {
    super('KDTREE_ENGINE_RANK', `tensor-parallel rank ${rank} ${what}`, `rank ${rank}`);
    this.name = 'RankFailure';
  }
}

export class SharedMemoryTransport implements HostTransport {
  readonly world: number;
  private readonly control: Int32Array;
  private readonly message: Uint8Array;
  private readonly slots: Float32Array[][];
  /** Collectives this rank has entered (every rank enters the same ones in the same order). */
  private calls = 0;

  constructor(
    memory: TransportMemory,
    readonly rank: number,
    /** How long a rank waits at a barrier for the others before it gives them up as stalled. */
    readonly timeoutMs: number,
    /** Called as each collective begins, with its number (fault injection for the tests). */
    private readonly onCollective?: (call: number) => void,
  ) {
    this.world = memory.world;
    this.control = new Int32Array(memory.control);
    this.message = new Uint8Array(memory.message);
    const n = memory.slotFloats;
    this.slots = [0, 1].map((set) => Array.from({ length: this.world }, (_, r) => new Float32Array(memory.data, 4 * n * (set * this.world + r), n)));
  }

  /** Moves this rank's load progress counter on (read by the watchdog of rank 0's thread). */
  progress(): void {
    Atomics.add(this.control, progressWord(this.world, this.rank), 1);
  }

  progressOf(rank: number): number {
    return Atomics.load(this.control, progressWord(this.world, rank));
  }

  /** The failure that ended the group, if one did. */
  failure(): RankFailure | undefined {
    if (Atomics.load(this.control, FAILED) === 0) return undefined;
    // wait for the failing rank to finish writing its message (it sets MESSAGE_LENGTH last)
    let length = Atomics.load(this.control, MESSAGE_LENGTH);
    for (let i = 0; length === 0 && i < 100; i++) {
      Atomics.wait(this.control, MESSAGE_LENGTH, 0, 1);
      length = Atomics.load(this.control, MESSAGE_LENGTH);
    }
    const text = new TextDecoder().decode(this.message.slice(0, Math.max(0, length)));
    return new RankFailure(Atomics.load(this.control, FAILED_RANK), text || 'failed');
  }

  /** Ends the group: records that `rank` `what` (the first failure wins) and wakes every waiter. */
  fail(rank: number, what: string): void {
    if (Atomics.compareExchange(this.control, FAILED, 0, 1) === 0) {
      Atomics.store(this.control, FAILED_RANK, rank);
      const bytes = new TextEncoder().encode(what).subarray(0, MESSAGE_BYTES);
      this.message.set(bytes);
      Atomics.store(this.control, MESSAGE_LENGTH, bytes.length);
      Atomics.notify(this.control, MESSAGE_LENGTH);
    }
    Atomics.notify(this.control, GENERATION);
  }

  private begin(n: number, what: string): Float32Array[] {
    const call = ++this.calls;
    this.onCollective?.(call);
    const failed = this.failure();
    if (failed) throw failed;
    if (n > this.slots[0][0].length) {
      throw new EngineError('KDTREE_ENGINE_ARGUMENT', `${what} of ${n} values exceeds the transport's slots of ${this.slots[0][0].length}`, 'tp');
    }
    return this.slots[call % 2];
  }

  /** Every rank arrives before any leaves; throws RankFailure on a failure or a stall. */
  private barrier(what: string): void {
    const c = this.control;
    const generation = Atomics.load(c, GENERATION);
    Atomics.store(c, ARRIVED + this.rank, generation + 1);
    if (Atomics.add(c, COUNT, 1) === this.world - 1) {
      Atomics.store(c, COUNT, 0);
      Atomics.add(c, GENERATION, 1);
      Atomics.notify(c, GENERATION);
      return;
    }
    const deadline = Date.now() + this.timeoutMs;
    for (;;) {
      const failed = this.failure();
      if (failed) throw failed;
      if (Atomics.load(c, GENERATION) !== generation) return;
      const left = deadline - Date.now();
      if (left <= 0) {
        const missing = Array.from({ length: this.world }, (_, r) => r).filter((r) => Atomics.load(c, ARRIVED + r) <= generation);
        if (missing.length === 0) continue; // the last one is arriving now
        this.fail(missing[0], `stalled: it did not reach ${what} (collective ${this.calls}) within ${this.timeoutMs} ms${missing.length > 1 ? ` (nor did ranks ${missing.slice(1).join(', ')})` : ''}`);
        throw this.failure()!;
      }
      Atomics.wait(c, GENERATION, generation, Math.min(left, 1000));
    }
  }

  allReduceSum(data: Float32Array): void {
    const slots = this.begin(data.length, 'an all-reduce');
    const n = data.length;
    slots[this.rank].set(data);
    this.barrier('an all-reduce');
    data.set(slots[0].subarray(0, n));
    for (let r = 1; r < this.world; r++) {
      const s = slots[r];
      for (let i = 0; i < n; i++) data[i] += s[i];
    }
  }

  allGather(local: Float32Array, rows: number, cols: number, out: Float32Array): void {
    const slots = this.begin(rows * cols, 'an all-gather');
    slots[this.rank].set(local.subarray(0, rows * cols));
    this.barrier('an all-gather');
    const width = cols * this.world;
    for (let r = 0; r < this.world; r++) {
      const s = slots[r];
      for (let row = 0; row < rows; row++) out.set(s.subarray(row * cols, (row + 1) * cols), row * width + r * cols);
    }
  }

  broadcast(data: Uint8Array, root: number): void {
    const slots = this.begin(Math.ceil(data.byteLength / 4), 'a broadcast');
    const bytes = new Uint8Array(slots[root].buffer, slots[root].byteOffset, data.byteLength);
    if (this.rank === root) bytes.set(data);
    this.barrier('a broadcast');
    if (this.rank !== root) data.set(bytes);
  }
}
