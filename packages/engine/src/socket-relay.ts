/**
 * A rank's relay thread (socket-transport.ts): owns the process's TCP sockets so that the rank's
 * own thread can block in a collective. Rank 0's relay listens and takes one connection per rank;
 * every other rank's relay connects to it. Besides the collectives' parts and results, the
 * connections carry rank 0's Runner commands to the ranks and the ranks' load reports and
 * failures back. A rank that another node (or torchrun) started first asks rank 0's relay for the
 * run's setup on a connection of its own (JOIN, answered by SETUP or REFUSE), then connects as
 * every rank does.
 */
import { writeSync } from 'node:fs';
import { connect, createServer, type Socket } from 'node:net';
import { parentPort, workerData } from 'node:worker_threads';
import { CLOSE, COMMAND, ERROR, FAIL, frame, HELLO, JOIN, PART, PROGRESS_FRAME, readFrames, READY, REFUSE, RESULT, SETUP } from './relay-frames.js';
import type { RankJoinReply } from './tp.js';
import { COLS, DONE, GUARD, GUARD_INIT, OP, OPS, PROGRESS, recordedFailure, recordFailure, REQUEST, ROOT, ROWS, SIZE, type RelayMemory } from './socket-transport.js';

export interface RelayData {
  memory: RelayMemory;
  rank: number;
  timeoutMs: number;
  /** Rank 0: the address to listen on (port 0: any); other ranks: rank 0's address. */
  host: string;
  port: number;
  /** Rank 0: what a rank that joins from elsewhere is sent (its own fault added). */
  join?: RankJoinReply;
}

/** Messages from a relay to its rank's thread. */
export type RelayMessage =
  | { type: 'listening'; port: number }
  | { type: 'ready'; rank: number }
  | { type: 'error'; rank: number; message: string }
  | { type: 'command'; command: unknown }
  | { type: 'lost' }
  | { type: 'sent' }
  | { type: 'joined'; rank: number }
  | { type: 'failed' }
  | { type: 'gone'; rank: number };

/** Messages from a rank's thread to its relay. */
export type RelayRequest = { type: 'command'; command: unknown } | { type: 'close' } | { type: 'drop' } | { type: 'ready' } | { type: 'error'; message: string } | { type: 'progress' } | { type: 'fail'; what: string };

const data = workerData as RelayData;
const port = parentPort!;
const { memory, rank } = data;
const world = memory.world;
const control = new Int32Array(memory.control);
const part = new Uint8Array(memory.data, 0, 4 * memory.slotFloats);
const result = new Float32Array(memory.data, 4 * memory.slotFloats);
let closing = false;

/** The part the rank's thread handed over for `call`, as bytes (a broadcast's non-root ranks send none). */
function ownPart(): { op: (typeof OPS)[number]; bytes: Uint8Array; rows: number; cols: number; root: number } {
  const op = OPS[Atomics.load(control, OP)];
  const rows = Atomics.load(control, ROWS);
  const root = Atomics.load(control, ROOT);
  const length = op === 'broadcast' ? (rank === root ? rows : 0) : 4 * Atomics.load(control, SIZE);
  return { op, bytes: part.slice(0, length), rows, cols: Atomics.load(control, COLS), root };
}

function finish(call: number): void {
  Atomics.store(control, DONE, call);
  Atomics.notify(control, DONE);
}

// Node 16+ has Atomics.waitAsync; the es2022 lib this package compiles against does not declare it
const waitAsync = (Atomics as unknown as { waitAsync(a: Int32Array, i: number, v: number): { async: boolean; value: Promise<string> | string } }).waitAsync;

/** Calls `on(call)` each time the rank's thread enters a collective. */
async function watchRequests(on: (call: number) => void): Promise<void> {
  let seen = 0;
  for (;;) {
    const wait = waitAsync(control, REQUEST, seen);
    if (wait.async) await wait.value;
    const call = Atomics.load(control, REQUEST);
    if (call !== seen) {
      seen = call;
      on(call);
    }
  }
}

/** Rank 0's answer to a JOIN from rank `r`: the run's setup, or why it cannot join. */
function joinReply(r: number, bytes: Buffer): Buffer {
  let asked: number | undefined;
  try {
    asked = (JSON.parse(bytes.toString('utf8')) as { world?: number }).world;
  } catch {
    // answered below as a mismatch
  }
  if (data.join === undefined) return frame(REFUSE, 0, Buffer.from('this run takes no ranks from other nodes'));
  if (asked !== world) return frame(REFUSE, 0, Buffer.from(`rank 0 runs ${world} ranks, but this rank was started for ${asked ?? '?'} (check --tp and --nnodes, or WORLD_SIZE, on every node)`));
  if (r < 1 || r >= world) return frame(REFUSE, 0, Buffer.from(`rank ${r} is not in [1, ${world})`));
  const { fault, ...reply } = data.join;
  return frame(SETUP, 0, Buffer.from(JSON.stringify({ ...reply, fault: fault?.rank === r ? fault : undefined } satisfies RankJoinReply)));
}

/**
 * While rank 0's thread is blocked where nothing can wake it (GUARD: NCCL's init, which waits for
 * every rank), a rank's failure or the timeout ends rank 0's process from here, saying why: its
 * forked ranks end with it (their IPC channel), the other nodes' ranks with their connections.
 */
function watchGuard(): void {
  let since: number | undefined;
  setInterval(() => {
    const mode = Atomics.load(control, GUARD);
    const failure = recordedFailure(memory);
    // steps: only a failure starts the clock (rank 0's thread, if it runs, takes it up meanwhile)
    if (mode === 0 || (mode !== GUARD_INIT && failure === undefined)) {
      since = undefined;
      return;
    }
    since ??= Date.now();
    if (mode === GUARD_INIT ? failure === undefined && Date.now() - since <= data.timeoutMs : Date.now() - since <= data.timeoutMs) return;
    const why = failure?.message ?? `tensor-parallel rank 0 waited ${data.timeoutMs} ms in NCCL's init (ncclCommInitRank) for ranks that did not reach it`;
    const where = mode === GUARD_INIT ? "NCCL's init" : 'an NCCL collective';
    writeSync(2, `kdtree: error: ${why}; rank 0 was blocked in ${where}, which cannot be interrupted, so its process ends\n`);
    process.kill(process.pid, 'SIGKILL');
  }, 100).unref();
}

function rank0(): void {
  const sockets: (Socket | undefined)[] = new Array(world).fill(undefined);
  /** Parts that arrived, per collective, by rank. */
  const parts = new Map<number, (Uint8Array | undefined)[]>();
  let current: { call: number; timer: NodeJS.Timeout } | undefined;

  const failed = (r: number, what: string) => {
    if (closing) return;
    recordFailure(memory, r, what);
    port.postMessage({ type: 'failed' } satisfies RelayMessage);
  };
  const complete = () => {
    if (current === undefined) return;
    const { call } = current;
    const got = parts.get(call);
    if (got === undefined || got.some((p, r) => r > 0 && p === undefined)) return;
    clearTimeout(current.timer);
    current = undefined;
    parts.delete(call);
    const own = ownPart();
    got[0] = own.bytes;
    const f32 = (bytes: Uint8Array) => new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
    let out: Uint8Array;
    if (own.op === 'all-reduce') {
      const n = own.bytes.byteLength / 4;
      const sum = result.subarray(0, n);
      sum.set(f32(got[0]));
      // rank order, one f32 rounding per add: the shared-memory transport's adds
      for (let r = 1; r < world; r++) {
        const p = f32(got[r]!);
        for (let i = 0; i < n; i++) sum[i] += p[i];
      }
      out = new Uint8Array(sum.buffer, sum.byteOffset, 4 * n).slice();
    } else if (own.op === 'all-gather') {
      const { rows, cols } = own;
      const width = cols * world;
      for (let r = 0; r < world; r++) {
        const p = f32(got[r]!);
        for (let row = 0; row < rows; row++) result.set(p.subarray(row * cols, (row + 1) * cols), row * width + r * cols);
      }
      out = new Uint8Array(result.buffer, result.byteOffset, 4 * rows * width).slice();
    } else {
      out = got[own.root]!.slice();
      new Uint8Array(result.buffer, result.byteOffset, out.byteLength).set(out);
    }
    const reply = frame(RESULT, call, out);
    for (let r = 1; r < world; r++) sockets[r]!.write(reply);
    finish(call);
  };

  const server = createServer((socket) => {
    socket.setNoDelay(true);
    let from = -1;
    readFrames(socket, (type, n, bytes) => {
      if (type === JOIN) {
        socket.end(joinReply(n, bytes));
        return;
      }
      if (type === HELLO) {
        // a rank number out of range or taken (a node started twice) is not let in
        if (n < 1 || n >= world || sockets[n] !== undefined) {
          socket.destroy();
          return;
        }
        from = n;
        sockets[from] = socket;
        port.postMessage({ type: 'joined', rank: from } satisfies RelayMessage);
        return;
      }
      if (from < 0) return;
      if (type === PART) {
        if (!parts.has(n)) parts.set(n, new Array(world).fill(undefined));
        parts.get(n)![from] = new Uint8Array(bytes);
        complete();
      } else if (type === READY) port.postMessage({ type: 'ready', rank: from } satisfies RelayMessage);
      else if (type === ERROR) {
        // recorded here, before the connection's close is: the load's error is what ended the rank
        failed(from, `failed to load: ${bytes.toString('utf8')}`);
        port.postMessage({ type: 'error', rank: from, message: bytes.toString('utf8') } satisfies RelayMessage);
      }
      else if (type === PROGRESS_FRAME) Atomics.add(control, PROGRESS + from, 1);
      else if (type === FAIL) failed(from, bytes.toString('utf8'));
    });
    socket.on('error', () => undefined);
    socket.on('close', () => {
      if (from < 0 || sockets[from] !== socket) return;
      failed(from, 'exited (its connection to rank 0 closed)');
      port.postMessage({ type: 'gone', rank: from } satisfies RelayMessage);
    });
  });
  server.listen(data.port, data.host, () => {
    const address = server.address();
    port.postMessage({ type: 'listening', port: typeof address === 'object' && address !== null ? address.port : data.port } satisfies RelayMessage);
  });
  port.on('message', (message: RelayRequest) => {
    if (message.type === 'command') {
      const bytes = frame(COMMAND, 0, Buffer.from(JSON.stringify(message.command)));
      for (let r = 1; r < world; r++) sockets[r]?.write(bytes);
    } else if (message.type === 'close') {
      closing = true;
      for (let r = 1; r < world; r++) sockets[r]?.end(frame(CLOSE, 0));
      server.close();
    } else if (message.type === 'drop') {
      // the run is over after a failure: every rank's connection closes, which ends the rank
      server.close();
      for (let r = 1; r < world; r++) sockets[r]?.destroy();
    }
  });
  watchGuard();
  void watchRequests((call) => {
    const timer = setTimeout(() => {
      const missing = Array.from({ length: world }, (_, r) => r).filter((r) => r > 0 && parts.get(call)?.[r] === undefined);
      const what = ownPart().op;
      failed(missing[0], `stalled: it did not reach ${what === 'all-reduce' ? 'an all-reduce' : what === 'all-gather' ? 'an all-gather' : 'a broadcast'} (collective ${call}) within ${data.timeoutMs} ms${missing.length > 1 ? ` (nor did ranks ${missing.slice(1).join(', ')})` : ''}`);
    }, data.timeoutMs);
    current = { call, timer };
    complete();
  });
}

function rankN(): void {
  const socket = connect({ host: data.host, port: data.port });
  socket.setNoDelay(true);
  socket.write(frame(HELLO, rank));
  readFrames(socket, (type, n, bytes) => {
    if (type === RESULT) {
      new Uint8Array(result.buffer, result.byteOffset, bytes.byteLength).set(bytes);
      finish(n);
    } else if (type === COMMAND) port.postMessage({ type: 'command', command: JSON.parse(bytes.toString('utf8')) } satisfies RelayMessage);
    else if (type === CLOSE) {
      closing = true;
      port.postMessage({ type: 'command', command: { op: 'close' } } satisfies RelayMessage);
    }
  });
  socket.on('error', () => undefined);
  socket.on('close', () => {
    if (closing) return;
    recordFailure(memory, 0, 'closed its connection');
    port.postMessage({ type: 'lost' } satisfies RelayMessage);
    // the rank's thread ends its process on 'lost'; one stuck where it cannot see the message
    // (a native call, an injected stall) is ended from here, so no rank outlives rank 0
    setTimeout(() => process.kill(process.pid, 'SIGKILL'), 2000);
  });
  port.on('message', (message: RelayRequest) => {
    if (message.type === 'ready') socket.write(frame(READY, 0));
    else if (message.type === 'error') socket.write(frame(ERROR, 0, Buffer.from(message.message)), () => port.postMessage({ type: 'sent' } satisfies RelayMessage));
    else if (message.type === 'progress') socket.write(frame(PROGRESS_FRAME, 0));
    else if (message.type === 'fail') {
      closing = true;
      socket.write(frame(FAIL, 0, Buffer.from(message.what)), () => port.postMessage({ type: 'sent' } satisfies RelayMessage));
    }
  });
  void watchRequests((call) => socket.write(frame(PART, call, ownPart().bytes)));
}

if (rank === 0) rank0();
else rankN();
