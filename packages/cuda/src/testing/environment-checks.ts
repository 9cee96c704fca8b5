/**
 * The addon in more than one Node environment and under the GC, each case in a child process
 * (child.ts): worker threads load it again into environments of their own, so nothing may be
 * shared between them but the code; two backends of one thread keep their buffers, streams,
 * events and graphs apart; what the GC collects is freed at the next safe point, never in its
 * finalizer. The case functions run from their source text: they use only `native` and `h`.
 */
import { childCheck, type ChildCase } from './child.js';

const environments: ChildCase[] = [
  {
    name: 'two worker threads and the main thread use the addon at once, and a worker started after they exited loads it again',
    async run(native, h) {
      const { Worker } = h.require('node:worker_threads') as typeof import('node:worker_threads');
      // each worker: its own backend, two streams ordered by an event, buffers left to the GC,
      // checked sums. (No captures: on cuda a capture in one thread beside frees in another is a
      // question of the driver's capture rules, not of the addon's per-environment state.)
      const worker = String.raw`
        const { parentPort, workerData } = require('node:worker_threads');
        const native = require(workerData.path).createBackend(workerData.kind, workerData.device);
        const n = 4096;
        const t = (buffer) => ({ buffer, dtype: 'f32', shape: [n] });
        const event = native.createEvent();
        for (let round = 0; round < workerData.rounds; round++) {
          const values = Float32Array.from({ length: n }, (_, i) => i + round * 7 + workerData.id * 1000);
          const a = native.alloc(4 * n), mid = native.alloc(4 * n), out = native.alloc(4 * n);
          const s1 = native.createStream(), s2 = native.createStream();
          native.upload(a, values, 0, s1);
          native.add({ a: t(a), b: t(a), out: t(mid), stream: s1 });
          native.recordEvent(event, s1);
          native.waitEvent(event, s2);
          native.copy({ dst: out, src: mid, stream: s2 });
          native.synchronize(s2);
          const got = new Float32Array(n);
          native.download(out, got);
          for (const i of [0, 1, n - 1]) if (got[i] !== 2 * values[i]) throw new Error('worker ' + workerData.id + ' round ' + round + ': out[' + i + '] = ' + got[i] + ', expected ' + 2 * values[i]);
          native.destroyStream(s1);
          native.destroyStream(s2);
          native.free(a);  // mid and out are left to the GC
        }
        parentPort.postMessage({ id: workerData.id, rounds: workerData.rounds });
      `;
      const start = (id: number) =>
        new Promise<unknown>((resolve, reject) => {
          const w = new Worker(worker, { eval: true, workerData: { path: h.addonPath, kind: h.kind, device: h.device, id, rounds: 40 } });
          let message: unknown;
          w.on('message', (m) => (message = m));
          w.on('error', reject);
          w.on('exit', (code) => (code === 0 && message !== undefined ? resolve(message) : reject(new Error(`worker ${id} exited ${code} without its result`))));
        });
      const mainRounds = async (rounds: number) => {
        const x = h.upload(Float32Array.of(1, 2, 3, 4));
        for (let r = 0; r < rounds; r++) {
          const out = native.alloc(16);
          native.add({ a: h.tensor(x, 'f32', [4]), b: h.tensor(x, 'f32', [4]), out: h.tensor(out, 'f32', [4]) });
          const got = h.download(out);
          h.assert(got[0] === 2 && got[3] === 8, `main thread, round ${r}: ${Array.from(got).join(', ')}`);
          await new Promise((resolve) => setImmediate(resolve)); // the workers run meanwhile
        }
      };
      const results = await Promise.all([start(1), start(2), mainRounds(60)]);
      h.assert(JSON.stringify(results.slice(0, 2)) === JSON.stringify([{ id: 1, rounds: 40 }, { id: 2, rounds: 40 }]), `workers: ${JSON.stringify(results)}`);
      // the first two environments are torn down: the main thread's classes and a new worker's are their own
      await h.collect();
      await mainRounds(5);
      await start(3);
      await mainRounds(5);
    },
  },
  {
    name: 'two backends in one thread do not see each other\'s buffers, streams, events or graphs',
    run(native, h) {
      const other = h.addon.createBackend(h.kind, h.device);
      const ours = native.createStream();
      const theirs = other.createStream();
      h.assert(ours === theirs, `stream ids ${ours} and ${theirs}: each backend numbers its own`);
      native.destroyStream(ours);
      other.synchronize(theirs); // still theirs
      h.expectThrows('our destroyed stream', () => native.synchronize(ours), /^KDTREE_INVALID_ARGUMENT: unknown stream/);
      const e = other.createEvent();
      other.recordEvent(e);
      h.expectThrows('their event', () => native.elapsedMs(e, e), /^KDTREE_INVALID_ARGUMENT: elapsed_ms: unknown event/);
      const buffer = other.alloc(16);
      h.expectThrows('their buffer', () => native.fill(buffer, 0), /^KDTREE_INVALID_ARGUMENT: fill: buffer: buffer belongs to another backend \(\w+ #2\), not this \w+ #1/);
      other.beginCapture(theirs);
      other.fill(buffer, 1, theirs);
      const graph = other.endCapture(theirs);
      h.expectThrows('their graph', () => native.launchGraph(graph), /^KDTREE_INVALID_ARGUMENT: launchGraph: graph belongs to another backend/);
      const host = other.allocHost(64);
      h.expectThrows('their pinned memory', () => native.freeHost(host), /^KDTREE_INVALID_ARGUMENT: freeHost: not an ArrayBuffer from allocHost\(\) of this backend/);
      other.freeHost(host);
      other.launchGraph(graph);
      other.synchronize();
      other.freeGraph(graph);
    },
  },
];

const collection: ChildCase[] = [
  {
    name: 'buffers, graphs and pinned memory the GC collects wait for the next safe point (synchronize, alloc, free), not their finalizers; an explicit free is immediate',
    async run(native, h) {
      const collected = () => native.memoryInfo().collected;
      // what the case holds: an array, so that a bundler cannot drop the stores as dead code
      const held: unknown[] = [];
      h.assert(collected() === 0, `collected ${collected()} at the start`);
      held.push(native.alloc(1 << 20));
      await h.collect();
      h.assert(collected() === 0, 'a buffer still referenced was collected');
      held.length = 0;
      await h.collect();
      h.assert(collected() === 1 << 20, `after the GC: collected ${collected()} bytes, expected ${1 << 20} (freed by its finalizer?)`);
      native.synchronize();
      h.assert(collected() === 0, `synchronize left ${collected()} bytes`);
      // alloc and free are safe points too
      held.push(native.alloc(4096));
      held.length = 0;
      await h.collect();
      h.assert(collected() === 4096, `collected ${collected()}`);
      const kept = native.alloc(16);
      h.assert(collected() === 0, `alloc left ${collected()} bytes`);
      held.push(native.alloc(8192));
      held.length = 0;
      await h.collect();
      native.free(kept);
      h.assert(collected() === 0 && kept.freed, `free left ${collected()} bytes`);
      // a collected graph lets go of the buffers it alone held; they too wait for the safe point
      const stream = native.createStream();
      native.beginCapture(stream);
      native.fill(native.alloc(1 << 16), 3, stream);
      held.push(native.endCapture(stream));
      await h.collect();
      h.assert(collected() === 0, 'a buffer of a live graph was collected');
      held.length = 0;
      await h.collect();
      h.assert(collected() === 1 << 16, `the graph's buffer: collected ${collected()}`);
      native.synchronize();
      h.assert(collected() === 0, `synchronize left ${collected()} bytes of the graph's`);
      // pinned memory
      held.push(native.allocHost(1 << 16));
      held.length = 0;
      await h.collect();
      h.assert(collected() === 1 << 16, `pinned memory: collected ${collected()}`);
      native.synchronize();
      h.assert(collected() === 0, `synchronize left ${collected()} bytes of pinned memory`);
      // an explicit free returns the memory at once (visible on a device, where nothing else allocates)
      if (h.kind === 'cuda') {
        const big = native.alloc(1 << 28);
        native.fill(big, 0);
        native.synchronize();
        const before = native.memoryInfo().free;
        native.free(big);
        const after = native.memoryInfo().free;
        h.assert(after - before >= 1 << 27, `free gave back ${after - before} of ${1 << 28} bytes`);
      }
    },
  },
];

export const ENVIRONMENT_CHECKS = [
  childCheck('environments: the addon in worker threads beside the main thread, and two backends in one thread, keep apart', environments),
  childCheck('GC: what the collector frees waits for a safe point (synchronize, alloc, free); explicit frees are immediate', collection),
];
