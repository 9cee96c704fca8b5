/** Explicit device memory: round trips, streams, events, and errors instead of crashes. */
import { KdtreeBackend } from '../backend.js';
import { expectEqual, expectThrows, type KernelCheck } from './harness.js';

const memory: KernelCheck = {
  name: 'memory: upload/download/copy/fill round trips, offsets, streams and events',
  run(b: KdtreeBackend) {
    const data = Float32Array.from({ length: 1000 }, (_, i) => i * 0.5 - 3);
    const a = b.fromArray('f32', [1000], data);
    const c = b.empty('f32', [1000]);
    const s = b.native.createStream();
    b.native.copy({ dst: c.buffer, src: a.buffer, bytes: 4000, stream: s });
    b.native.synchronize(s);
    expectEqual('copy', b.toArray(c) as Float32Array, data);
    b.native.fill(c.buffer, 0, s);
    b.native.synchronize(s);
    expectEqual('fill', b.toArray(c) as Float32Array, new Float32Array(1000));
    const part = new Float32Array(10);
    b.native.download(a.buffer, part, 40);
    expectEqual('offset download', part, data.subarray(10, 20));
    const ms = b.time(() => b.native.copy({ dst: c.buffer, src: a.buffer }), 0);
    if (!(ms >= 0)) throw new Error(`elapsed ${ms}`);
    b.native.destroyStream(s);
    b.free(a, c);
  },
};

const misuse: KernelCheck = {
  name: 'misuse throws JS errors: use after free, another backend\'s buffer, bad offsets and sizes, overlapping copies, integers past i32, unknown streams',
  run(b) {
    const t = b.fromArray('f32', [4], new Float32Array(4));
    // a second backend from the same addon: its buffers must not be accepted by this one
    const other = new KdtreeBackend({ ...b.loaded, native: b.loaded.module.createBackend('cpu') });
    const foreign = other.empty('f32', [4]);
    const y = b.empty('f32', [4]);
    expectThrows('foreign buffer', () => b.native.add({ a: t, b: foreign, out: y }), /b\.buffer: buffer belongs to another backend/);
    expectThrows('offset', () => b.native.add({ a: { ...t, offset: 64 }, b: t, out: y }), /a\.offset 64 is past the buffer's 16 bytes/);
    expectThrows('upload size', () => b.native.upload(t.buffer, new Float32Array(5)), /20 bytes at offset 0 do not fit the buffer's 16 bytes/);
    expectThrows('stream', () => b.native.add({ a: t, b: t, out: y, stream: 99 }), /unknown stream 99/);
    // 2^32 + 1 must not wrap to stream 1 or k = 1
    expectThrows('stream past i32', () => b.native.add({ a: t, b: t, out: y, stream: 2 ** 32 + 1 }), /stream must be an integer in \[0, 2147483647\], got 4294967297/);
    expectThrows('k past i32', () => b.native.topk({ x: t, values: y, ids: y, k: 2 ** 32 + 1 }), /k must be an integer in \[1, 2147483647\], got 4294967297/);
    expectThrows('copy srcOffset', () => b.native.copy({ dst: y.buffer, src: t.buffer, srcOffset: 20 }), /copy: srcOffset 20 is past src's 16 bytes/);
    expectThrows('copy size', () => b.native.copy({ dst: y.buffer, src: t.buffer, bytes: 12, dstOffset: 8 }), /copy: 12 bytes from srcOffset 0 to dstOffset 8 do not fit src's 16 and dst's 16 bytes/);
    expectThrows('copy overlap', () => b.native.copy({ dst: t.buffer, src: t.buffer, bytes: 8, dstOffset: 4 }), /copy: bytes \[0, 8\) and \[4, 12\) of one buffer overlap/);
    b.native.hold(50);
    b.synchronize();
    expectThrows('hold range', () => b.native.hold(-1), /microseconds must be an integer >= 0/);
    expectThrows('hold limit', () => b.native.hold(2e7), /hold: microseconds must be at most 10000000/);
    expectThrows('hold stream', () => b.native.hold(10, 99), /unknown stream 99/);
    expectThrows('dtype name', () => b.native.add({ a: { ...t, dtype: 'f8' as never }, b: t, out: y }), /a\.dtype 'f8' is not one of/);
    expectThrows('negative shape', () => b.native.add({ a: { ...t, shape: [-4] }, b: t, out: y }), /a\.shape\[0\] must be an integer >= 0/);
    b.free(t);
    expectThrows('use after free', () => b.native.add({ a: t, b: y, out: y }), /a\.buffer: use of a freed buffer/);
    expectThrows('double free', () => b.native.free(t.buffer), /use of a freed buffer/);
    other.free(foreign);
    b.free(y);
  },
};

export const MEMORY_CHECKS: KernelCheck[] = [memory, misuse];
