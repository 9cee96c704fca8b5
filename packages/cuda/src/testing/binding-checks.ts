/**
 * The binding against hostile JavaScript, each case in a child process (child.ts), since before
 * the binding was hardened most of these killed the process: objects made with `new` from
 * JavaScript, methods and accessors called on a foreign `this`, getters in argument objects that
 * free buffers or make other native calls while the call reads its arguments (during a capture
 * too, then a GC and a launch), options whose toString would run, scalars of the wrong type or
 * range, and unknown or unrecorded streams and events. Every case must throw a KDTREE_ error or
 * compute the right result.
 *
 * The case functions run from their source text: they use only `native` and `h` (ChildHelpers).
 */
import { childCheck, type ChildCase } from './child.js';

const receivers: ChildCase[] = [
  {
    name: 'a backend made with new from JavaScript (directly, by Reflect.construct, as a subclass) throws, on construction or on use',
    run(native, h) {
      const Backend = Object.getPrototypeOf(native).constructor;
      const makers: [string, () => { alloc(n: number): unknown; kind: unknown }][] = [
        ['new', () => new Backend()],
        ['Reflect.construct', () => Reflect.construct(Backend, [])],
        ['a subclass', () => new (class extends Backend {})()],
        ['new with arguments', () => new Backend({}, 'cpu')],
      ];
      for (const [what, make] of makers) {
        let made;
        try {
          made = make();
        } catch (error) {
          h.assert((error as { code?: string }).code === 'KDTREE_INVALID_ARGUMENT', `${what}: threw ${String(error)}`);
          continue;
        }
        h.expectThrows(`${what}: alloc`, () => made.alloc(16), /^KDTREE_INVALID_ARGUMENT: /);
        h.expectThrows(`${what}: kind`, () => made.kind, /^KDTREE_INVALID_ARGUMENT: /);
      }
    },
  },
  {
    name: 'a buffer or graph made with new from JavaScript is refused by every call and its accessors throw',
    run(native, h) {
      const real = native.alloc(16);
      const stream = native.createStream();
      native.beginCapture(stream);
      native.fill(real, 0, stream);
      const graph = native.endCapture(stream);
      for (const [what, model] of [['buffer', real], ['graph', graph]] as const) {
        const Made = Object.getPrototypeOf(model).constructor;
        let fake;
        try {
          fake = new Made();
        } catch (error) {
          h.assert((error as { code?: string }).code === 'KDTREE_INVALID_ARGUMENT', `new ${what}: threw ${String(error)}`);
          continue;
        }
        h.expectThrows(`${what}: add`, () => native.add({ a: h.tensor(fake, 'f32', [4]), b: h.tensor(real, 'f32', [4]), out: h.tensor(real, 'f32', [4]) }), /^KDTREE_INVALID_ARGUMENT: /);
        h.expectThrows(`${what}: free`, () => native.free(fake), /^KDTREE_INVALID_ARGUMENT: /);
        h.expectThrows(`${what}: launchGraph`, () => native.launchGraph(fake), /^KDTREE_INVALID_ARGUMENT: /);
        h.expectThrows(`${what}: freed`, () => fake.freed, /^KDTREE_INVALID_ARGUMENT: /);
      }
      native.freeGraph(graph);
    },
  },
  {
    name: 'every method and accessor of backends, buffers and graphs called on a foreign this throws',
    run(native, h) {
      const other = h.addon.createBackend(h.kind, h.device);
      const buffer = native.alloc(16);
      const stream = native.createStream();
      native.beginCapture(stream);
      native.fill(buffer, 0, stream);
      const graph = native.endCapture(stream);
      const receivers: Record<string, unknown> = { backend: native, buffer, graph, plain: {}, array: [], fn: () => 0, undefined, null: null, number: 5, proxy: new Proxy({}, {}) };
      let calls = 0;
      for (const [cls, self] of [['backend', native], ['buffer', buffer], ['graph', graph]] as const) {
        const proto = Object.getPrototypeOf(self);
        for (const key of Object.getOwnPropertyNames(proto)) {
          if (key === 'constructor') continue;
          const d = Object.getOwnPropertyDescriptor(proto, key)!;
          const fn = d.get ?? d.value;
          if (typeof fn !== 'function') continue;
          for (const [name, receiver] of Object.entries(receivers)) {
            if (receiver !== null && typeof receiver === 'object' && Object.getPrototypeOf(receiver) === proto) continue; // a valid receiver
            calls++;
            h.expectThrows(`${cls}.${key} on ${name}`, () => fn.call(receiver, buffer, 16), /^KDTREE_INVALID_ARGUMENT: .*`this` is not a|^TypeError: Illegal invocation/);
          }
        }
      }
      h.assert(calls > 300, `only ${calls} calls made: the prototypes lost their members`);
      // a valid receiver of the same class still works: another backend's own method on its own buffer
      const theirs = other.alloc(16);
      Object.getPrototypeOf(native).fill.call(other, theirs, 1);
      const back = new Uint8Array(16);
      other.download(theirs, back);
      h.assert(back[15] === 1, 'fill through the prototype');
      native.freeGraph(graph);
    },
  },
];

const getters: ChildCase[] = [
  {
    name: 'a getter freeing a buffer the call already read: that free throws, the call throws, the buffer lives',
    run(native, h) {
      const N = 1 << 20; // large buffers: returned to the system when freed, so a use after free faults
      const a = h.upload(new Float32Array(N).fill(1));
      const b = h.upload(new Float32Array(N).fill(2));
      const out = native.alloc(4 * N);
      const args = {
        a: h.tensor(a, 'f32', [N]),
        b: h.tensor(b, 'f32', [N]),
        out: {
          get buffer() {
            native.free(a);
            return out;
          },
          dtype: 'f32',
          shape: [N],
        },
      };
      h.expectThrows('add', () => native.add(args as never), /^KDTREE_INVALID_ARGUMENT: free: the buffer is in use by a call/);
      h.assert(!a.freed, 'a was freed while the call held it');
      native.add({ a: h.tensor(a, 'f32', [N]), b: h.tensor(b, 'f32', [N]), out: h.tensor(out, 'f32', [N]) });
      const o = h.download(out);
      h.assert(o[0] === 3 && o[N - 1] === 3, `add after: ${o[0]}, ${o[N - 1]}`);
    },
  },
  {
    name: 'a getter freeing a buffer the call already read and ignoring the error: the call runs on live memory',
    run(native, h) {
      const N = 1 << 20;
      const a = h.upload(new Float32Array(N).fill(1));
      const b = h.upload(new Float32Array(N).fill(2));
      const out = native.alloc(4 * N);
      let refused = false;
      native.add({
        a: h.tensor(a, 'f32', [N]),
        b: h.tensor(b, 'f32', [N]),
        out: {
          get buffer() {
            try {
              native.free(a);
            } catch {
              refused = true;
            }
            return out;
          },
          dtype: 'f32',
          shape: [N],
        } as never,
      });
      h.assert(refused && !a.freed, 'the free inside the getter was not refused');
      const o = h.download(out);
      for (const i of [0, 1, N >> 1, N - 1]) h.assert(o[i] === 3, `out[${i}] = ${o[i]}`);
    },
  },
  {
    name: 'copy whose dstOffset getter frees src: the free throws and nothing is copied from freed memory',
    run(native, h) {
      const N = 1 << 22;
      const src = h.upload(new Uint8Array(N).fill(7));
      const dst = native.alloc(N);
      const args = {
        dst,
        src,
        get dstOffset() {
          native.free(src);
          return 0;
        },
      };
      h.expectThrows('copy', () => native.copy(args), /^KDTREE_INVALID_ARGUMENT: free: the buffer is in use by a call/);
      h.assert(!src.freed, 'src was freed while the call held it');
    },
  },
  {
    name: 'kvCommit whose caches[1] getter frees caches[0]: the free throws',
    run(native, h) {
      const S = 1 << 16;
      const c0 = h.upload(new Float32Array(S * 16));
      const c1 = h.upload(new Float32Array(S * 16));
      const caches: unknown[] = [h.tensor(c0, 'f32', [S, 16])];
      Object.defineProperty(caches, 1, {
        enumerable: true,
        get() {
          native.free(c0);
          return h.tensor(c1, 'f32', [S, 16]);
        },
      });
      const path = h.upload(Int32Array.of(0, 2));
      const pathLen = h.upload(Int32Array.of(2));
      h.expectThrows('kvCommit', () => native.kvCommit({ caches: caches as never, path: h.tensor(path, 'i32', [2]), pathLen: h.tensor(pathLen, 'i32', [1]), start: 0 }), /^KDTREE_INVALID_ARGUMENT: free: the buffer is in use by a call/);
      h.assert(!c0.freed, 'caches[0] was freed while the call held it');
    },
  },
  {
    name: 'a getter freeing a buffer the call has not read yet: the call throws "use of a freed buffer"',
    run(native, h) {
      const x = h.upload(new Float32Array(4));
      const out = native.alloc(16);
      const args = {
        get a() {
          native.free(out);
          return h.tensor(x, 'f32', [4]);
        },
        b: h.tensor(x, 'f32', [4]),
        out: h.tensor(out, 'f32', [4]),
      };
      h.expectThrows('add', () => native.add(args), /^KDTREE_INVALID_ARGUMENT: out\.buffer: use of a freed buffer/);
    },
  },
  {
    name: 'during a capture, a getter making other native calls, or one beginning the capture on the call\'s stream: the graph keeps every buffer of the call through a GC and launches right',
    async run(native, h) {
      const N = 1 << 20;
      const side = native.alloc(64);
      const getters: [string, (stream: number) => void][] = [
        // the capture is open; the getter calls ops of its own on stream 0
        [
          'other native calls',
          () => {
            native.fill(side, 0);
            native.add({ a: h.tensor(side, 'f32', [16]), b: h.tensor(side, 'f32', [16]), out: h.tensor(side, 'f32', [16]) });
          },
        ],
        // the capture begins while the call reads its arguments, after a and b were read
        ['beginCapture', (stream) => native.beginCapture(stream)],
      ];
      for (const [what, sideEffect] of getters) {
        const stream = native.createStream();
        const out = native.alloc(4 * N);
        if (what !== 'beginCapture') native.beginCapture(stream);
        native.add({
          a: h.tensor(h.upload(new Float32Array(N).fill(1)), 'f32', [N]),
          b: h.tensor(h.upload(new Float32Array(N).fill(2)), 'f32', [N]),
          out: {
            get buffer() {
              sideEffect(stream);
              return out;
            },
            dtype: 'f32',
            shape: [N],
          } as never,
          stream,
        });
        const graph = native.endCapture(stream);
        h.assert(graph.calls === 1, `${what}: graph.calls = ${graph.calls}`);
        await h.collect(); // a and b are referenced by the graph alone
        native.fill(out, 0);
        native.launchGraph(graph, stream);
        native.synchronize(stream);
        const o = h.download(out);
        for (const i of [0, 12345, N - 1]) h.assert(o[i] === 3, `${what}: out[${i}] = ${o[i]} after the launch`);
        native.freeGraph(graph);
      }
    },
  },
  {
    name: 'a getter destroying the call\'s stream: the call throws "unknown stream"',
    run(native, h) {
      const x = h.upload(new Float32Array(4));
      const stream = native.createStream();
      const args = {
        a: h.tensor(x, 'f32', [4]),
        b: h.tensor(x, 'f32', [4]),
        get out() {
          native.destroyStream(stream);
          return h.tensor(x, 'f32', [4]);
        },
        stream,
      };
      h.expectThrows('add', () => native.add(args), /^KDTREE_INVALID_ARGUMENT: unknown stream/);
    },
  },
  {
    name: 'string options (mode, epilogue) must be strings: an object\'s toString never runs',
    run(native, h) {
      const x = h.upload(new Float32Array(128));
      const qw = h.upload(new Int32Array(256));
      const sc = h.upload(new Uint16Array(64));
      const y = native.alloc(64);
      let ran = false;
      const sneaky = {
        toString() {
          ran = true;
          native.free(x);
          return 'none';
        },
      };
      const gemm = (epilogue: unknown) => native.w4a16Gemm({ x: h.tensor(x, 'f32', [1, 128]), qw: h.tensor(qw, 'i32', [1, 1, 256]), sc: h.tensor(sc, 'bf16', [1, 1, 64]), y: h.tensor(y, 'f32', [1, 16]), group: 32, epilogue: epilogue as never });
      gemm('none');
      h.expectThrows('epilogue object', () => gemm(sneaky), /^KDTREE_INVALID_ARGUMENT: w4a16_gemm: epilogue must be 'none' or 'siluMul', got an object/);
      h.expectThrows('epilogue number', () => gemm(1), /epilogue must be 'none' or 'siluMul', got the number 1/);
      h.assert(!ran && !x.freed, 'toString ran');
    },
  },
];

const offsets: ChildCase[] = [
  {
    name: 'a tensor that does not start at a multiple of its element size is rejected, whichever op',
    run(native, h) {
      const buffer = native.alloc(4096);
      const at = (dtype: 'f32' | 'bf16' | 'i32', shape: number[], offset: number) => h.tensor(buffer, dtype, shape, offset);
      const calls: [string, number, () => void][] = [
        ['add a (f32)', 4, () => native.add({ a: at('f32', [4], 2), b: at('f32', [4], 64), out: at('f32', [4], 128) })],
        ['add out (f32)', 4, () => native.add({ a: at('f32', [4], 0), b: at('f32', [4], 64), out: at('f32', [4], 129) })],
        ['rmsNorm weight (bf16)', 2, () => native.rmsNorm({ x: at('f32', [1, 8], 0), weight: at('bf16', [8], 257), out: at('bf16', [1, 8], 512), eps: 1e-6 })],
        ['argmax out (i32)', 4, () => native.argmax({ x: at('f32', [1, 8], 0), out: at('i32', [1], 1026) })],
      ];
      for (const [what, size, call] of calls) h.expectThrows(what, call, new RegExp(`^KDTREE_INVALID_ARGUMENT: .*must start at a multiple of its ${size}-byte elements \\(its offset into the buffer\\)`));
      // aligned, the same calls run
      native.add({ a: at('f32', [4], 0), b: at('f32', [4], 64), out: at('f32', [4], 128) });
      native.free(buffer);
    },
  },
];

const hostCopies: ChildCase[] = [
  {
    name: 'upload and download take a view of a SharedArrayBuffer at its byte offset; a non-view is named',
    run(native, h) {
      const buffer = native.alloc(64);
      const shared = new Float32Array(new SharedArrayBuffer(80), 16, 16);
      shared.forEach((_, i) => (shared[i] = i + 0.5));
      native.upload(buffer, shared);
      const back = new Float32Array(new SharedArrayBuffer(72), 8, 16);
      native.download(buffer, back);
      h.assert(back.every((v, i) => v === i + 0.5), `round trip through shared memory: ${Array.from(back.slice(0, 4))}`);
      h.expectThrows('upload of a SharedArrayBuffer itself', () => native.upload(buffer, new SharedArrayBuffer(64) as never), /^KDTREE_INVALID_ARGUMENT: upload\(buffer, typedArray, offset\?, stream\?\): the second argument must be a TypedArray or Buffer/);
      native.free(buffer);
    },
  },
];

const scalars: ChildCase[] = [
  {
    name: 'flags must be booleans: w4a16Pack interleaveGateUp, rope interleave, router normTopkProb',
    run(native, h) {
      const wrong = [1, 0, 'true', '', null, {}, [], Number.NaN];
      const i32 = (n: number) => native.alloc(4 * n);
      const f32 = (values: number[]) => h.upload(Float32Array.from(values));
      const calls: [string, (flag: unknown) => void][] = [
        ['interleaveGateUp', (flag) => native.w4a16Pack({ qw: h.tensor(i32(256), 'i32', [16, 16]), sc: h.tensor(native.alloc(128), 'bf16', [16, 4]), qwPacked: h.tensor(i32(256), 'i32', [1, 1, 256]), scPacked: h.tensor(native.alloc(128), 'bf16', [1, 1, 64]), group: 32, interleaveGateUp: flag as never })],
        ['interleave', (flag) => native.rope({ x: h.tensor(f32([1, 2, 3, 4, 5, 6, 7, 8]), 'f32', [1, 1, 8]), positions: h.tensor(i32(1), 'i32', [1]), invFreq: h.tensor(h.upload(Float64Array.of(1, 0.5)), 'f64', [2]), interleave: flag as never })],
        ['normTopkProb', (flag) => native.router({ logits: h.tensor(f32([1, 2, 3, 4]), 'f32', [1, 4]), bias: h.tensor(f32([0, 0, 0, 0]), 'f32', [4]), ids: h.tensor(i32(2), 'i32', [1, 2]), weights: h.tensor(native.alloc(8), 'f32', [1, 2]), topk: 2, normTopkProb: flag as never })],
      ];
      for (const [key, call] of calls) {
        call(true);
        call(false);
        call(undefined);
        for (const v of wrong) h.expectThrows(`${key}: ${String(v)}`, () => call(v), new RegExp(`^KDTREE_INVALID_ARGUMENT: ${key} must be a boolean \\(true or false\\), got `));
      }
    },
  },
  {
    name: 'float scalars must be finite: rmsNorm eps, mlaAttention scale, rope attentionFactor, router scaling',
    run(native, h) {
      const f32 = (n: number, v = 1) => h.upload(new Float32Array(n).fill(v));
      const i32 = (n: number) => native.alloc(4 * n);
      const calls: [string, (v: number) => void][] = [
        ['eps', (eps) => native.rmsNorm({ x: h.tensor(f32(4), 'f32', [1, 4]), weight: h.tensor(f32(4), 'f32', [4]), out: h.tensor(f32(4), 'f32', [1, 4]), eps })],
        ['scale', (scale) => native.mlaAttention({ qNope: h.tensor(f32(8), 'f32', [1, 1, 8]), qPe: h.tensor(f32(8), 'f32', [1, 1, 8]), kvB: h.tensor(f32(256, 0.1), 'f32', [16, 16]), cacheC: h.tensor(f32(64), 'f32', [4, 16]), cacheKpe: h.tensor(f32(32), 'f32', [4, 8]), out: h.tensor(f32(8), 'f32', [1, 1, 8]), base: 0, scale })],
        ['attentionFactor', (attentionFactor) => native.rope({ x: h.tensor(f32(8), 'f32', [1, 1, 8]), positions: h.tensor(i32(1), 'i32', [1]), invFreq: h.tensor(h.upload(Float64Array.of(1, 0.5)), 'f64', [2]), attentionFactor })],
        ['scaling', (scaling) => native.router({ logits: h.tensor(h.upload(Float32Array.of(1, 2, 3, 4)), 'f32', [1, 4]), bias: h.tensor(f32(4, 0), 'f32', [4]), ids: h.tensor(i32(2), 'i32', [1, 2]), weights: h.tensor(f32(2), 'f32', [1, 2]), topk: 2, scaling })],
      ];
      for (const [key, call] of calls) {
        call(0.5);
        for (const v of [Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, Number.NaN]) h.expectThrows(`${key}: ${v}`, () => call(v), new RegExp(`^KDTREE_INVALID_ARGUMENT: ${key} must be a finite number, got the number -?(Infinity|NaN)`));
      }
    },
  },
  {
    name: 'ddtreeBuild start keeps the i32 positions: 2^31 and start + depth past 2^31 - 1 throw; the largest start that fits writes its positions',
    run(native, h) {
      const L = 2;
      const logits = h.upload(Float32Array.of(4, 3, 2, 1, 1, 2, 3, 4));
      const nodes = 3;
      const out = { tokens: native.alloc(4 * nodes), parents: native.alloc(4 * nodes), depths: native.alloc(4 * nodes), positions: native.alloc(4 * nodes), mask: native.alloc(nodes * nodes), size: native.alloc(4) };
      const build = (start: number) =>
        native.ddtreeBuild({
          draftLogits: h.tensor(logits, 'f32', [L, 4]),
          root: 1,
          budget: nodes - 1,
          start,
          tokens: h.tensor(out.tokens, 'i32', [nodes]),
          parents: h.tensor(out.parents, 'i32', [nodes]),
          depths: h.tensor(out.depths, 'i32', [nodes]),
          positions: h.tensor(out.positions, 'i32', [nodes]),
          mask: h.tensor(out.mask, 'u8', [nodes, nodes]),
          size: h.tensor(out.size, 'i32', [1]),
        });
      h.expectThrows('start 2^31', () => build(2 ** 31), /^KDTREE_INVALID_ARGUMENT: start must be an integer in \[0, 2147483647\], got 2147483648/);
      h.expectThrows('start 2^32 + 5', () => build(2 ** 32 + 5), /start must be an integer in \[0, 2147483647\]/);
      h.expectThrows('start 2^31 - 2 with 2 depths', () => build(2 ** 31 - 2), /ddtree_build\(.*\): start 2147483646 \+ 2 draft depths leave the i32 positions/);
      const start = 2 ** 31 - 1 - L;
      build(start);
      const size = h.download(out.size, new Int32Array(1))[0];
      const positions = h.download(out.positions, new Int32Array(nodes));
      const depths = h.download(out.depths, new Int32Array(nodes));
      h.assert(size >= 1, `size ${size}`);
      for (let i = 0; i < size; i++) h.assert(positions[i] === start + depths[i], `positions[${i}] = ${positions[i]}, expected ${start} + ${depths[i]}`);
    },
  },
  {
    name: 'events and streams: unknown ones are rejected by recordEvent, destroyEvent and elapsedMs, and events never recorded cannot be timed',
    run(native, h) {
      const a = native.createEvent();
      const b = native.createEvent();
      h.expectThrows('elapsedMs of events never recorded', () => native.elapsedMs(a, b), /^KDTREE_INVALID_ARGUMENT: elapsed_ms: event \d+ was never recorded/);
      h.expectThrows('recordEvent on an unknown stream', () => native.recordEvent(a, 999), /^KDTREE_INVALID_ARGUMENT: unknown stream 999/);
      h.expectThrows('recordEvent of an unknown event', () => native.recordEvent(123456), /^KDTREE_INVALID_ARGUMENT: record_event: unknown event 123456/);
      h.expectThrows('destroyEvent of an unknown event', () => native.destroyEvent(123456), /^KDTREE_INVALID_ARGUMENT: destroy_event: unknown event 123456/);
      native.recordEvent(a);
      h.expectThrows('elapsedMs with one event never recorded', () => native.elapsedMs(a, b), new RegExp(`elapsed_ms: event ${b} was never recorded`));
      const stream = native.createStream();
      native.recordEvent(b, stream);
      native.synchronize(stream);
      const ms = native.elapsedMs(a, b);
      h.assert(Number.isFinite(ms), `elapsed ${ms}`);
      native.destroyEvent(a);
      h.expectThrows('destroyEvent twice', () => native.destroyEvent(a), /destroy_event: unknown event/);
      h.expectThrows('elapsedMs of a destroyed event', () => native.elapsedMs(a, b), /elapsed_ms: unknown event/);
      native.destroyStream(stream);
      h.expectThrows('recordEvent on a destroyed stream', () => native.recordEvent(b, stream), /unknown stream/);
      native.destroyEvent(b);
    },
  },
];

export const BINDING_CHECKS = [
  childCheck('binding: objects made with new from JavaScript and foreign receivers throw, never crash', receivers),
  childCheck('binding: getters that free buffers or make native calls while a call reads its arguments (captures and GC included) cannot make it use freed memory', getters),
  childCheck('binding: flags must be booleans, float scalars finite, positions within i32; unknown streams and events and unrecorded events are rejected', scalars),
  childCheck('binding: tensors must start at a multiple of their element size', offsets),
  childCheck('binding: upload and download copy through any TypedArray view, a SharedArrayBuffer\'s included', hostCopies),
];
