/**
 * The cuda variant's NCCL loader and watchdog (native/src/cuda/nccl.cc) without a GPU or NCCL:
 * built with the host C++ compiler and run against a stand-in libnccl.so.2 with NCCL's ABI
 * (native/test/fake_nccl.c), built also as older NCCLs than the engine takes, and with no library
 * at all.
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
/** The stand-in built reporting other versions: 2.9.9 and 2.8.4 (the code's older layout) are refused, 2.10.3 is the oldest taken. */
const versions = { old: 20909, older: 2804, oldest: 21003 } as const;

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
    for (const [name, code] of Object.entries(versions)) {
      mkdirSync(join(dir, name));
      execFileSync(cc, ['-shared', '-fPIC', `-DFAKE_NCCL_VERSION=${code}`, join(native, 'test', 'fake_nccl.c'), '-o', join(dir, name, 'libnccl.so.2')]);
    }
    execFileSync(cxx, ['-std=c++17', '-Wall', '-Wextra', '-Wno-unused-parameter', '-Werror', `-I${join(native, 'include')}`, `-I${join(native, 'src', 'cuda')}`, join(native, 'test', 'nccl_loader_test.cc'), join(native, 'src', 'cuda', 'nccl.cc'), '-o', join(dir, 'nccl_loader_test'), '-ldl', '-pthread']);
  }, 120_000);

  it('names libnccl.so.2 and what to install when it is missing', () => {
    // a directory without the library first; a system NCCL, if the machine has one, would be found after it
    const r = run(none);
    if (r.version.startsWith('0 ')) expect(r.version).toMatch(/^0 nccl: cannot load libnccl\.so\.2 \(.*\); .*install it/);
    else expect(r.version).toMatch(/^\d+ $/);
  });

  it('refuses an NCCL older than 2.10.3, naming its version and the file it was loaded from', () => {
    for (const [name, shown] of [['old', '2.9.9'], ['older', '2.8.4']] as const) {
      const path = join(dir, name, 'libnccl.so.2');
      expect(run(join(dir, name)).version, name).toBe(
        `0 nccl: ${path} is NCCL ${shown} (version code ${versions[name]}); the engine needs NCCL 2.10.3 or newer (ncclBfloat16): install a newer one (e.g. the libnccl2 package, or pip's nvidia-nccl-cu13) and make it findable (LD_LIBRARY_PATH)`,
      );
    }
    const oldest = run(join(dir, 'oldest'));
    expect(oldest.version).toBe('21003 ');
    expect(oldest['init rank 1']).toBe('ok');
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
