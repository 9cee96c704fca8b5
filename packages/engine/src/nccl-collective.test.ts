/**
 * NcclCollective's own logic on the cpu backend, with NCCL emulated as rank 0 of two ranks whose
 * peer's data is known: the all-gather's [world, rows, cols] -> [rows, world * cols] reorder, the
 * broadcast of mixed dtypes as bytes, argument checks, a watchdog abort turned into a
 * RankFailure naming the rank, the guard's deadline per forward pass, and an engine whose group
 * recorded a rank's failure aborting its communicator rather than destroying it. (The NCCL calls themselves run on the GPU: tools/gpu/nccl-check.)
 */
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { createBackend, numel, type NativeBackend, type TensorArg } from '@kdtree/cuda';
import { writeSyntheticModel } from '@kdtree/reference';
import { DeviceModel, Engine, ModelSource, type MemoryEstimate } from './index.js';
import { guardDeadlineMs, NcclCollective } from './nccl-collective.js';
import { RankFailure } from './shared-memory-transport.js';
import { tempDir } from './test-support/models.js';

const b = createBackend({ backend: 'cpu' });

/** The cpu backend's native object with NCCL emulated: rank 0 of 2, the peer's values being `peer(i)`. */
function emulated(peer: (i: number) => number) {
  const state = { armed: [] as number[], aborted: '', calls: [] as string[] };
  const host = (t: TensorArg) => {
    const out = new Float32Array(numel(t.shape));
    b.native.download(t.buffer, out, t.offset ?? 0);
    return out;
  };
  const nccl: Partial<NativeBackend> = {
    ncclInit: () => 5,
    ncclAllReduce: ({ send, recv }) => {
      state.calls.push('allReduce');
      const x = host(send).map((v, i) => v + peer(i));
      b.native.upload(recv.buffer, x, recv.offset ?? 0);
    },
    ncclAllGather: ({ send, recv }) => {
      state.calls.push('allGather');
      const mine = host(send);
      const all = new Float32Array(2 * mine.length);
      all.set(mine);
      all.set(mine.map((_, i) => peer(i)), mine.length);
      b.native.upload(recv.buffer, all, recv.offset ?? 0);
    },
    ncclBroadcast: ({ send, root }) => {
      state.calls.push(`broadcast ${send.dtype} [${send.shape.join(', ')}] from ${root}`);
    },
    ncclArm: (_comm, ms) => void state.armed.push(ms),
    ncclAsyncError: () => (state.aborted ? { result: 0, message: state.aborted, aborted: true } : { result: 0, message: '', aborted: false }),
    ncclAbort: () => void state.calls.push('abort'),
    ncclDestroy: () => void state.calls.push('destroy'),
  };
  const real = b.native as unknown as Record<string | symbol, unknown>;
  const native = new Proxy(b.native, {
    get: (target, key) => {
      if (key in nccl) return nccl[key as keyof NativeBackend];
      const v = real[key];
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
    },
  }) as NativeBackend;
  const backend = Object.assign(Object.create(Object.getPrototypeOf(b)), b, { native }) as typeof b;
  return { backend, state };
}

describe('NcclCollective', () => {
  const options = { rank: 0, world: 2, id: new Uint8Array(128), timeoutMs: 1000, gatherFloats: 3 * 4 };

  it('all-gathers rows as [rows, world * cols], rank r at columns r * cols', () => {
    const { backend } = emulated((i) => 100 + i);
    const c = new NcclCollective(backend, options);
    const rows = 3;
    const cols = 4;
    const local = b.fromArray('f32', [rows, cols], Float32Array.from({ length: rows * cols }, (_, i) => i));
    const out = b.zeros('f32', [rows, 2 * cols]);
    c.allGather(local, out, 0);
    const got = b.toArray(out) as Float32Array;
    for (let row = 0; row < rows; row++) {
      expect([...got.subarray(row * 8, row * 8 + 4)]).toEqual([0, 1, 2, 3].map((j) => row * cols + j));
      expect([...got.subarray(row * 8 + 4, row * 8 + 8)]).toEqual([0, 1, 2, 3].map((j) => 100 + row * cols + j));
    }
    // one row: straight into out
    const one = b.zeros('f32', [1, 2 * cols]);
    c.allGather(b.fromArray('f32', [1, cols], Float32Array.of(1, 2, 3, 4)), one, 0);
    expect([...(b.toArray(one) as Float32Array)]).toEqual([1, 2, 3, 4, 100, 101, 102, 103]);
  });

  it('all-reduces f32 in place and refuses other dtypes and shapes', () => {
    const { backend } = emulated(() => 0.5);
    const c = new NcclCollective(backend, options);
    const t = b.fromArray('f32', [2], Float32Array.of(1, 2));
    c.allReduceSum(t, 0);
    expect([...(b.toArray(t) as Float32Array)]).toEqual([1.5, 2.5]);
    expect(() => c.allReduceSum(b.zeros('bf16', [2]), 0)).toThrow(/expected an f32 tensor, got bf16/);
    expect(() => c.allGather(b.zeros('f32', [2, 4]), b.zeros('f32', [2, 4]), 0)).toThrow(/out \[rows, 2 \* cols\]/);
    expect(() => c.allGather(b.zeros('f32', [4, 4]), b.zeros('f32', [4, 8]), 0)).toThrow(/exceeds the staging of 12 values/);
  });

  it('broadcasts every tensor as its bytes', () => {
    const { backend, state } = emulated(() => 0);
    const c = new NcclCollective(backend, options);
    // the constructor's warm-up: one of each
    expect(state.calls).toEqual(['allReduce', 'allGather', 'broadcast u8 [4] from 0']);
    c.broadcast([b.zeros('i32', [3]), b.zeros('f32', [2, 2])], 0, 0);
    expect(state.calls.slice(3)).toEqual(['broadcast u8 [12] from 0', 'broadcast u8 [16] from 0']);
  });

  it('guards work with the watchdog armed, and a watchdog abort becomes a RankFailure naming the rank', () => {
    const { backend, state } = emulated(() => 0);
    const c = new NcclCollective(backend, { ...options, rank: 1 });
    expect(c.guard(() => 7)).toBe(7);
    expect(state.armed).toEqual([1000, 0]);
    state.aborted = 'nccl rank 1 of 2: timed out: a collective did not complete within the bound (a rank stalled or died); the communicator was aborted';
    let thrown: unknown;
    try {
      c.guard(() => {
        throw new Error('download: cudaErrorLaunchFailure');
      });
    } catch (error) {
      thrown = error;
    }
    expect(thrown).toBeInstanceOf(RankFailure);
    expect((thrown as RankFailure).rank).toBe(1);
    expect((thrown as Error).message).toMatch(/tensor-parallel rank 1 nccl rank 1 of 2: timed out/);
    c.close();
    expect(state.calls).toContain('abort');
  });

  it('destroys a healthy communicator on close', () => {
    const { backend, state } = emulated(() => 0);
    new NcclCollective(backend, options).close();
    expect(state.calls.slice(3)).toEqual(['destroy']);
  });

  it('arms one timeout per forward pass of the guarded work (a prefill of N chunks: N), at most what ncclArm takes', () => {
    expect([guardDeadlineMs(1000), guardDeadlineMs(1000, 1), guardDeadlineMs(1000, 5), guardDeadlineMs(1000, 0)]).toEqual([1000, 1000, 5000, 1000]);
    expect(guardDeadlineMs(3_600_000, 10_000)).toBe(2 ** 31 - 1);
    const { backend, state } = emulated(() => 0);
    const c = new NcclCollective(backend, options);
    expect(c.guard(() => 7, 5)).toBe(7);
    expect(c.guard(() => 8)).toBe(8);
    expect(state.armed).toEqual([5000, 0, 1000, 0]);
  });

  it('aborts on close when told a rank failed, though its own communicator reports no error', () => {
    const { backend, state } = emulated(() => 0);
    new NcclCollective(backend, options).close(true);
    expect(state.calls.slice(3)).toEqual(['abort']);
  });
});

describe('Engine.dispose over an NcclCollective', () => {
  const dir = tempDir('kdtree-nccl-dispose-');

  /** The calls that end an engine's communicator when its group reports `failure` (before and after its close). */
  async function disposal(failure: { before?: RankFailure; after?: RankFailure }): Promise<string[]> {
    const path = join(dir, 'tiny.kdtr');
    await writeSyntheticModel(path, { preset: 'tiny', seed: 7 }, 'engine nccl dispose test');
    const { backend, state } = emulated(() => 0);
    const collective = new NcclCollective(backend, { rank: 0, world: 2, id: new Uint8Array(128), timeoutMs: 1000, gatherFloats: 0 });
    const source = await ModelSource.open(path);
    const model = await DeviceModel.load(b, source, { rows: 17, collective });
    let closed = false;
    const group = { world: 2, pids: [], failure: () => (closed ? failure.after : failure.before), close: async () => void (closed = true), send: () => undefined };
    const options = { cacheTokens: 64, cacheDtype: 'f32' as const, activations: 'f32' as const, prefillChunk: 16, maxBudget: 16, maxDepth: 16 };
    const engine = new Engine(b, model, { path: source.path, configJson: source.configJson }, options, {} as MemoryEstimate, group as never);
    await source.close();
    await engine.dispose();
    expect(closed).toBe(true);
    return state.calls.slice(3);
  }

  it('aborts the communicator when the group recorded a rank\'s failure (a destroy may wait on the dead peer), destroys it otherwise', async () => {
    expect(await disposal({})).toEqual(['destroy']);
    expect(await disposal({ before: new RankFailure(1, 'exited (signal SIGKILL)') })).toEqual(['abort']);
    // a rank that had to be killed at the close
    expect(await disposal({ after: new RankFailure(1, 'did not end within 1000 ms of the close') })).toEqual(['abort']);
  });
});
