import { spawn, spawnSync } from 'node:child_process';
import { existsSync, lstatSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { AtomicFile, removeStaleTemps, tempPathFor, writeFileAtomic } from './atomic-file.js';
import { OutputPathError } from './errors.js';
import { KdtrWriter } from './kdtr-writer.js';
import { writeSafetensors } from './safetensors.js';
import { tempDir } from './test-support/tmp.js';

const dir = tempDir('kdtree-atomic-');

/** The pid of a process that has exited (its number is free again). */
function deadPid(): number {
  const child = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' });
  return Number(child.stdout);
}

describe('AtomicFile', () => {
  it('removes the temp files of dead writers of the same output, and only those', async () => {
    const out = join(dir, 'model.kdtr');
    const live = spawn(process.execPath, ['-e', 'setTimeout(() => {}, 60000)']);
    try {
      const stale = join(dir, `.model.kdtr.tmp-${deadPid()}-0badc0de`);
      const alive = join(dir, `.model.kdtr.tmp-${live.pid}-12345678`);
      const other = join(dir, `.other.kdtr.tmp-${deadPid()}-0badc0de`);
      const unrelated = join(dir, '.model.kdtr.tmp-notes');
      for (const f of [stale, alive, other, unrelated]) writeFileSync(f, 'x'.repeat(100));
      await writeFileAtomic(out, 'new');
      expect(readFileSync(out, 'utf8')).toBe('new');
      expect(existsSync(stale)).toBe(false);
      expect([alive, other, unrelated].map(existsSync)).toEqual([true, true, true]);
      expect(await removeStaleTemps(join(dir, 'other.kdtr'))).toEqual([other]);
    } finally {
      live.kill();
    }
  });

  it("removes a dead run's output pending under a temp name (a file or a directory) and that pending output's own temp", async () => {
    const out = join(dir, 'pending.kdtr');
    const pid = deadPid();
    const file = join(dir, `.pending.kdtr.tmp-${pid}-0123abcd`);
    const directory = join(dir, `.pending.kdtr.tmp-${pid}-4567abcd`);
    const nested = join(dir, `..pending.kdtr.tmp-${pid}-89abcdef.tmp-${pid}-01234567`);
    const unrelated = join(dir, `..pending.kdtr.notes`);
    writeFileSync(file, 'x');
    mkdirSync(directory);
    writeFileSync(join(directory, 'config.json'), '{}');
    writeFileSync(nested, 'x');
    writeFileSync(unrelated, 'x');
    expect((await removeStaleTemps(out)).sort()).toEqual([nested, file, directory].sort());
    expect([file, directory, nested, unrelated].map(existsSync)).toEqual([false, false, false, true]);
    // tempPathFor names a pending output so: beside it, this process's pid, fresh each time; a live
    // writer's is kept
    const mine = tempPathFor(out);
    expect(mine).toMatch(new RegExp(`^${dir.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}/\\.pending\\.kdtr\\.tmp-${process.pid}-[0-9a-f]{8}$`));
    expect(tempPathFor(out)).not.toBe(mine);
    writeFileSync(mine, 'x');
    expect(await removeStaleTemps(out)).toEqual([]);
    expect(existsSync(mine)).toBe(true);
  });

  it('every writer cleans up after a writer killed mid-write', async () => {
    const out = join(dir, 'killed.kdtr');
    // A writer that is killed while its temp file is open, as with kill -9 during an import.
    // The child runs the built package (dist/), as the CLI tests do.
    const script = `import('${new URL('../dist/kdtr-writer.js', import.meta.url).href}').then(async ({ KdtrWriter }) => {
      const w = await KdtrWriter.create(${JSON.stringify(out)});
      await w.add({ name: 'a', dtype: 'U8', shape: [8192] }, new Uint8Array(8192));
      process.kill(process.pid, 'SIGKILL');
    })`;
    const r = spawnSync(process.execPath, ['--input-type=module', '-e', script]);
    expect(r.signal).toBe('SIGKILL');
    expect(readdirSync(dir).filter((n) => n.startsWith('.killed.kdtr.tmp-'))).toHaveLength(1);
    const w = await KdtrWriter.create(out);
    await w.close();
    expect(readdirSync(dir).filter((n) => n.startsWith('.killed.kdtr.tmp-'))).toEqual([]);
  });

  it('never replaces a FIFO, device node or directory at the output path', async () => {
    const fifo = join(dir, 'pipe');
    expect(spawnSync('mkfifo', [fifo]).status).toBe(0);
    const sub = join(dir, 'a-dir');
    mkdirSync(sub);
    for (const [path, kind] of [[fifo, 'a FIFO'], ['/dev/null', 'a character device'], [sub, 'a directory']] as const) {
      await expect(writeFileAtomic(path, 'x')).rejects.toThrow(OutputPathError);
      await expect(writeFileAtomic(path, 'x')).rejects.toThrow(`${path}: is ${kind}`);
      await expect(KdtrWriter.create(path)).rejects.toThrow(OutputPathError);
      await expect(writeSafetensors(path, [])).rejects.toThrow(OutputPathError);
    }
    expect(lstatSync(fifo).isFIFO()).toBe(true);
    expect(lstatSync('/dev/null').isCharacterDevice()).toBe(true);
    expect(lstatSync(sub).isDirectory()).toBe(true);
  });

  it('checks the destination again when it publishes', async () => {
    const out = join(dir, 'late');
    const file = await AtomicFile.create(out);
    await file.write(new TextEncoder().encode('data'), 0);
    expect(spawnSync('mkfifo', [out]).status).toBe(0);
    await expect(file.commit()).rejects.toThrow(/late: is a FIFO/);
    expect(lstatSync(out).isFIFO()).toBe(true);
    expect(readdirSync(dir).filter((n) => n.startsWith('.late.tmp-'))).toEqual([]);
  });

  it('an output it cannot create is named as the user gave it, not as the temp file', async () => {
    const out = join(dir, 'no-such-dir', 'x.kdtr');
    const error = await writeFileAtomic(out, 'x').catch((e: unknown) => e);
    expect(error).toBeInstanceOf(OutputPathError);
    expect((error as OutputPathError).file).toBe(out);
    expect((error as Error).message).toBe(`${out}: cannot create the output (ENOENT: no such directory in ${join(dir, 'no-such-dir')})`);
    expect((error as Error).message).not.toMatch(/tmp-/);
  });
});
