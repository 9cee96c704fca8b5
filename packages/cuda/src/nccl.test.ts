import { describe, expect, it } from 'vitest';
import { createBackend, ncclVersionString } from './backend.js';

// The NCCL binding on the cpu backend: every argument is checked as on cuda, then the call says
// NCCL is not here. A bad argument or a missing NCCL is a JS error, never a crash.
describe('nccl on the cpu backend', () => {
  const b = createBackend({ backend: 'cpu' });
  const f32 = (n: number) => b.zeros('f32', [n]);
  const id = new Uint8Array(128);

  function thrown(call: () => unknown): { code: string; message: string } {
    try {
      call();
    } catch (error) {
      return error as { code: string; message: string };
    }
    throw new Error('expected the call to throw');
  }

  it('reports NCCL unavailable, naming what it needs', () => {
    for (const [call, op] of [
      [() => b.ncclVersion(), 'ncclVersion'],
      [() => b.ncclUniqueId(), 'ncclUniqueId'],
      [() => b.native.ncclInit({ world: 2, rank: 1, id }), 'ncclInit'],
      [() => b.native.ncclAllReduce({ comm: 1, send: f32(4), recv: f32(4) }), 'ncclAllReduce'],
      [() => b.native.ncclAllGather({ comm: 1, send: f32(4), recv: f32(8) }), 'ncclAllGather'],
      [() => b.native.ncclBroadcast({ comm: 1, send: f32(4), recv: f32(4), root: 0 }), 'ncclBroadcast'],
      [() => b.native.ncclAsyncError(1), 'ncclAsyncError'],
      [() => b.native.ncclArm(1, 1000), 'ncclArm'],
      [() => b.native.ncclAbort(1), 'ncclAbort'],
      [() => b.native.ncclDestroy(1), 'ncclDestroy'],
    ] as const) {
      const e = thrown(call);
      expect(e.code, op).toBe('KDTREE_UNSUPPORTED');
      expect(e.message, op).toMatch(new RegExp(`^${op}: .*(cuda variant|cuda backend)`));
    }
  });

  it('checks ncclInit arguments first', () => {
    const bad: [Record<string, unknown>, RegExp][] = [
      [{ rank: 0, id }, /world is required/],
      [{ world: 0, rank: 0, id }, /world must be an integer in \[1, /],
      [{ world: 2, id }, /rank is required/],
      [{ world: 2, rank: 2, id }, /rank 2 is not in \[0, 2\)/],
      [{ world: 2, rank: -1, id }, /rank must be an integer/],
      [{ world: 2, rank: 0 }, /id must be a Uint8Array of 128 bytes/],
      [{ world: 2, rank: 0, id: new Uint8Array(64) }, /id must be 128 bytes .* got 64/],
      [{ world: 2, rank: 0, id: new Int32Array(32) }, /id must be a Uint8Array/],
    ];
    for (const [args, message] of bad) {
      const e = thrown(() => b.native.ncclInit(args as never));
      expect(e.code).toBe('KDTREE_INVALID_ARGUMENT');
      expect(e.message).toMatch(message);
    }
  });

  it('checks collective arguments first', () => {
    const bad: [() => unknown, RegExp][] = [
      [() => b.native.ncclAllReduce({ send: f32(4), recv: f32(4) } as never), /ncclAllReduce: comm is required/],
      [() => b.native.ncclAllReduce({ comm: 0, send: f32(4), recv: f32(4) }), /comm must be an integer in \[1, /],
      [() => b.native.ncclAllReduce({ comm: 1, recv: f32(4) } as never), /send is required/],
      [() => b.native.ncclAllReduce({ comm: 1, send: f32(4), recv: b.zeros('bf16', [4]) }), /one dtype, got send: f32 \[4\] and recv: bf16 \[4\]/],
      [() => b.native.ncclAllReduce({ comm: 1, send: f32(4), recv: f32(5) }), /as many values/],
      [() => b.native.ncclAllReduce({ comm: 1, send: b.zeros('i32', [4]), recv: b.zeros('i32', [4]) }), /a sum needs a float tensor/],
      [() => b.native.ncclAllReduce({ comm: 1, send: { ...f32(4), shape: [8] }, recv: f32(8) }), /send: f32 \[8\] needs 32 bytes; its buffer holds 16/],
      [() => b.native.ncclAllReduce({ comm: 1, send: f32(4), recv: f32(4), stream: 9 }), /unknown stream 9/],
      [() => b.native.ncclBroadcast({ comm: 1, send: f32(4), recv: f32(4) } as never), /root is required/],
      [() => b.native.ncclAsyncError('x' as never), /comm must be a number/],
      [() => b.native.ncclArm(1, -5), /ms must be an integer in \[0, /],
      [() => b.native.ncclInit({ world: 2, rank: 0, id, watchdogMs: 0 }), /watchdogMs must be an integer in \[1, /],
    ];
    for (const [call, message] of bad) {
      const e = thrown(call);
      expect(e.code).toBe('KDTREE_INVALID_ARGUMENT');
      expect(e.message).toMatch(message);
    }
  });

  it('formats version codes', () => {
    expect(ncclVersionString(22703)).toBe('2.27.3');
    expect(ncclVersionString(21903)).toBe('2.19.3');
  });
});
