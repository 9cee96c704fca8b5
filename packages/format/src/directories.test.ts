import { mkdtempSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { makeDirectories } from './directories.js';

describe('makeDirectories', () => {
  const dir = mkdtempSync(join(tmpdir(), 'kdtree-dirs-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('makes the missing parents and returns the first it made, as mkdir -p does', async () => {
    const deep = join(dir, 'a', 'b', 'c');
    expect(await makeDirectories(deep)).toBe(join(dir, 'a'));
    expect(statSync(deep).isDirectory()).toBe(true);
    expect(await makeDirectories(deep)).toBeUndefined();
  });

  it('fails naming the path where a component is a file', async () => {
    writeFileSync(join(dir, 'file'), 'x');
    await expect(makeDirectories(join(dir, 'file', 'sub'))).rejects.toMatchObject({ code: 'ENOTDIR', path: join(dir, 'file') });
  });

  it('fails where a dangling symlink stands in the way (mkdir -p does too)', async () => {
    symlinkSync(join(dir, 'nowhere'), join(dir, 'dangling'));
    await expect(makeDirectories(join(dir, 'dangling'))).rejects.toMatchObject({ code: 'EEXIST' });
  });

  it.runIf(process.platform === 'linux')('fails, never loops, where the kernel refuses a child of a directory that exists (procfs)', async () => {
    await expect(makeDirectories('/proc/kdtree-no-such/sub')).rejects.toMatchObject({ path: '/proc/kdtree-no-such' });
  });
});
