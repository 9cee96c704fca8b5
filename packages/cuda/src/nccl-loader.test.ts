/**
 * The cuda variant's NCCL loader and watchdog (native/src/cuda/nccl.cc) without a GPU or NCCL:
 * built with the host C++ compiler and run against a stand-in libnccl.so.2 with NCCL's ABI
 * (native/test/fake_nccl.c), and with no library at all.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';

const native = fileURLToPath(new URL('../../../native', import.meta.url));
const cxx = process.env.CXX ?? 'g++';
const cc = process.env.CC ?? 'gcc';
const haveCompilers = spawnSync(cxx, ['--version']).status === 0 && spawnSync(cc, ['--version']).status === 0;
const dir = mkdtempSync(join(tmpdir(), 'kdtree-nccl-loader-'));
const fake = join(dir, 'fake');
const none = join(dir, 'none');

/** The harness's `name: value` lines, run with `libraryPath` as where libnccl.so.2 is found. */
function run(libraryPath: string): Record<string, string> {
  const out = execFileSync(join(dir, 'nccl_loader_test'), { env: { ...process.env, LD_LIBRARY_PATH: libraryPath }, encoding: 'utf8', timeout: 20_000 });
  return Object.fromEntries(out.trim().split('\n').map((line) => [line.slice(0, line.indexOf(':')), line.slice(line.indexOf(':') + 2)]));
}

describe.skipIf(!haveCompilers)(`the NCCL loader (built with ${cxx})`, () => {
  beforeAll(() => {
    mkdirSync(fake);
    mkdirSync(none);
    execFileSync(cc, ['-shared', '-fPIC', join(native, 'test', 'fake_nccl.c'), '-o', join(fake, 'libnccl.so.2')]);
    execFileSync(cxx, ['-std=c++17', '-Wall', '-Wextra', '-Wno-unused-parameter', '-Werror', `-I${join(native, 'include')}`, `-I${join(native, 'src', 'cuda')}`, join(native, 'test', 'nccl_loader_test.cc'), join(native, 'src', 'cuda', 'nccl.cc'), '-o', join(dir, 'nccl_loader_test'), '-ldl', '-pthread']);
  }, 120_000);

  it('names libnccl.so.2 and what to install when it is missing', () => {
    // a directory without the library first; a system NCCL, if the machine has one, would be found after it
    const r = run(none);
    if (r.version.startsWith('0 ')) expect(r.version).toMatch(/^0 nccl: cannot load libnccl\.so\.2 \(.*\); .*install it/);
    else expect(r.version).toMatch(/^\d+ $/);
  });

  it('passes the unique id by value and turns every result into a message with the op and sizes', () => {
    const r = run(fake);
    expect(r.version).toBe('22703 ');
    expect(r['init rank 1']).toBe('ok');
    expect(r['init rank 0']).toBe('ncclCommInitRank (rank 0 of 2): ncclResult 4 (invalid argument: fake detail)');
    expect(r['all-reduce']).toBe('ncclAllReduce (sum of 3 values of ncclDataType 7): ncclResult 5 (invalid usage: fake detail)');
  });

  it('the watchdog aborts on a missed deadline and on an asynchronous error, naming the rank, and not when disarmed', () => {
    const r = run(fake);
    expect(r.disarmed).toBe('fired 0 aborts 0');
    expect(r.deadline).toBe('fired 1 aborts 1 nccl rank 1 of 2: timed out: a collective did not complete within the bound (a rank stalled or died); the communicator was aborted');
    expect(r.async).toBe('fired 1 aborts 2 nccl rank 1 of 2: nccl communicator: ncclResult 6 (remote process exited or there was a network error: fake detail); the communicator was aborted');
  });
});
