/**
 * The frames on a relay's connections (socket-relay.ts): [type u32, n u32, bytes u32] then the
 * bytes, little-endian. Here, apart from the relay (a worker script), so that a joining rank's
 * first exchange with rank 0 (JOIN) speaks the same frames.
 */
import type { Socket } from 'node:net';

export const HELLO = 1;
export const PART = 2;
export const RESULT = 3;
export const READY = 4;
export const ERROR = 5;
export const PROGRESS_FRAME = 6;
export const FAIL = 7;
export const COMMAND = 8;
export const CLOSE = 9;
/** A rank started elsewhere asks for the run's setup: n its rank, bytes JSON { world }. */
export const JOIN = 10;
/** Rank 0's answer to JOIN: JSON RankJoinReply; or REFUSE with the reason. */
export const SETUP = 11;
export const REFUSE = 12;

export function frame(type: number, n: number, bytes: Uint8Array = new Uint8Array(0)): Buffer {
  const head = Buffer.alloc(12);
  head.writeUInt32LE(type, 0);
  head.writeUInt32LE(n, 4);
  head.writeUInt32LE(bytes.byteLength, 8);
  return Buffer.concat([head, bytes]);
}

/** Calls `on(type, n, bytes)` for each whole frame read from `socket`. */
export function readFrames(socket: Socket, on: (type: number, n: number, bytes: Buffer) => void): void {
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

