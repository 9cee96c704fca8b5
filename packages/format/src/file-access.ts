/**
 * Opening inputs. Readers take only regular files: a directory opens on Linux but fails the first
 * read with EISDIR, a FIFO blocks the open until a writer appears, and a device has no length to
 * validate a header against. Each of these gets a NotAFileError naming the path instead.
 */
import type { Stats } from 'node:fs';
import { open, stat, type FileHandle } from 'node:fs/promises';
import { HeaderTooLargeError, NotAFileError, type ErrorFormat } from './errors.js';
import { preadFully } from './positional-io.js';
import { parseStrictJsonBytes } from './strict-json.js';

/** "a directory", "a FIFO", ... for messages; undefined for a regular file. */
export function nonRegularKind(s: Stats): string | undefined {
  if (s.isFile()) return undefined;
  if (s.isDirectory()) return 'a directory';
  if (s.isCharacterDevice()) return 'a character device';
  if (s.isBlockDevice()) return 'a block device';
  if (s.isFIFO()) return 'a FIFO';
  if (s.isSocket()) return 'a socket';
  return 'not a regular file';
}

function notAFile(path: string, format: ErrorFormat, kind: string): NotAFileError {
  return new NotAFileError(`is ${kind}, not a regular file`, { file: path, format, expected: 'a regular file' });
}

/** Opens a regular file for positional reads; the size is the one fstat saw after the open. */
export async function openRegularFile(path: string, format: ErrorFormat): Promise<{ handle: FileHandle; size: number }> {
  // stat first: opening a FIFO for reading would block until some process opens it for writing.
  const before = nonRegularKind(await stat(path));
  if (before !== undefined) throw notAFile(path, format, before);
  const handle = await open(path, 'r');
  try {
    const info = await handle.stat();
    const kind = nonRegularKind(info);
    if (kind !== undefined) throw notAFile(path, format, kind);
    return { handle, size: info.size };
  } catch (error) {
    await handle.close();
    throw error;
  }
}

/** Reads a whole regular file (an index or a config), after checking its size against `limit`. */
export async function readRegularFile(path: string, format: ErrorFormat, limit: number, onTooLarge: (size: number) => Error): Promise<Uint8Array> {
  const { handle, size } = await openRegularFile(path, format);
  try {
    if (size > limit) throw onTooLarge(size);
    const bytes = new Uint8Array(size);
    await preadFully(handle, bytes, 0, size, 0, { file: path, format });
    return bytes;
  } finally {
    await handle.close();
  }
}

/** Largest JSON file (a config, a rules file) readJsonFile reads by default. */
export const MAX_JSON_FILE_BYTES = 64 * 1024 * 1024;

/**
 * Reads a small JSON file (a model config.json, a rules file) strictly: a regular file, UTF-8
 * without invalid sequences (never stored with U+FFFD), no duplicate keys, bounded nesting (see
 * strict-json.ts). `what` names it in errors ("model config").
 */
export async function readJsonFile(path: string, what = 'JSON file', maxBytes = MAX_JSON_FILE_BYTES): Promise<unknown> {
  const bytes = await readRegularFile(path, 'json', maxBytes, (size) =>
    new HeaderTooLargeError(`${what} larger than the limit`, { file: path, format: 'json', expected: `at most ${maxBytes} bytes`, actual: `${size} bytes` }),
  );
  return parseStrictJsonBytes(bytes, { file: path, format: 'json', what });
}
