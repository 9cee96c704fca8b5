/**
 * Atomic publish: write to a temp file in the destination's directory, fsync it, rename it over
 * the destination, fsync the directory. A crash at any point leaves either the old file or the
 * complete new one, never a half-written file under the final name.
 *
 * The temp file is `.NAME.tmp-<pid>-<8 hex>`. A process killed mid-write leaves one behind; the
 * next AtomicFile for the same destination removes those whose process is gone, so litter is
 * bounded by the writers alive at once. (This assumes the directory is not shared with writers
 * on other hosts, whose pids mean nothing here.)
 */
import { randomBytes } from 'node:crypto';
import { open, readdir, rename, rm, stat, unlink, type FileHandle } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { FileWriteError, OutputPathError } from './errors.js';
import { nonRegularKind } from './file-access.js';

/**
 * A fresh temporary name beside `path`: `.NAME.tmp-<pid>-<8 hex>`, the name removeStaleTemps
 * clears once its process is gone. Outputs published by a rename of their own (a directory, or
 * several outputs renamed together) are written under it too.
 */
export function tempPathFor(path: string): string {
  return join(dirname(path), `.${basename(path)}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`);
}

export class AtomicFile {
  private state: 'open' | 'committed' | 'aborted' = 'open';

  private constructor(
    readonly path: string,
    readonly tempPath: string,
    readonly handle: FileHandle,
  ) {}

  /**
   * Starts writing `path`. Refuses a destination that exists and is not a regular file (a
   * device node, FIFO, socket or directory: the rename would replace it with a regular file).
   */
  static async create(path: string): Promise<AtomicFile> {
    await refuseNonRegular(path);
    await removeStaleTemps(path);
    const tempPath = tempPathFor(path);
    let handle: FileHandle;
    try {
      handle = await open(tempPath, 'wx', 0o644);
    } catch (cause) {
      // The user named `path`, not the temp file: say which directory refused and why.
      throw new OutputPathError(`cannot create the output (${errnoText(cause)} in ${dirname(path)})`, { file: path, cause });
    }
    return new AtomicFile(path, tempPath, handle);
  }

  /** Writes all of `bytes` at `position`; a failure (ENOSPC, EIO) names the destination. */
  async write(bytes: Uint8Array, position: number): Promise<void> {
    let done = 0;
    try {
      while (done < bytes.byteLength) {
        const { bytesWritten } = await this.handle.write(bytes, done, bytes.byteLength - done, position + done);
        done += bytesWritten;
      }
    } catch (cause) {
      throw new FileWriteError(`cannot write the output (${errnoText(cause)})`, { file: this.path, cause });
    }
  }

  async commit(): Promise<void> {
    if (this.state !== 'open') throw new Error(`AtomicFile ${this.path}: commit after ${this.state}`);
    this.state = 'committed';
    try {
      try {
        await this.handle.sync();
        await this.handle.close();
      } catch (cause) {
        throw new FileWriteError(`cannot write the output (${errnoText(cause)})`, { file: this.path, cause });
      }
      // Again at the last moment: something may have appeared at the path while we wrote.
      await refuseNonRegular(this.path);
      try {
        await rename(this.tempPath, this.path);
      } catch (cause) {
        throw new OutputPathError(`cannot publish the output (${errnoText(cause)})`, { file: this.path, cause });
      }
    } catch (error) {
      await unlink(this.tempPath).catch(() => undefined);
      throw error;
    }
    await syncDirectory(dirname(this.path));
  }

  async abort(): Promise<void> {
    if (this.state !== 'open') return;
    this.state = 'aborted';
    await this.handle.close().catch(() => undefined);
    await unlink(this.tempPath).catch(() => undefined);
  }
}

async function refuseNonRegular(path: string): Promise<void> {
  const info = await stat(path).catch(() => undefined);
  const kind = info === undefined ? undefined : nonRegularKind(info);
  if (kind !== undefined) {
    throw new OutputPathError(`is ${kind}; an output is only ever written as a regular file, and this one would be replaced`, { file: path, expected: 'a new file or a regular file to replace' });
  }
}

const TEMP_SUFFIX = /\.tmp-(\d+)-[0-9a-f]{8}$/;
/** A temp of a temp: `..NAME.tmp-<pid>-<hex>.tmp-<pid>-<hex>`, an AtomicFile writing a pending output. */
const NESTED_SUFFIX = /\.tmp-(\d+)-[0-9a-f]{8}\.tmp-\d+-[0-9a-f]{8}$/;

/**
 * Removes `.NAME.tmp-<pid>-<hex>` entries of `path` whose writing process no longer exists: an
 * AtomicFile's temp file, or an output written whole under that name before its rename (a file,
 * or a directory such as a DFlash drafter's), and the temp file of such a pending output.
 */
export async function removeStaleTemps(path: string): Promise<string[]> {
  const base = basename(path);
  const names = await readdir(dirname(path)).catch(() => [] as string[]);
  const removed: string[] = [];
  for (const name of names) {
    const m = name.startsWith(`..${base}`) ? NESTED_SUFFIX.exec(name.slice(base.length + 2)) : name.startsWith(`.${base}`) ? TEMP_SUFFIX.exec(name.slice(base.length + 1)) : null;
    if (m === null || m.index !== 0) continue;
    const pid = Number(m[1]);
    if (pid === process.pid || processAlive(pid)) continue;
    const full = join(dirname(path), name);
    if (await rm(full, { recursive: true }).then(() => true, () => false)) removed.push(full);
  }
  return removed;
}

function processAlive(pid: number): boolean {
  if (!Number.isSafeInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    // EPERM: it exists but belongs to someone else.
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

function errnoText(error: unknown): string {
  const e = error as NodeJS.ErrnoException;
  const what: Record<string, string> = { EACCES: 'permission denied', EPERM: 'operation not permitted', ENOENT: 'no such directory', ENOTDIR: 'a path component is not a directory', EROFS: 'read-only file system', ENOSPC: 'no space left on device', EDQUOT: 'disk quota exceeded', EISDIR: 'is a directory', EIO: 'input/output error', EFBIG: 'file too large', EXDEV: 'cross-device rename' };
  return e?.code ? `${e.code}: ${what[e.code] ?? e.message}` : String((error as Error)?.message ?? error);
}

/** fsync on a directory makes a rename durable on Linux; other platforms may refuse it. */
async function syncDirectory(dir: string): Promise<void> {
  let handle: FileHandle | undefined;
  try {
    handle = await open(dir, 'r');
    await handle.sync();
  } catch {
    // Not supported here (e.g. Windows): the rename is still atomic, only its durability is weaker.
  } finally {
    await handle?.close().catch(() => undefined);
  }
}

/** Writes a small file atomically. */
export async function writeFileAtomic(path: string, data: Uint8Array | string): Promise<void> {
  const file = await AtomicFile.create(path);
  try {
    await file.write(typeof data === 'string' ? new TextEncoder().encode(data) : data, 0);
  } catch (error) {
    await file.abort();
    throw error;
  }
  await file.commit();
}
