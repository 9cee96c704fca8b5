import { spawnSync } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { BadMagicError, FileReadError, FormatError, NotAFileError } from './errors.js';
import { openBundle } from './kdtr-reader.js';
import { ShardedKdtrWriter } from './kdtr-writer.js';
import { openTensors } from './open.js';
import { openSafetensors, writeSafetensors } from './safetensors.js';
import { tempDir } from './test-support/tmp.js';

const dir = tempDir('kdtree-open-');

describe('opening inputs', () => {
  it('a file that is neither KDTR nor safetensors says so', async () => {
    // A writer killed before its preamble leaves zeros at the start (the temp file of an import).
    const zeros = join(dir, 'zeros.kdtr');
    writeFileSync(zeros, new Uint8Array(8192));
    await expect(openTensors(zeros)).rejects.toThrow(BadMagicError);
    await expect(openTensors(zeros)).rejects.toThrow(`${zeros}: neither a KDTR bundle nor a safetensors file (nor a JSON index of either)`);
    const text = join(dir, 'notes.txt');
    writeFileSync(text, 'hello, these are notes');
    await expect(openTensors(text)).rejects.toThrow(/neither a KDTR bundle nor a safetensors file.*68 65 6c 6c/);
    const empty = join(dir, 'empty');
    writeFileSync(empty, '');
    await expect(openTensors(empty)).rejects.toThrow(/\(empty file\)/);
    // Read directly as safetensors, the zeros are "not a safetensors file", not bad JSON.
    await expect(openSafetensors(zeros)).rejects.toThrow(/not a safetensors file: the header does not start with "\{"/);
  });

  it('a directory, FIFO or device where a file is needed is a NotAFileError', async () => {
    const fifo = join(dir, 'fifo');
    expect(spawnSync('mkfifo', [fifo]).status).toBe(0);
    // A FIFO must not block the open (nobody writes to it).
    for (const [path, kind] of [[fifo, 'a FIFO'], ['/dev/zero', 'a character device']] as const) {
      await expect(openTensors(path)).rejects.toThrow(NotAFileError);
      await expect(openTensors(path)).rejects.toThrow(`${path}: is ${kind}, not a regular file`);
      await expect(openBundle(path)).rejects.toThrow(NotAFileError);
    }
    const d = join(dir, 'adir');
    mkdirSync(d);
    await expect(openBundle(d)).rejects.toThrow(`${d}: is a directory, not a regular file`);
  });

  it('a shard path that is a directory is named, not an EISDIR', async () => {
    const index = join(dir, 'b.kdtr.json');
    const w = await ShardedKdtrWriter.create(index);
    await w.add({ name: 'a', dtype: 'U8', shape: [4] }, new Uint8Array(4));
    const [shard] = (await w.close()).shards;
    spawnSync('rm', [shard.path]);
    mkdirSync(shard.path);
    await expect(openBundle(index)).rejects.toThrow(`${shard.path}: is a directory, not a regular file`);
    const hf = join(dir, 'hf');
    mkdirSync(join(hf, 'model-00001-of-00001.safetensors'), { recursive: true });
    writeFileSync(join(hf, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { a: 'model-00001-of-00001.safetensors' } }));
    await expect(openTensors(hf)).rejects.toThrow(NotAFileError);
  });

  it('a file the kernel will not read is a FileReadError naming it', async () => {
    // /proc/self/mem is a "regular file" of size 0 (reading its offset 0 fails with EIO): a typed
    // error, never an errno without a path.
    await expect(openTensors('/proc/self/mem')).rejects.toThrow(FormatError);
    await expect(openBundle('/proc/self/mem')).rejects.toThrow(FormatError);
    await expect(openSafetensors('/proc/self/mem')).rejects.toThrow(FormatError);
    const big = join(dir, 'big.safetensors');
    await writeSafetensors(big, [{ name: 'x', dtype: 'U8', shape: [4], data: new Uint8Array(4) }]);
    const store = await openSafetensors(big);
    // A read failing under the store (here: its handle closed behind its back) names the file.
    await (store as unknown as { files: { handle: { close(): Promise<void> } }[] }).files[0].handle.close();
    await expect(store.read('x')).rejects.toThrow(FileReadError);
    await expect(store.read('x')).rejects.toThrow(new RegExp(`^${big}: tensor 'x': cannot read 4 bytes at offset \\d+ \\(EBADF\\)`));
    await store.close().catch(() => undefined);
  });
});
