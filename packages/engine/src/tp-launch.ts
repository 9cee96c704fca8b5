/**
 * Ranks started by something other than rank 0: the other nodes of a multi-node run (`kdtree run
 * --tp N --nnodes M --node-rank R`, whose process starts its N local ranks) and torchrun's
 * processes (each one rank). Such a rank knows only its own number, the world size and where rank
 * 0 is; it asks rank 0's relay for the rest (JOIN: the model's setup, the slot size, the timeout,
 * the NCCL id), then connects like the ranks rank 0 forks and serves the same way (tp-rank.ts).
 *
 * Every such rank ends its process when the run ends: 0 after rank 0's close, 1 (with one line on
 * stderr naming the rank and why) when rank 0 went away or the rank failed.
 */
import { fork, type ChildProcess } from 'node:child_process';
import { writeSync } from 'node:fs';
import { connect } from 'node:net';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { EngineError } from './errors.js';
import type { LaunchPlan } from './rendezvous.js';
import type { RankCommand } from './runner.js';
import { frame, JOIN, readFrames, REFUSE, SETUP } from './relay-frames.js';
import type { RelayData, RelayMessage, RelayRequest } from './socket-relay.js';
import { relayMemory, SocketTransport } from './socket-transport.js';
import { RankFailure } from './shared-memory-transport.js';
import { faultHook, serveRank } from './tp-rank.js';
import { builtModule, type RankJoinReply, type RankProcessData } from './tp.js';

/** What a rank started elsewhere knows (JSON in KDTREE_TP_JOIN). */
export interface RankJoin {
  rank: number;
  localRank: number;
  world: number;
  /** Rank 0's relay (the master address and port). */
  host: string;
  port: number;
  /** How long to keep trying to reach rank 0. */
  timeoutMs: number;
  /** This host's path of the model (default: rank 0's). */
  model?: string;
}

/** Asks rank 0 for the run's setup, retrying while rank 0 is not up yet, for up to timeoutMs. */
export async function joinRun(join: RankJoin): Promise<RankProcessData> {
  const deadline = Date.now() + join.timeoutMs;
  let last = '';
  for (;;) {
    try {
      const reply = await askSetup(join, Math.max(1, deadline - Date.now()));
      return { ...reply, setup: { ...reply.setup, model: join.model ?? reply.setup.model }, rank: join.rank, localRank: join.localRank, host: join.host, port: join.port, joined: true };
    } catch (error) {
      if (error instanceof RankFailure) throw error;
      last = (error as Error).message;
    }
    if (Date.now() >= deadline) break;
    await new Promise((r) => setTimeout(r, Math.min(200, Math.max(0, deadline - Date.now()))));
  }
  throw new RankFailure(join.rank, `could not join the run: rank 0 did not answer at ${join.host}:${join.port} within ${join.timeoutMs} ms${last ? ` (last: ${last})` : ''}`);
}

function askSetup(join: RankJoin, ms: number): Promise<RankJoinReply> {
  return new Promise((resolve, reject) => {
    const socket = connect(join.port, join.host);
    const timer = setTimeout(() => socket.destroy(new Error('timed out')), ms);
    let answered = false;
    socket.on('connect', () => socket.write(frame(JOIN, join.rank, Buffer.from(JSON.stringify({ world: join.world })))));
    readFrames(socket, (type, _n, bytes) => {
      answered = true;
      clearTimeout(timer);
      socket.destroy();
      if (type === SETUP) resolve(JSON.parse(bytes.toString('utf8')) as RankJoinReply);
      else if (type === REFUSE) reject(new RankFailure(join.rank, `was refused by rank 0 at ${join.host}:${join.port}: ${bytes.toString('utf8')}`));
      else reject(new Error(`rank 0 answered with frame ${type}`));
    });
    socket.on('error', (e) => {
      clearTimeout(timer);
      reject(e);
    });
    socket.on('close', () => {
      clearTimeout(timer);
      if (!answered) reject(new Error('closed without an answer'));
    });
  });
}

/**
 * Serves one rank in this process until the run ends, then ends the process: its collectives over
 * TCP to rank 0 through a relay thread (socket-transport.ts). It ends itself when rank 0 goes away
 * (the socket closes), so no rank outlives the run.
 */
export function serveRankProcess(data: RankProcessData): void {
  const { rank } = data;
  const memory = relayMemory(data.world, data.slotFloats);
  const relay = new Worker(builtModule('socket-relay.js'), { workerData: { memory, rank, timeoutMs: data.timeoutMs, host: data.host, port: data.port } satisfies RelayData });
  const transport = new SocketTransport(memory, rank, faultHook(data.fault));
  const post = (message: RelayRequest) => relay.postMessage(message);
  /** A rank another node started says why it ends (rank 0 names it too, but on its own host). */
  const end = (code: number, why?: string) => {
    if (why !== undefined && data.joined) writeSync(2, `kdtree: error: tensor-parallel rank ${rank} ${why}\n`);
    process.exit(code);
  };
  /** Ends this rank once the relay has sent what it was given (or after a second regardless). */
  const exitAfterSent = (code: number, why: string) => {
    relay.on('message', (m: RelayMessage) => m.type === 'sent' && end(code, why));
    setTimeout(() => end(code, why), 1000).unref();
  };

  relay.on('error', (error) => end(1, `lost its relay: ${error.message}`));
  // commands that come while the shard loads (a close, when rank 0's own load failed) wait for it
  const early: (RankCommand | { op: 'close' })[] = [];
  let onCommand: ((command: RankCommand | { op: 'close' }) => void) | undefined;
  relay.on('message', (m: RelayMessage) => {
    if (m.type === 'lost') end(1, `ended: its connection to rank 0 at ${data.host}:${data.port} closed (rank 0 ended the run or went away)`);
    if (m.type !== 'command') return;
    const command = m.command as RankCommand | { op: 'close' };
    if (onCommand) onCommand(command);
    else early.push(command);
  });

  void serveRank(
    rank,
    data.setup,
    {
      transport,
      progress: () => post({ type: 'progress' }),
      loaded(error) {
        if (error === undefined) return post({ type: 'ready' });
        exitAfterSent(1, `failed to load: ${error}`);
        post({ type: 'error', message: error });
      },
      onCommand(on) {
        onCommand = on;
        for (const command of early.splice(0)) on(command);
      },
      fail(what) {
        exitAfterSent(1, what);
        post({ type: 'fail', what });
      },
      closed: () => end(0),
    },
    data.fault,
    { localRank: data.localRank, ncclId: data.ncclId, timeoutMs: data.timeoutMs },
  );
}

/** Forks one rank process per plan (this node's ranks), each joining rank 0. */
function forkRank(plan: LaunchPlan, options: { timeoutMs: number; model?: string }): ChildProcess {
  const join: RankJoin = { rank: plan.rank, localRank: plan.localRank, world: plan.world, host: plan.masterAddr, port: plan.masterPort, timeoutMs: options.timeoutMs, model: options.model };
  return fork(fileURLToPath(builtModule('tp-process.js')), [], { env: { ...process.env, KDTREE_TP_JOIN: JSON.stringify(join) }, execArgv: [], stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
}

/** A node's ranks, started: their process ids, and the run's end. */
export interface NodeRanks {
  pids: number[];
  /** Resolves when every rank has ended after rank 0's close; rejects with the first rank that failed (the others then killed). */
  done: Promise<void>;
  /** Ends every rank now. */
  kill(): void;
}

/**
 * Starts this node's ranks (every plan of a node other than node 0) as processes that join rank
 * 0. When one fails the others are SIGKILLed at once, and `done` rejects naming it; a rank also
 * ends itself when rank 0's connection closes, and when this process dies (its IPC channel).
 */
export function startNodeRanks(plans: readonly LaunchPlan[], options: { timeoutMs: number; model?: string }): NodeRanks {
  if (plans.some((p) => p.rank === 0)) throw new EngineError('KDTREE_ENGINE_ARGUMENT', 'startNodeRanks: rank 0 is the engine (createEngine), not a rank to start', 'plans');
  const children = plans.map((plan) => forkRank(plan, options));
  const kill = () => children.forEach((c) => c.exitCode === null && c.signalCode === null && c.kill('SIGKILL'));
  let failed: RankFailure | undefined;
  const done = Promise.all(
    children.map(
      (child, i) =>
        new Promise<void>((resolve) => {
          child.on('error', (error) => {
            failed ??= new RankFailure(plans[i].rank, `could not be started: ${error.message}`);
            kill();
            // Node does not promise an 'exit' after an 'error'
            resolve();
          });
          child.on('exit', (code, signal) => {
            if (code !== 0) {
              failed ??= new RankFailure(plans[i].rank, `exited (${signal ? `signal ${signal}` : `code ${code}`})`);
              kill();
            }
            resolve();
          });
        }),
    ),
  ).then(() => {
    if (failed) throw failed;
  });
  return { pids: children.map((c) => c.pid ?? -1), done, kill };
}

/** Joins rank 0 as the one rank this process is (torchrun: RANK > 0) and serves until the run ends, then ends the process. */
export async function joinAsRank(plan: LaunchPlan, options: { timeoutMs: number; model?: string }): Promise<never> {
  serveRankProcess(await joinRun({ rank: plan.rank, localRank: plan.localRank, world: plan.world, host: plan.masterAddr, port: plan.masterPort, timeoutMs: options.timeoutMs, model: options.model }));
  return new Promise<never>(() => undefined);
}
