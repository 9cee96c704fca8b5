/**
 * Atomic publish: write to a temp file in the destination's directory, fsync it, rename it over
 * the destination, fsync the directory. A crash at any point leaves either the old file or the
 * complete new one, never a half-written file under the final name.
 */
import { randomBytes } from 'node:crypto';
import { open, rename, unlink, type FileHandle } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';

export class AtomicFile {
  private state: 'open' | 'committed' | 'aborted' = 'open';

  private constructor(
    readonly path: string,
    readonly tempPath: string,
    readonly handle: FileHandle,
  ) {}

  static async create(path: string): Promise<AtomicFile> {
    const tempPath = join(dirname(path), `.${basename(path)}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`);
    const handle = await open(tempPath, 'wx', 0o644);
    return new AtomicFile(path, tempPath, handle);
  }

  async commit(): Promise<void> {
    if (this.state !== 'open') throw new Error(`AtomicFile ${this.path}: commit after ${this.state}`);
    this.state = 'committed';
    try {
      await this.handle.sync();
      await this.handle.close();
      await rename(this.tempPath, this.path);
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
    await file.handle.writeFile(data);
  } catch (error) {
    await file.abort();
    throw error;
  }
  await file.commit();
}
