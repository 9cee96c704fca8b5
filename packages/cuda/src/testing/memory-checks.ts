/** Explicit device memory: round trips, streams, events, and errors instead of crashes. */
import { KdtreeBackend } from '../backend.js';
import { expectEqual, expectThrows, fail, withTensors, type KernelCheck } from './harness.js';

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

const streamsAndPinned: KernelCheck = {
  name: 'waitEvent orders one stream after another; upload from allocHost memory is queued on its stream (and from other memory complete on return); freeHost detaches; memoryInfo',
  run(b) {
    const n = 1 << 20;
    const values = Float32Array.from({ length: n }, (_, i) => (i % 1000) - 500);
    const s1 = b.native.createStream();
    const s2 = b.native.createStream();
    const e = b.native.createEvent();
    withTensors(b, (track) => {
      const src = track(b.fromArray('f32', [n], values));
      const mid = track(b.zeros('f32', [n]));
      const dst = track(b.zeros('f32', [n]));
      // s1 is held, then writes mid; s2 reads mid only after s1's record (on cuda, without the
      // wait its copy would run during the hold and read zeros)
      b.native.hold(20_000, s1);
      b.native.copy({ dst: mid.buffer, src: src.buffer, stream: s1 });
      b.native.recordEvent(e, s1);
      b.native.waitEvent(e, s2);
      b.native.copy({ dst: dst.buffer, src: mid.buffer, stream: s2 });
      b.native.synchronize(s2);
      expectEqual('copied after waitEvent', b.toArray(dst) as Float32Array, values);
      b.native.synchronize();

      const host = b.native.allocHost(4 * n);
      if (!(host instanceof ArrayBuffer) || host.byteLength !== 4 * n) fail(`allocHost returned ${String(host)}`);
      const pinned = new Float32Array(host);
      pinned.set(values.map((v) => -v));
      b.native.hold(20_000, s1);
      const t = performance.now();
      b.native.upload(dst.buffer, pinned, 0, s1);
      const ms = performance.now() - t;
      // on cuda the copy waits behind the 20 ms hold: an upload that returned in far less was queued
      if (b.kind === 'cuda' && ms > 10) fail(`upload from allocHost memory took ${ms.toFixed(1)} ms: it waited for the stream instead of queueing`);
      b.native.synchronize(s1);
      expectEqual('upload from pinned memory', b.toArray(dst) as Float32Array, pinned);
      // a view into the middle of pinned memory is pinned memory too
      b.native.upload(dst.buffer, pinned.subarray(16, 32), 64, s1);
      b.native.synchronize(s1);
      // from ordinary memory the upload is complete on return, whatever the stream holds
      const pageable = Float32Array.from(values);
      b.native.hold(20_000, s1);
      b.native.upload(dst.buffer, pageable, 0, s1);
      pageable.fill(0);
      b.native.synchronize(s1);
      expectEqual('upload from pageable memory', b.toArray(dst) as Float32Array, values);

      b.native.freeHost(pinned);
      if (host.byteLength !== 0 || pinned.length !== 0) fail(`after freeHost the ArrayBuffer has ${host.byteLength} bytes and its view ${pinned.length} elements: not detached`);
      expectThrows('freeHost twice', () => b.native.freeHost(host), /freeHost: not an ArrayBuffer from allocHost\(\) of this backend, or one already freed/);
      expectThrows('freeHost of ordinary memory', () => b.native.freeHost(new ArrayBuffer(16)), /freeHost: not an ArrayBuffer from allocHost\(\)/);
      expectThrows('freeHost of a number', () => b.native.freeHost(5 as never), /freeHost\(array\): array must be the ArrayBuffer from allocHost\(\) \(or a view of it\), got the number 5/);
      expectThrows('allocHost size', () => b.native.allocHost(-1), /bytes must be an integer >= 0, got -1/);
      expectThrows('waitEvent of an unknown event', () => b.native.waitEvent(12345, s2), /wait_event: unknown event 12345/);
      expectThrows('waitEvent on an unknown stream', () => b.native.waitEvent(e, 999), /unknown stream 999/);
      expectThrows('upload on an unknown stream', () => b.native.upload(dst.buffer, values, 0, 999), /unknown stream 999/);
      b.native.beginCapture(s2);
      try {
        expectThrows('waitEvent on a capturing stream', () => b.native.waitEvent(e, s2), /waitEvent: stream \d+ is capturing a graph/);
        expectThrows('upload on a capturing stream', () => b.native.upload(dst.buffer, values, 0, s2), /upload: stream \d+ is capturing a graph/);
      } finally {
        b.native.freeGraph(b.native.endCapture(s2));
      }
    });
    const m = b.native.memoryInfo();
    if (!(m.total > 0 && m.free > 0 && m.free <= m.total && m.collected >= 0)) fail(`memoryInfo: ${JSON.stringify(m)}`);
    b.native.destroyEvent(e);
    b.native.destroyStream(s1);
    b.native.destroyStream(s2);
    return { detail: `memoryInfo: ${(m.free / 2 ** 30).toFixed(1)} of ${(m.total / 2 ** 30).toFixed(1)} GiB free` };
  },
};

export const MEMORY_CHECKS: KernelCheck[] = [memory, misuse, streamsAndPinned];
