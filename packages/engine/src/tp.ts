/**
 * Tensor-parallel ranks on the cpu backend: rank 0 is the engine's own thread, ranks 1..N-1 are
 * worker threads (tp-worker.ts), each with its own cpu backend, its shard of the model read from
 * the same checkpoint, and its Runner. They share one SharedMemoryTransport. Rank 0 sends every
 * state-changing Runner call to the workers (RankPeers) as a message before running it itself;
 * the collectives inside the steps keep the ranks in lockstep.
 *
 * Faults end the group and the run: a rank whose load throws reports it; a rank that throws in
 * a step, or whose thread exits, marks the shared memory failed and wakes every waiting rank; a
 * rank that stops making progress (loading: no part loaded, stepping: a barrier not reached) for
 * `timeoutMs` is named by the rank waiting for it. Every case ends with a RankFailure naming the
 * rank and what happened, and every worker terminated.
 */
import { Worker } from 'node:worker_threads';
import type { CacheDtype } from './kv-cache.js';
import type { ActivationDtype } from './workspace.js';
import type { RankCommand, RankPeers } from './runner.js';
import { RankFailure, SharedMemoryTransport, transportMemory, type TransportMemory } from './shared-memory-transport.js';
import { argumentError } from './errors.js';

/** The default bound on a rank's silence (loading one part, or reaching the next collective). */
export const TP_TIMEOUT_MS = 20_000;

/**
 * A fault to inject (tests): `RANK:load:KIND` or `RANK:collective=N:KIND` with KIND `throw`,
 * `stall` or `exit`. Read from `KDTREE_TP_FAULT` when the engine option is absent.
 */
export interface TpFault {
  rank: number;
  at: 'load' | number;
  kind: 'throw' | 'stall' | 'exit';
}

export function parseTpFault(text: string, world: number): TpFault {
  const m = /^(\d+):(load|collective=(\d+)):(throw|stall|exit)$/.exec(text);
  if (m === null || Number(m[1]) < 1 || Number(m[1]) >= world) {
    throw argumentError('tpFault', `expected RANK:load:KIND or RANK:collective=N:KIND with 1 <= RANK < ${world} and KIND throw, stall or exit; got '${text}'`);
  }
  return { rank: Number(m[1]), at: m[2] === 'load' ? 'load' : Number(m[3]), kind: m[4] as TpFault['kind'] };
}

/** What every worker rank needs to load its shard and build its Runner. */
export interface RankSetup {
  model: string;
  config?: string;
  rows: number;
  activations: ActivationDtype;
  cacheTokens: number;
  cacheDtype: CacheDtype;
  prefillChunk: number;
  nodes: number;
  maxDepth: number;
}

/** The data a worker thread starts with. */
export interface RankWorkerData {
  memory: TransportMemory;
  rank: number;
  setup: RankSetup;
  timeoutMs: number;
  fault?: TpFault;
}

/** Messages from a worker to rank 0. */
export type RankMessage = { type: 'ready' } | { type: 'error'; message: string };

function workerUrl(): URL {
  // under vitest this module runs from src/*.ts; the worker is the built one
  return import.meta.url.endsWith('.ts') ? new URL('../dist/tp-worker.js', import.meta.url) : new URL('./tp-worker.js', import.meta.url);
}

export class TpGroup implements RankPeers {
  /** Rank 0's end of the transport. */
  readonly transport: SharedMemoryTransport;
  private readonly workers: Worker[] = [];
  private readonly exited: Promise<void>[] = [];
  private failed: RankFailure | undefined;
  private closing = false;

  private constructor(
    readonly world: number,
    private readonly memory: TransportMemory,
    readonly timeoutMs: number,
  ) {
    this.transport = new SharedMemoryTransport(memory, 0, timeoutMs);
  }

  /**
   * Starts ranks 1..world-1 loading their shards. `slotFloats`: the largest collective's f32
   * values (a pass's [rows, hidden] all-reduce or [rows, vocab / world] all-gather block).
   */
  static start(world: number, setup: RankSetup, options: { slotFloats: number; timeoutMs: number; fault?: TpFault }): TpGroup {
    const group = new TpGroup(world, transportMemory(world, options.slotFloats), options.timeoutMs);
    for (let rank = 1; rank < world; rank++) {
      const data: RankWorkerData = { memory: group.memory, rank, setup, timeoutMs: options.timeoutMs, fault: options.fault?.rank === rank ? options.fault : undefined };
      const worker = new Worker(workerUrl(), { workerData: data });
      group.workers.push(worker);
      group.exited.push(
        new Promise<void>((resolve) => {
          worker.on('error', (error) => group.mark(new RankFailure(rank, `threw: ${error.message}`)));
          worker.on('exit', (code) => {
            if (!group.closing) group.mark(new RankFailure(rank, `exited (code ${code})`));
            resolve();
          });
        }),
      );
    }
    return group;
  }

  /** Records the first failure (in shared memory too, so ranks waiting at a barrier wake up). */
  private mark(failure: RankFailure): void {
    if (this.failed !== undefined) return;
    this.transport.fail(failure.rank, failure.what);
    this.failed = this.transport.failure() ?? failure;
  }

  /** The failure that ended the group, if one did. */
  failure(): RankFailure | undefined {
    this.failed ??= this.transport.failure();
    return this.failed;
  }

  /**
   * Resolves when every worker has loaded its shard; rejects with the first RankFailure: a load
   * that threw, a thread that exited, or a rank whose load made no progress for timeoutMs.
   */
  ready(signal?: AbortSignal): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const pending = new Set(this.workers.map((_, i) => i + 1));
      const seen = this.workers.map((_, i) => ({ progress: this.transport.progressOf(i + 1), at: Date.now() }));
      let timer: NodeJS.Timeout | undefined;
      const done = (error?: Error) => {
        clearInterval(timer);
        this.workers.forEach((w) => w.off('message', onMessage[this.workers.indexOf(w)]));
        if (error) reject(error);
        else resolve();
      };
      const onMessage = this.workers.map((_, i) => (message: RankMessage) => {
        const rank = i + 1;
        if (message.type === 'error') {
          this.mark(new RankFailure(rank, `failed to load: ${message.message}`));
          done(this.failure());
          return;
        }
        pending.delete(rank);
        if (pending.size === 0) done();
      });
      this.workers.forEach((w, i) => w.on('message', onMessage[i]));
      timer = setInterval(() => {
        const failed = this.failure();
        if (failed) return done(failed);
        if (signal?.aborted) return done(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
        const now = Date.now();
        for (const rank of pending) {
          const s = seen[rank - 1];
          const progress = this.transport.progressOf(rank);
          if (progress !== s.progress) {
            s.progress = progress;
            s.at = now;
          } else if (now - s.at > this.timeoutMs) {
            this.mark(new RankFailure(rank, `stalled while loading: no part of its shard loaded for ${this.timeoutMs} ms`));
            return done(this.failure());
          }
        }
      }, Math.min(250, this.timeoutMs / 4));
    });
  }

  /** Sends `command` to every worker rank; throws the group's failure instead if there was one. */
  send(command: RankCommand): void {
    const failed = this.failure();
    if (failed) throw failed;
    for (const w of this.workers) w.postMessage(command);
  }

  /**
   * Ends every worker: after a failure at once (terminate), otherwise each disposes its shard and
   * exits, and a worker that has not within timeoutMs is terminated. No thread outlives this.
   */
  async close(): Promise<void> {
    this.closing = true;
    if (this.failure() === undefined) for (const w of this.workers) w.postMessage({ op: 'close' });
    else for (const w of this.workers) void w.terminate();
    const all = Promise.all(this.exited);
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), this.timeoutMs)));
    if ((await Promise.race([all, late])) === 'late') await Promise.all(this.workers.map((w) => w.terminate()));
    clearTimeout(timer);
    await all;
  }
}
