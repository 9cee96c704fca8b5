/**
 * `mkdir -p` that fails instead of spinning: Node 20's recursive mkdir loops forever where the
 * kernel answers ENOENT for a child of a directory that exists (procfs, sysfs), so outputs make
 * their directories one component at a time, each failure reported with its path.
 */
import { mkdir, stat } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';

/** Makes `dir` and any missing parents; returns the first directory it made (undefined: it existed), as `mkdir(dir, { recursive: true })` does; a dangling symlink in the way is an error. */
export async function makeDirectories(dir: string): Promise<string | undefined> {
  const missing: string[] = [];
  for (let at = resolve(dir); ; at = dirname(at)) {
    const info = await stat(at).catch((error: NodeJS.ErrnoException) => {
      // ENOTDIR: a parent is a file, which the walk up finds and names
      if (error.code === 'ENOENT' || error.code === 'ENOTDIR') return undefined;
      throw error;
    });
    if (info !== undefined) {
      if (!info.isDirectory()) throw Object.assign(new Error(`ENOTDIR: not a directory, mkdir '${at}'`), { code: 'ENOTDIR', path: at, syscall: 'mkdir' });
      break;
    }
    missing.unshift(at);
    if (dirname(at) === at) break;
  }
  let first: string | undefined;
  for (const at of missing) {
    const made = await mkdir(at).then(
      () => true,
      async (error: NodeJS.ErrnoException) => {
        // another writer made it in between: a directory, or an error as for one that was there
        if (error.code !== 'EEXIST' || !(await stat(at).then((s) => s.isDirectory(), () => false))) throw error;
        return false;
      },
    );
    if (made) first ??= at;
  }
  return first;
}
