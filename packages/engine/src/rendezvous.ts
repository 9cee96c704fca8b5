/**
 * Where each rank of a launch sits, and a standalone NCCL-id rendezvous.
 *
 * launchPlans turns kdtree's flags (--tp ranks per node, --nnodes, --node-rank, --master-addr,
 * --master-port) or torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
 * MASTER_PORT), so that existing launchers work, into each rank's plan; the engine's launch
 * (tp-launch.ts, `kdtree run`) starts and joins its ranks from those plans.
 *
 * serveUniqueId / fetchUniqueId move only the 128-byte NCCL id, for a custom launcher that starts
 * its own ranks and needs them to share one communicator: the engine's launch does not use them,
 * since its ranks get the id with the run's setup (tp.ts), over the connection they open to rank
 * 0 anyway. Rank 0 serves the id over TCP at MASTER_ADDR:MASTER_PORT; every other rank connects
 * (retrying until the bound: rank 0 may not be up yet), says which rank it is, and reads the id.
 * Wire format (one connection per rank): the rank sends its rank as a u32 little-endian, rank 0
 * answers with the 128-byte id and closes. Rank 0 resolves once every rank 1..world-1 has had it,
 * and fails naming the ranks that never came within the bound.
 */
import { createServer, connect, type Socket } from 'node:net';
import { EngineError, argumentError } from './errors.js';
import { RankFailure } from './shared-memory-transport.js';

export const UNIQUE_ID_BYTES = 128;
/** torchrun's default port, for a launch that names none. */
export const DEFAULT_MASTER_PORT = 29500;

/** Where this process sits among the ranks of one run. */
export interface LaunchPlan {
  /** This process's global rank and the ranks in all. */
  rank: number;
  world: number;
  /** The rank on this host (its GPU ordinal). */
  localRank: number;
  masterAddr: string;
  masterPort: number;
}

/** The parts of a launch a user gives: flags, falling back to the torchrun environment. */
export interface LaunchFlags {
  /** Ranks per node (--tp). */
  tp?: number;
  nnodes?: number;
  nodeRank?: number;
  masterAddr?: string;
  masterPort?: number;
}

function envInt(env: NodeJS.ProcessEnv, name: string, min: number): number | undefined {
  const text = env[name];
  if (text === undefined || text === '') return undefined;
  const n = Number(text);
  if (!Number.isSafeInteger(n) || n < min) throw argumentError(name, `expected an integer >= ${min} in the environment, got '${text}'`);
  return n;
}

/**
 * The plan of every rank a node starts (`localRank` 0..tp-1 of node `nodeRank`), or, under
 * torchrun (RANK and WORLD_SIZE set), the one rank this process is.
 */
export function launchPlans(flags: LaunchFlags, env: NodeJS.ProcessEnv = process.env): LaunchPlan[] {
  const masterAddr = flags.masterAddr ?? env.MASTER_ADDR ?? '127.0.0.1';
  const masterPort = flags.masterPort ?? envInt(env, 'MASTER_PORT', 1) ?? DEFAULT_MASTER_PORT;
  if (!Number.isSafeInteger(masterPort) || masterPort < 1 || masterPort > 65535) throw argumentError('masterPort', `expected a TCP port in [1, 65535], got ${masterPort}`);
  const envRank = envInt(env, 'RANK', 0);
  const envWorld = envInt(env, 'WORLD_SIZE', 1);
  if (envRank !== undefined || envWorld !== undefined) {
    if (envRank === undefined || envWorld === undefined) throw argumentError('RANK', 'torchrun sets RANK and WORLD_SIZE together; only one of them is set');
    if (envRank >= envWorld) throw argumentError('RANK', `RANK ${envRank} is not below WORLD_SIZE ${envWorld}`);
    if (flags.tp !== undefined && flags.nnodes !== undefined && flags.tp * flags.nnodes !== envWorld) {
      throw argumentError('tp', `--tp ${flags.tp} x --nnodes ${flags.nnodes} is ${flags.tp * flags.nnodes} ranks, but WORLD_SIZE is ${envWorld}`);
    }
    return [{ rank: envRank, world: envWorld, localRank: envInt(env, 'LOCAL_RANK', 0) ?? envRank, masterAddr, masterPort }];
  }
  const tp = flags.tp ?? 1;
  const nnodes = flags.nnodes ?? 1;
  const nodeRank = flags.nodeRank ?? 0;
  for (const [name, v, min] of [['tp', tp, 1], ['nnodes', nnodes, 1], ['nodeRank', nodeRank, 0]] as const) {
    if (!Number.isSafeInteger(v) || v < min) throw argumentError(name, `expected an integer >= ${min}, got ${v}`);
  }
  if (nodeRank >= nnodes) throw argumentError('nodeRank', `node rank ${nodeRank} is not below --nnodes ${nnodes}`);
  if (nnodes > 1 && flags.masterAddr === undefined && env.MASTER_ADDR === undefined) throw argumentError('masterAddr', 'a run over several nodes needs --master-addr (node 0\'s address), or MASTER_ADDR');
  return Array.from({ length: tp }, (_, localRank) => ({ rank: nodeRank * tp + localRank, world: nnodes * tp, localRank, masterAddr, masterPort }));
}

/** Rank 0's side: serves `id` to ranks 1..world-1; resolves when each has it. */
export function serveUniqueId(id: Uint8Array, options: { world: number; port: number; host?: string; timeoutMs: number }): { listening: Promise<number>; done: Promise<void>; close: () => void } {
  if (id.byteLength !== UNIQUE_ID_BYTES) throw argumentError('id', `expected ${UNIQUE_ID_BYTES} bytes (an ncclUniqueId), got ${id.byteLength}`);
  const pending = new Set(Array.from({ length: options.world - 1 }, (_, i) => i + 1));
  const sockets = new Set<Socket>();
  let settle: { resolve: () => void; reject: (e: Error) => void } | undefined;
  const done = new Promise<void>((resolve, reject) => (settle = { resolve, reject }));
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
    socket.on('error', () => socket.destroy());
    let got = Buffer.alloc(0);
    socket.on('data', (chunk) => {
      got = Buffer.concat([got, chunk]);
      if (got.length < 4) return;
      const rank = got.readUInt32LE(0);
      if (rank < 1 || rank >= options.world) {
        socket.destroy();
        return;
      }
      socket.end(Buffer.from(id.buffer, id.byteOffset, id.byteLength));
      pending.delete(rank);
      if (pending.size === 0) finish();
    });
  });
  let timer: NodeJS.Timeout | undefined;
  const finish = (error?: Error) => {
    clearTimeout(timer);
    server.close();
    if (error) {
      for (const s of sockets) s.destroy();
      settle!.reject(error);
    } else settle!.resolve();
  };
  const listening = new Promise<number>((resolve, reject) => {
    server.once('error', (error) => {
      const e = new EngineError('KDTREE_ENGINE_RANK', `rank 0 cannot serve the NCCL id on ${options.host ?? '0.0.0.0'}:${options.port}: ${error.message}`, 'masterPort', { cause: error });
      reject(e);
      finish(e);
    });
    server.listen(options.port, options.host, () => {
      const address = server.address();
      resolve(typeof address === 'object' && address !== null ? address.port : options.port);
    });
  });
  listening.catch(() => undefined);
  if (pending.size === 0) finish();
  else {
    timer = setTimeout(() => {
      const missing = [...pending];
      finish(new RankFailure(missing[0], `did not join the rendezvous at port ${options.port} within ${options.timeoutMs} ms${missing.length > 1 ? ` (nor did ranks ${missing.slice(1).join(', ')})` : ''}`));
    }, options.timeoutMs);
  }
  const close = () => {
    if (pending.size > 0) finish(new EngineError('KDTREE_ENGINE_ABORTED', 'the rendezvous was closed', 'rendezvous'));
  };
  return { listening, done, close };
}

/** A rank's side: connects to rank 0 (retrying while it is not up yet) and reads the id. */
export async function fetchUniqueId(options: { rank: number; host: string; port: number; timeoutMs: number }): Promise<Uint8Array> {
  const deadline = Date.now() + options.timeoutMs;
  let last = '';
  while (Date.now() < deadline) {
    try {
      return await once(options, deadline - Date.now());
    } catch (error) {
      last = (error as Error).message;
      await new Promise((r) => setTimeout(r, Math.min(100, Math.max(0, deadline - Date.now()))));
    }
  }
  throw new RankFailure(0, `did not serve the NCCL id at ${options.host}:${options.port} to rank ${options.rank} within ${options.timeoutMs} ms${last ? ` (last: ${last})` : ''}`);
}

function once(options: { rank: number; host: string; port: number }, ms: number): Promise<Uint8Array> {
  return new Promise((resolve, reject) => {
    const socket = connect(options.port, options.host);
    const chunks: Buffer[] = [];
    const timer = setTimeout(() => socket.destroy(new Error('timed out')), ms);
    socket.on('connect', () => {
      const hello = Buffer.alloc(4);
      hello.writeUInt32LE(options.rank);
      socket.write(hello);
    });
    socket.on('data', (c) => chunks.push(c));
    socket.on('error', (e) => {
      clearTimeout(timer);
      reject(e);
    });
    socket.on('close', () => {
      clearTimeout(timer);
      const id = Buffer.concat(chunks);
      if (id.length === UNIQUE_ID_BYTES) resolve(new Uint8Array(id));
      else reject(new Error(`rank 0 sent ${id.length} bytes, expected ${UNIQUE_ID_BYTES}`));
    });
  });
}
