/**
 * Positional reads that keep up with `cat` on a hot page cache. One pread of a large tensor into
 * a large buffer is limited by a single core copying out of the page cache (about 4 GB/s here);
 * several reads of a few MiB in flight on libuv's thread pool use every core (10-12 GB/s here,
 * where cat does 11). See docs/benchmarks/format-read.md.
 */
import type { FileHandle } from 'node:fs/promises';
import { FileReadError, TruncatedFileError, type ErrorFormat } from './errors.js';

export const READ_CHUNK_BYTES = 2 << 20;
export const READ_CONCURRENCY = 4;
/**
 * Streaming defaults: 1 MiB chunks, 4 in flight. The ring (5 MiB) stays in the CPU caches, so,
 * like cat's 128 KiB buffer, the copy out of the page cache never round-trips through DRAM;
 * measured 13 GB/s against cat's 10-11 (8 MiB chunks, spilling the caches: 6.6).
 */
export const STREAM_CHUNK_BYTES = 1 << 20;
export const STREAM_DEPTH = 4;
/** Node's fs.read takes at most 2 GiB - 1 per call. */
const MAX_SINGLE_READ = 0x7fff_f000;

export interface ReadContext {
  file: string;
  format: ErrorFormat;
  tensor?: string;
}

async function readExactly(
  handle: FileHandle,
  target: Uint8Array,
  targetOffset: number,
  length: number,
  position: number,
  context: ReadContext,
): Promise<void> {
  let done = 0;
  while (done < length) {
    const step = Math.min(length - done, MAX_SINGLE_READ);
    let bytesRead: number;
    try {
      ({ bytesRead } = await handle.read(target, targetOffset + done, step, position + done));
    } catch (cause) {
      // EIO from a failing disk, EISDIR, EINVAL from a special file (/proc/self/mem): a typed
      // error naming the file, not a bare errno without a path.
      const code = (cause as NodeJS.ErrnoException).code ?? (cause as Error).message;
      throw new FileReadError(`cannot read ${length} bytes at offset ${position} (${code})`, { ...context, cause });
    }
    if (bytesRead === 0) {
      throw new TruncatedFileError('file ends inside the data it declares', {
        ...context,
        expected: `${length} bytes at offset ${position}`,
        actual: `${done} bytes before end of file`,
      });
    }
    done += bytesRead;
  }
}

/** Reads `length` bytes at `position` into `target[targetOffset..]`, several chunks in flight. */
export async function preadFully(
  handle: FileHandle,
  target: Uint8Array,
  targetOffset: number,
  length: number,
  position: number,
  context: ReadContext,
): Promise<void> {
  if (length <= READ_CHUNK_BYTES) {
    await readExactly(handle, target, targetOffset, length, position, context);
    return;
  }
  let next = 0;
  const worker = async () => {
    while (next < length) {
      const start = next;
      next += READ_CHUNK_BYTES;
      const n = Math.min(READ_CHUNK_BYTES, length - start);
      await readExactly(handle, target, targetOffset + start, n, position + start, context);
    }
  };
  await Promise.all(Array.from({ length: READ_CONCURRENCY }, worker));
}

/**
 * Streams `length` bytes from `position` in order, as views of a small ring of reusable buffers
 * with up to `depth` reads in flight. A yielded view is valid until the consumer asks for the next
 * one. Memory stays at (depth + 1) x chunkBytes whatever the tensor size.
 */
export async function* streamRange(
  handle: FileHandle,
  position: number,
  length: number,
  context: ReadContext,
  options: { chunkBytes?: number; depth?: number } = {},
): AsyncGenerator<Uint8Array> {
  const chunkBytes = Math.max(4096, options.chunkBytes ?? STREAM_CHUNK_BYTES);
  const depth = Math.max(1, options.depth ?? STREAM_DEPTH);
  const chunkCount = Math.ceil(length / chunkBytes);
  if (chunkCount === 0) return;
  const ring = Array.from({ length: Math.min(depth + 1, chunkCount) }, () =>
    new Uint8Array(Math.min(chunkBytes, length)),
  );
  const pending: Promise<Uint8Array>[] = [];
  const start = (k: number) => {
    const buffer = ring[k % ring.length];
    const n = Math.min(chunkBytes, length - k * chunkBytes);
    pending.push(
      preadFully(handle, buffer, 0, n, position + k * chunkBytes, context).then(() => buffer.subarray(0, n)),
    );
  };
  let issued = 0;
  while (issued < Math.min(depth, chunkCount)) start(issued++);
  try {
    for (let k = 0; k < chunkCount; k++) {
      const view = await pending.shift()!;
      // Chunk k+depth reuses the buffer of chunk k-1, which the consumer released by asking for k.
      if (issued < chunkCount) start(issued++);
      yield view;
    }
  } finally {
    // Let reads still in flight finish before their buffers go away.
    await Promise.allSettled(pending);
  }
}
