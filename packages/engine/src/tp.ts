/**
 * Tensor-parallel ranks on the cpu backend: rank 0 is the engine's own thread, ranks 1..N-1 are
 * worker threads (tp-worker.ts, over one SharedMemoryTransport) or processes (tp-process.ts, over
 * TCP: SocketTransport), each with its own cpu backend, its shard of the model read from the same
 * checkpoint, and its Runner (tp-rank.ts, shared by both). A RankLauncher starts them and
 * carries messages; everything else (readiness, the load watchdog, commands, closing) is this
 * group's, the same for both. Rank 0 sends every
 * state-changing Runner call to the workers (RankPeers) as a message before running it itself;
 * the collectives inside the steps keep the ranks in lockstep.
 *
 * Faults end the group and the run: a rank whose load throws reports it; a rank that throws in
 * a step, or whose thread exits, marks the shared memory failed and wakes every waiting rank; a
 * rank that stops making progress (loading: no part loaded, stepping: a barrier not reached) for
 * `timeoutMs` is named by the rank waiting for it. Every case ends with a RankFailure naming the
 * rank and what happened, and every worker terminated.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import type { HostTransport } from './collective.js';
import type { CacheDtype } from './kv-cache.js';
import type { ActivationDtype } from './workspace.js';
import type { RankCommand, RankPeers } from './runner.js';
import { RankFailure, SharedMemoryTransport, transportMemory, type TransportMemory } from './shared-memory-transport.js';
import { argumentError, EngineError } from './errors.js';
import type { RelayData, RelayMessage, RelayRequest } from './socket-relay.js';
import { relayMemory, SocketTransport } from './socket-transport.js';

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
  /** The ranks' backend (default cpu): on cuda each rank runs on the device of its local rank, with NCCL collectives. */
  backend?: 'cpu' | 'cuda';
}

/** The data a worker thread starts with. */
export interface RankWorkerData {
  memory: TransportMemory;
  rank: number;
  setup: RankSetup;
  timeoutMs: number;
  fault?: TpFault;
}

/** How the ranks other than rank 0 run: threads of this process, or processes of their own. */
export type TpRanks = 'threads' | 'processes';

/** What rank 0 tells every rank about the run (a rank started elsewhere asks for it: JOIN). */
export interface RankJoinReply {
  world: number;
  setup: RankSetup;
  slotFloats: number;
  timeoutMs: number;
  fault?: TpFault;
  /** Rank 0's NCCL unique id (hex), when the ranks are on the cuda backend. */
  ncclId?: string;
}

/** The data a rank process starts with (JSON in KDTREE_TP_RANK). */
export interface RankProcessData extends RankJoinReply {
  rank: number;
  /** The rank on its host: its CUDA device on the cuda backend. */
  localRank: number;
  /** Rank 0's relay. */
  host: string;
  port: number;
  /** Started by another node or by torchrun (not forked by rank 0): it reports its own end on stderr. */
  joined?: boolean;
}

/** Where rank 0's relay listens and the other nodes' ranks connect (processes only). */
export interface TpMaster {
  host: string;
  port: number;
}

/** How rank 0's engine starts the process ranks. */
export interface ProcessRankOptions {
  slotFloats: number;
  timeoutMs: number;
  fault?: TpFault;
  /** Ranks 0..localRanks-1 are this host's (forked here); the others join from other nodes (default: all). */
  localRanks?: number;
  /** Default 127.0.0.1 and a free port (every rank on this host). */
  master?: TpMaster;
  ncclId?: string;
}

/** Messages from a worker to rank 0. */
export type RankMessage = { type: 'ready' } | { type: 'error'; message: string };

/**
 * The CUDA device of local rank `localRank` among `localRanks` on a host with `devices` devices
 * (one rank per device, in order: CUDA_VISIBLE_DEVICES picks which).
 */
export function rankDevice(localRank: number, localRanks: number, devices: number): number {
  if (localRanks > devices) {
    throw argumentError('tp', `${localRanks} tensor-parallel ranks on this host need one CUDA device each (devices 0..${localRanks - 1}), but it has ${devices}${devices > 0 ? ` (run at most --tp ${devices} per node, or more nodes)` : ''}`);
  }
  return localRank;
}

/** An NCCL unique id as it travels in a rank's setup (hex) and back to its 128 bytes. */
export function ncclIdHex(id: Uint8Array): string {
  return Buffer.from(id.buffer, id.byteOffset, id.byteLength).toString('hex');
}

export function ncclIdBytes(hex: string | undefined): Uint8Array {
  if (hex === undefined || !/^[0-9a-f]{256}$/.test(hex)) throw argumentError('ncclId', `expected rank 0's NCCL unique id as 256 hex digits, got ${hex === undefined ? 'none' : `'${hex.slice(0, 40)}'`}`);
  return new Uint8Array(Buffer.from(hex, 'hex'));
}

/** A module of this package's build (under vitest this module runs from src/*.ts; threads and processes run the built one). */
export function builtModule(file: string): URL {
  return import.meta.url.endsWith('.ts') ? new URL(`../dist/${file}`, import.meta.url) : new URL(`./${file}`, import.meta.url);
}

/** The transport as rank 0's group uses it: the collectives plus the failure record and load counters. */
export interface GroupTransport extends HostTransport {
  failure(): RankFailure | undefined;
  fail(rank: number, what: string): void;
  progressOf(rank: number): number;
  /** Runs `work`, which may block where no failure wakes it, bounded by the relay (processes only). */
  blocking?<T>(work: () => T): T;
  /** Steps over NCCL: a failure rank 0's thread does not take up in time ends the process (processes only). */
  guardSteps?(): void;
}

/** Starts ranks 1..world-1 and carries rank 0's messages to them and theirs back. */
export interface RankLauncher {
  readonly transport: GroupTransport;
  /** Calls `on` with each rank's load report; returns the function that stops it. */
  onMessage(on: (rank: number, message: RankMessage) => void): () => void;
  post(command: RankCommand | { op: 'close' }): void;
  /** Ends every rank now (terminate, SIGKILL). */
  kill(): void;
  /** Settles when rank `rank` has ended. */
  readonly exited: Promise<void>[];
  /** Frees what rank 0 itself holds for the ranks (after every rank has ended). */
  release(): Promise<void>;
  /** Ranks that have not connected to rank 0 yet, and where they were to (ranks other nodes start). */
  unjoined?(): { ranks: number[]; at: string };
}

type OnExit = (rank: number, what: string) => void;

class ThreadRanks implements RankLauncher {
  readonly transport: SharedMemoryTransport;
  readonly exited: Promise<void>[] = [];
  private readonly workers: Worker[] = [];

  constructor(world: number, setup: RankSetup, options: { slotFloats: number; timeoutMs: number; fault?: TpFault }, onExit: OnExit) {
    const memory = transportMemory(world, options.slotFloats);
    this.transport = new SharedMemoryTransport(memory, 0, options.timeoutMs);
    for (let rank = 1; rank < world; rank++) {
      const data: RankWorkerData = { memory, rank, setup, timeoutMs: options.timeoutMs, fault: options.fault?.rank === rank ? options.fault : undefined };
      const worker = new Worker(builtModule('tp-worker.js'), { workerData: data });
      this.workers.push(worker);
      this.exited.push(
        new Promise<void>((resolve) => {
          worker.on('error', (error) => onExit(rank, `threw: ${error.message}`));
          worker.on('exit', (code) => {
            onExit(rank, `exited (code ${code})`);
            resolve();
          });
        }),
      );
    }
  }

  onMessage(on: (rank: number, message: RankMessage) => void): () => void {
    const handlers = this.workers.map((w, i) => {
      const h = (message: RankMessage) => on(i + 1, message);
      w.on('message', h);
      return h;
    });
    return () => this.workers.forEach((w, i) => w.off('message', handlers[i]));
  }

  post(command: RankCommand | { op: 'close' }): void {
    for (const w of this.workers) w.postMessage(command);
  }

  kill(): void {
    for (const w of this.workers) void w.terminate();
  }

  async release(): Promise<void> {}
}

/** The recorded failure of a rank whose socket closed before its exit was seen. */
const CONNECTION_CLOSED = 'exited (its connection to rank 0 closed)';

class ProcessRanks implements RankLauncher {
  readonly exited: Promise<void>[] = [];
  readonly children: ChildProcess[] = [];
  /** How each rank ended, once it has: 'code 3', 'signal SIGKILL'. */
  private readonly ends: (string | undefined)[] = [];
  private readonly listeners = new Set<(rank: number, message: RankMessage) => void>();
  /** Ranks connected to rank 0's relay. */
  private readonly joined = new Set<number>();
  private joinWaiters: (() => void)[] = [];
  /** Ends the wait for the ranks other nodes started (their connections are dropped). */
  private readonly remoteEnds: (() => void)[] = [];

  private constructor(
    readonly transport: GroupTransport,
    private readonly relay: Worker,
    private readonly at: string,
  ) {}

  static async start(world: number, setup: RankSetup, options: ProcessRankOptions, onExit: OnExit): Promise<ProcessRanks> {
    const memory = relayMemory(world, options.slotFloats);
    const localRanks = options.localRanks ?? world;
    const host = options.master?.host ?? '127.0.0.1';
    const join: RankJoinReply | undefined = localRanks < world ? { world, setup, slotFloats: options.slotFloats, timeoutMs: options.timeoutMs, fault: options.fault, ncclId: options.ncclId } : undefined;
    const relay = new Worker(builtModule('socket-relay.js'), { workerData: { memory, rank: 0, timeoutMs: options.timeoutMs, host, port: options.master?.port ?? 0, join } satisfies RelayData });
    const port = await new Promise<number>((resolve, reject) => {
      relay.once('error', (error) => reject(new EngineError('KDTREE_ENGINE_RANK', `rank 0 cannot listen for its ranks on ${host}:${options.master?.port ?? 0}: ${error.message}`, 'masterPort', { cause: error })));
      relay.on('message', (m: RelayMessage) => m.type === 'listening' && resolve(m.port));
    });
    const socket = new SocketTransport(memory, 0);
    let launcher: ProcessRanks | undefined;
    // a closed connection is named by how the rank exited, once that is known
    const transport: GroupTransport = {
      rank: 0,
      world,
      allReduceSum: (data) => socket.allReduceSum(data),
      allGather: (local, rows, cols, out) => socket.allGather(local, rows, cols, out),
      broadcast: (data, root) => socket.broadcast(data, root),
      fail: (rank, what) => socket.fail(rank, what),
      progressOf: (rank) => socket.progressOf(rank),
      blocking: (work) => socket.blocking(work),
      guardSteps: () => socket.guardSteps(),
      failure() {
        const failed = socket.failure();
        const end = failed?.what === CONNECTION_CLOSED ? launcher?.ends[failed.rank] : undefined;
        return end === undefined ? failed : new RankFailure(failed!.rank, `exited (${end})`);
      },
    };
    launcher = new ProcessRanks(transport, relay, `${host}:${port}`);
    const l = launcher;
    const entry = fileURLToPath(builtModule('tp-process.js'));
    // the ranks other nodes start end when their connection does
    for (let rank = localRanks; rank < world; rank++) {
      l.exited[rank - 1] = new Promise<void>((resolve) => {
        l.remoteEnds.push(resolve);
        relay.on('message', (m: RelayMessage) => m.type === 'gone' && m.rank === rank && resolve());
      });
    }
    for (let rank = 1; rank < localRanks; rank++) {
      const data: RankProcessData = { rank, localRank: rank, world, setup, slotFloats: options.slotFloats, timeoutMs: options.timeoutMs, fault: options.fault?.rank === rank ? options.fault : undefined, ncclId: options.ncclId, host, port };
      const child = fork(entry, [], { env: { ...process.env, KDTREE_TP_RANK: JSON.stringify(data) }, execArgv: [], stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
      l.children.push(child);
      l.exited[rank - 1] = new Promise<void>((resolve) => {
        child.on('error', (error) => onExit(rank, `could not be started: ${error.message}`));
        child.on('exit', (code, signal) => {
          l.ends[rank] = signal ? `signal ${signal}` : `code ${code}`;
          onExit(rank, `exited (${l.ends[rank]})`);
          resolve();
        });
      });
    }
    // the ranks' load reports come through the relay
    relay.on('message', (m: RelayMessage) => {
      if (m.type === 'ready') l.report(m.rank, { type: 'ready' });
      else if (m.type === 'error') l.report(m.rank, { type: 'error', message: m.message });
      // this thread's event loop runs, so it is not blocked in a collective: it takes the failure up
      else if (m.type === 'failed') socket.takeUp();
      else if (m.type === 'joined') {
        l.joined.add(m.rank);
        if (l.joined.size === world - 1) for (const w of l.joinWaiters.splice(0)) w();
      }
    });
    return l;
  }

  unjoined(): { ranks: number[]; at: string } {
    const ranks = Array.from({ length: this.transport.world - 1 }, (_, i) => i + 1).filter((r) => !this.joined.has(r));
    return { ranks, at: this.at };
  }

  /** Resolves when every rank has connected (or at once if all have). */
  allJoined(): Promise<void> {
    return this.unjoined().ranks.length === 0 ? Promise.resolve() : new Promise((resolve) => this.joinWaiters.push(resolve));
  }

  private report(rank: number, message: RankMessage): void {
    for (const on of this.listeners) on(rank, message);
  }

  onMessage(on: (rank: number, message: RankMessage) => void): () => void {
    this.listeners.add(on);
    return () => this.listeners.delete(on);
  }

  post(command: RankCommand | { op: 'close' }): void {
    this.relay.postMessage((command.op === 'close' ? { type: 'close' } : { type: 'command', command }) satisfies RelayRequest);
  }

  kill(): void {
    this.relay.postMessage({ type: 'drop' } satisfies RelayRequest);
    const failed = this.transport.failure();
    this.children.forEach((child, i) => {
      if (child.exitCode !== null || child.signalCode !== null) return;
      // a rank whose connection closed is already exiting: a moment to finish, so that the error
      // can say how it ended (its code), then killed like the rest
      if (failed?.rank === i + 1 && failed.what === CONNECTION_CLOSED) {
        const timer = setTimeout(() => child.kill('SIGKILL'), 1000);
        child.once('exit', () => clearTimeout(timer));
      } else child.kill('SIGKILL');
    });
    for (const end of this.remoteEnds) end();
  }

  async release(): Promise<void> {
    await this.relay.terminate();
  }
}

export class TpGroup implements RankPeers {
  private failed: RankFailure | undefined;
  private closing = false;
  /** When the ranks were started: the bound on their joining runs from here. */
  private readonly started = Date.now();

  private constructor(
    readonly world: number,
    readonly timeoutMs: number,
    private readonly launcher: RankLauncher,
  ) {}

  /** Rank 0's end of the transport. */
  get transport(): GroupTransport {
    return this.launcher.transport;
  }

  /** The ranks' process ids (processes only; tests check that none outlives the group). */
  get pids(): number[] {
    return this.launcher instanceof ProcessRanks ? this.launcher.children.map((c) => c.pid ?? -1) : [];
  }

  /**
   * Starts ranks 1..world-1 loading their shards, as threads or processes. `slotFloats`: the
   * largest collective's f32 values (a pass's [rows, hidden] all-reduce or [rows, vocab / world]
   * all-gather block).
   */
  static async start(world: number, setup: RankSetup, options: ProcessRankOptions & { ranks?: TpRanks }): Promise<TpGroup> {
    let group: TpGroup | undefined;
    const early: RankFailure[] = [];
    const onExit: OnExit = (rank, what) => {
      if (group === undefined) early.push(new RankFailure(rank, what));
      else if (!group.closing) group.mark(new RankFailure(rank, what));
    };
    const launcher = options.ranks === 'processes' ? await ProcessRanks.start(world, setup, options, onExit) : new ThreadRanks(world, setup, options, onExit);
    group = new TpGroup(world, options.timeoutMs, launcher);
    if (early.length > 0) group.mark(early[0]);
    return group;
  }

  /** Records the first failure (in the transport too, so ranks waiting in a collective wake up). */
  private mark(failure: RankFailure): void {
    if (this.failure() !== undefined) return;
    this.transport.fail(failure.rank, failure.what);
    this.failed = this.transport.failure() ?? failure;
  }

  /** The failure that ended the group, if one did. */
  failure(): RankFailure | undefined {
    return this.transport.failure() ?? this.failed;
  }

  /**
   * Resolves when every rank has loaded its shard; rejects with the first RankFailure: a load
   * that threw, a rank that exited, or a rank whose load made no progress for timeoutMs.
   */
  ready(signal?: AbortSignal): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const ranks = Array.from({ length: this.world - 1 }, (_, i) => i + 1);
      const pending = new Set(ranks);
      const seen = ranks.map((rank) => ({ progress: this.transport.progressOf(rank), at: Date.now() }));
      let timer: NodeJS.Timeout | undefined;
      const done = (error?: Error) => {
        clearInterval(timer);
        off();
        if (error) reject(error);
        else resolve();
      };
      const off = this.launcher.onMessage((rank, message) => {
        if (message.type === 'error') {
          this.mark(new RankFailure(rank, `failed to load: ${message.message}`));
          done(this.failure());
          return;
        }
        pending.delete(rank);
        if (pending.size === 0) done();
      });
      timer = setInterval(() => {
        const failed = this.failure();
        if (failed) return done(failed);
        if (signal?.aborted) return done(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
        const now = Date.now();
        const missing = this.unjoinedFor(now);
        if (missing) {
          this.mark(missing);
          return done(this.failure());
        }
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

  /** The failure naming the ranks that have not connected `timeoutMs` after the group started, if any have not. */
  private unjoinedFor(now: number): RankFailure | undefined {
    const u = this.launcher.unjoined?.();
    if (u === undefined || u.ranks.length === 0 || now - this.started <= this.timeoutMs) return undefined;
    const [first, ...rest] = u.ranks;
    return new RankFailure(first, `did not join the run at ${u.at} within ${this.timeoutMs} ms${rest.length > 0 ? ` (nor did ranks ${rest.join(', ')})` : ''}`);
  }

  /**
   * Resolves when every rank has connected to rank 0 (before a blocking NCCL init, which must not
   * begin while a rank may never come); rejects naming the missing ranks after timeoutMs.
   */
  async joined(): Promise<void> {
    const launcher = this.launcher;
    if (!(launcher instanceof ProcessRanks)) return;
    let timer: NodeJS.Timeout | undefined;
    const bound = new Promise<void>((_, reject) => {
      timer = setInterval(() => {
        const failed = this.failure() ?? this.unjoinedFor(Date.now());
        if (failed) {
          this.mark(failed);
          reject(this.failure());
        }
      }, Math.min(250, this.timeoutMs / 4));
    });
    try {
      await Promise.race([launcher.allJoined(), bound]);
    } finally {
      clearInterval(timer);
    }
  }

  /**
   * Runs `work`, which blocks this thread until every rank has joined it (NCCL's init): a rank
   * that fails or does not come within timeoutMs ends this process, the failure on stderr, since
   * nothing else can end that wait.
   */
  blocking<T>(work: () => T): T {
    const t = this.launcher.transport;
    if (t.blocking === undefined) throw new EngineError('KDTREE_ENGINE_ARGUMENT', 'a blocking NCCL init needs rank processes (tpRanks: processes)', 'tpRanks');
    return t.blocking(work);
  }

  /** The ranks' collectives are NCCL's from here on: see GroupTransport.guardSteps. */
  guardSteps(): void {
    this.launcher.transport.guardSteps?.();
  }

  /** Sends `command` to every other rank; throws the group's failure instead if there was one. */
  send(command: RankCommand): void {
    const failed = this.failure();
    if (failed) throw failed;
    this.launcher.post(command);
  }

  /**
   * Ends every rank: after a failure at once (terminate, SIGKILL), otherwise each disposes its
   * shard and exits, and a rank that has not within timeoutMs is killed. No rank outlives this.
   */
  async close(): Promise<void> {
    this.closing = true;
    if (this.failure() === undefined) this.launcher.post({ op: 'close' });
    else this.launcher.kill();
    const all = Promise.all(this.launcher.exited);
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), this.timeoutMs)));
    if ((await Promise.race([all, late])) === 'late') this.launcher.kill();
    clearTimeout(timer);
    await all;
    await this.launcher.release();
  }
}
