/**
 * A rank's relay thread (socket-transport.ts): owns the process's TCP sockets so that the rank's
 * own thread can block in a collective. Rank 0's relay listens and takes one connection per rank;
 * every other rank's relay connects to it. Besides the collectives' parts and results, the
 * connections carry rank 0's Runner commands to the ranks and the ranks' load reports and
 * failures back.
 *
 * Frames: [type u32, n u32, bytes u32] then the bytes (little-endian).
 */
import { connect, createServer, type Socket } from 'node:net';
import { parentPort, workerData } from 'node:worker_threads';
import { COLS, DONE, OP, OPS, PROGRESS, recordFailure, REQUEST, ROOT, ROWS, SIZE, type RelayMemory } from './socket-transport.js';

export interface RelayData {
  memory: RelayMemory;
  rank: number;
  timeoutMs: number;
  /** Rank 0: the address to listen on (port 0: any); other ranks: rank 0's address. */
  host: string;
  port: number;
}

/** Messages from a relay to its rank's thread. */
export type RelayMessage =
  | { type: 'listening'; port: number }
  | { type: 'ready'; rank: number }
  | { type: 'error'; rank: number; message: string }
  | { type: 'command'; command: unknown }
  | { type: 'lost' }
  | { type: 'sent' };

/** Messages from a rank's thread to its relay. */
export type RelayRequest = { type: 'command'; command: unknown } | { type: 'close' } | { type: 'ready' } | { type: 'error'; message: string } | { type: 'progress' } | { type: 'fail'; what: string };

const HELLO = 1;
const PART = 2;
const RESULT = 3;
const READY = 4;
const ERROR = 5;
const PROGRESS_FRAME = 6;
const FAIL = 7;
const COMMAND = 8;
const CLOSE = 9;

const data = workerData as RelayData;
const port = parentPort!;
const { memory, rank } = data;
const world = memory.world;
const control = new Int32Array(memory.control);
const part = new Uint8Array(memory.data, 0, 4 * memory.slotFloats);
const result = new Float32Array(memory.data, 4 * memory.slotFloats);
let closing = false;

function frame(type: number, n: number, bytes: Uint8Array = new Uint8Array(0)): Buffer {
  const head = Buffer.alloc(12);
  head.writeUInt32LE(type, 0);
  head.writeUInt32LE(n, 4);
  head.writeUInt32LE(bytes.byteLength, 8);
  return Buffer.concat([head, bytes]);
}

/** Calls `on(type, n, bytes)` for each whole frame read from `socket`. */
function readFrames(socket: Socket, on: (type: number, n: number, bytes: Buffer) => void): void {
  let pending: Buffer = Buffer.alloc(0);
  socket.on('data', (chunk: Buffer) => {
    pending = pending.length === 0 ? chunk : Buffer.concat([pending, chunk]);
    while (pending.length >= 12) {
      const length = pending.readUInt32LE(8);
      if (pending.length < 12 + length) break;
      on(pending.readUInt32LE(0), pending.readUInt32LE(4), pending.subarray(12, 12 + length));
      pending = pending.subarray(12 + length);
    }
  });
}

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

function rank0(): void {
  const sockets: (Socket | undefined)[] = new Array(world).fill(undefined);
  /** Parts that arrived, per collective, by rank. */
  const parts = new Map<number, (Uint8Array | undefined)[]>();
  let current: { call: number; timer: NodeJS.Timeout } | undefined;

  const failed = (r: number, what: string) => {
    if (closing) return;
    recordFailure(memory, r, what);
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
      if (type === HELLO) {
        from = n;
        sockets[from] = socket;
        return;
      }
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
      if (from > 0) failed(from, 'exited (its connection to rank 0 closed)');
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
    }
  });
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
