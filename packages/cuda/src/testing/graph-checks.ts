/**
 * Graphs: a captured sequence of ops replays to the bits of the same ops called directly, reads its
 * buffers' contents at each launch, keeps its own work space, and misuse throws.
 */
import { f32ArrayToBf16 } from '@kdtree/format';
import type { DeviceTensor, Graph, KdtreeBackend } from '../backend.js';
import { KdtreeBackend as Backend } from '../backend.js';
import { packGateUp, type Track } from './epilogue-checks.js';
import { int4, trackedInt4 } from './gemm-checks.js';
import { expectEqual, expectThrows, fail, randomF32, rng, sameBits, withTensors, type KernelCheck } from './harness.js';

// One MoE layer's tail at decode and small-verify sizes: hidden H, E experts of I, top-2.
const H = 256;
const E = 8;
const I = 64;
const TOPK = 2;

interface LayerBuffers {
  x: DeviceTensor; // f32 [T, H], the residual stream
  logits: DeviceTensor; // f32 [T, E], the router's input
  outputs: Record<'ids' | 'weights' | 'act' | 'moe' | 'out' | 'copied', DeviceTensor>;
}

/** rms_norm -> router -> gate_up GEMM with SiLU -> down GEMM summed over the experts -> residual add -> copy. */
function queueLayer(b: KdtreeBackend, w: LayerWeights, l: LayerBuffers, T: number, stream: number): void {
  const { ids, weights, act, moe, out, copied } = l.outputs;
  const h = w.scratch(T);
  b.native.rmsNorm({ x: l.x, weight: w.norm, out: h, eps: 1e-6, stream });
  b.native.router({ logits: l.logits, bias: w.bias, ids, weights, topk: TOPK, stream });
  b.native.moeGemm({ x: h, qw: w.gateUp.qw, sc: w.gateUp.sc, ids, y: act, mode: 'gather', epilogue: 'siluMul', stream });
  b.native.moeGemm({ x: act, qw: w.down.qw, sc: w.down.sc, ids, weights, y: moe, mode: 'sum', stream });
  b.native.add({ a: l.x, b: moe, out, stream });
  b.native.copy({ dst: copied.buffer, src: out.buffer, stream });
}

interface LayerWeights {
  norm: DeviceTensor;
  bias: DeviceTensor;
  gateUp: { qw: DeviceTensor; sc: DeviceTensor };
  down: { qw: DeviceTensor; sc: DeviceTensor };
  scratch(T: number): DeviceTensor;
}

function layerWeights(b: KdtreeBackend, track: Track): LayerWeights {
  const hs = new Map<number, DeviceTensor>();
  return {
    norm: track(b.fromArray('f32', [H], randomF32(H, 70, 0.5).map((v) => 1 + v))),
    bias: track(b.fromArray('f32', [E], randomF32(E, 72, 0.1))),
    gateUp: packGateUp(b, track, int4(E * 2 * I, H, 32, 'BF16', 73), E),
    down: trackedInt4(b, track, int4(E * H, I, 32, 'BF16', 71), E),
    scratch(T) {
      if (!hs.has(T)) hs.set(T, track(b.empty('f32', [T, H])));
      return hs.get(T)!;
    },
  };
}

function layerBuffers(b: KdtreeBackend, track: Track, T: number): LayerBuffers {
  return {
    x: track(b.empty('f32', [T, H])),
    logits: track(b.empty('f32', [T, E])),
    outputs: {
      ids: track(b.empty('i32', [T, TOPK])),
      weights: track(b.empty('f32', [T, TOPK])),
      act: track(b.empty('bf16', [T * TOPK, I])),
      moe: track(b.empty('f32', [T, H])),
      out: track(b.empty('f32', [T, H])),
      copied: track(b.empty('f32', [T, H])),
    },
  };
}

function uploadInputs(b: KdtreeBackend, l: LayerBuffers, T: number, seed: number): void {
  b.native.upload(l.x.buffer, randomF32(T * H, seed));
  b.native.upload(l.logits.buffer, randomF32(T * E, seed + 1));
}

/** Every tensor of `outs` (graph side) has the bits of its twin in `direct`. */
function expectSameTensors(b: KdtreeBackend, what: string, outs: Record<string, DeviceTensor>, direct: Record<string, DeviceTensor>): void {
  for (const name of Object.keys(outs)) {
    if (!sameBits(b.toArray(outs[name]), b.toArray(direct[name]))) fail(`${what}: ${name} of the graph differs from the direct calls`);
  }
}

const replay: KernelCheck = {
  name: 'graphs: a captured MoE layer tail (rms_norm, router, gate_up GEMM with SiLU, down GEMM summed, add, copy) at T 1 and 5 replays to the bits of direct calls, with new inputs at each launch and the stream\'s own work space outgrown between launches (and another stream\'s during the capture); replays run in order',
  run(b) {
    return withTensors(b, (track) => {
      const w = layerWeights(b, track);
      const s = b.native.createStream();
      const other = b.native.createStream();
      const graphs: Graph[] = [];
      // GEMMs of 17 and 118 tokens (staged x) on another stream: the second outgrows that stream's
      // work space while `s` captures, which must neither wait for nor free anything then
      const big = trackedInt4(b, track, int4(512, 1024, 32, 'BF16', 74));
      const xBig = track(b.fromArray('bf16', [118, 1024], new Uint16Array(118 * 1024).fill(0x3f80)));
      const gemmOn = (stream: number, rows: number, y: DeviceTensor) => b.native.w4a16Gemm({ x: { ...xBig, shape: [rows, 1024] }, qw: big.qw, sc: big.sc, y, stream });
      gemmOn(other, 17, track(b.empty('f32', [17, 512])));
      try {
        for (const T of [1, 5]) {
          const g = layerBuffers(b, track, T);
          const d = layerBuffers(b, track, T);
          const yOther = track(b.empty('f32', [118, 512]));
          const graph = b.capture(s, () => {
            queueLayer(b, w, g, T, s);
            gemmOn(other, 118, yOther); // not captured: another stream
          });
          b.synchronize(other);
          const yDirect = track(b.empty('f32', [118, 512]));
          gemmOn(0, 118, yDirect);
          if (!sameBits(b.toArray(yOther), b.toArray(yDirect))) fail(`T=${T}: the GEMM on another stream during the capture differs from the same GEMM after it`);
          graphs.push(graph);
          if (graph.calls !== 6) fail(`T=${T}: the graph holds ${graph.calls} calls, expected 6`);
          for (let round = 0; round < 3; round++) {
            const seed = 1000 * T + 10 * round;
            uploadInputs(b, g, T, seed);
            uploadInputs(b, d, T, seed);
            b.native.launchGraph(graph, s);
            queueLayer(b, w, d, T, 0);
            b.synchronize();
            expectSameTensors(b, `T=${T}, launch ${round + 1}`, g.outputs, d.outputs);
            // a direct GEMM of 118 tokens on the graph's stream: its staged x outgrows the stream's work space
            if (round === 1) gemmOn(s, 118, track(b.empty('f32', [118, 512])));
          }
        }
        // replays queue in order behind each other: acc += 1 three times
        const acc = track(b.zeros('f32', [64]));
        const one = track(b.fromArray('f32', [64], new Float32Array(64).fill(1)));
        const inc = b.capture(s, () => b.native.add({ a: acc, b: one, out: acc, stream: s }));
        graphs.push(inc);
        for (let i = 0; i < 3; i++) b.native.launchGraph(inc, s);
        b.synchronize(s);
        expectEqual('acc after 3 launches', b.toArray(acc) as Float32Array, new Float32Array(64).fill(3));
        return { detail: 'T 1, 5: 3 launches each equal to direct calls; 3 ordered replays' };
      } finally {
        for (const graph of graphs) if (!graph.freed) b.native.freeGraph(graph);
        b.native.destroyStream(s);
        b.native.destroyStream(other);
      }
    });
  },
};

/** A created stream and the graphs made on it (push them to `graphs`): freed and destroyed after `fn`, whatever happens. */
function onStream<T>(b: KdtreeBackend, fn: (stream: number, graphs: Graph[]) => T): T {
  const stream = b.native.createStream();
  const graphs: Graph[] = [];
  try {
    return fn(stream, graphs);
  } finally {
    for (const graph of graphs) if (!graph.freed) b.native.freeGraph(graph);
    b.native.destroyStream(stream);
  }
}

/** A DDTree step's trees and accepted path for n nodes, zeroed: the ops write a prefix of some. */
function treeStepBuffers(b: KdtreeBackend, track: Track, n: number): Record<'tokens' | 'parents' | 'depths' | 'positions' | 'mask' | 'size' | 'path' | 'pathLen', DeviceTensor> {
  return {
    tokens: track(b.zeros('i32', [n])),
    parents: track(b.zeros('i32', [n])),
    depths: track(b.zeros('i32', [n])),
    positions: track(b.zeros('i32', [n])),
    mask: track(b.zeros('u8', [n, n])),
    size: track(b.zeros('i32', [1])),
    path: track(b.zeros('i32', [n])),
    pathLen: track(b.zeros('i32', [1])),
  };
}

const attentionAndTree: KernelCheck = {
  name: "graphs: an attention step at Kimi K2's per-rank dims (kv_write into a bf16 cache, mla_attention decode at a fixed base with a bf16 kv_b) and a DDTree step (build at B 16, accept, kv_commit) replay to the bits of direct calls, with new inputs at each launch",
  run(b) {
    return withTensors(b, (track) => {
      const [h, nope, rope, v, rank, slots, base] = [8, 128, 64, 128, 512, 320, 200];
      const [depth, vocab, budget, start] = [4, 3000, 16, 250];
      const n = budget + 1;
      const kvB = track(b.fromArray('bf16', [h * (nope + v), rank], f32ArrayToBf16(randomF32(h * (nope + v) * rank, 80, 0.05))));
      const cacheC0 = f32ArrayToBf16(randomF32(slots * rank, 81));
      const cacheKpe0 = f32ArrayToBf16(randomF32(slots * rope, 82));
      const commit0 = randomF32(slots * 6, 83);
      // one set of buffers per side: the graph's and the direct calls'
      const side = () => ({
        inputs: {
          qNope: track(b.empty('f32', [1, h, nope])),
          qPe: track(b.empty('f32', [1, h, rope])),
          c: track(b.empty('f32', [1, rank])),
          kpe: track(b.empty('f32', [1, rope])),
          draft: track(b.empty('f32', [depth, vocab])),
          targetArgmax: track(b.empty('i32', [n])),
        },
        // zeroed: the ops write a prefix of some (a path of pathLen nodes)
        outs: {
          cacheC: track(b.fromArray('bf16', [slots, rank], cacheC0)),
          cacheKpe: track(b.fromArray('bf16', [slots, rope], cacheKpe0)),
          out: track(b.zeros('f32', [1, h, v])),
          ...treeStepBuffers(b, track, n),
          bonus: track(b.zeros('i32', [1])),
          committed: track(b.fromArray('f32', [slots, 6], commit0)),
        },
      });
      const slot = track(b.fromArray('i32', [1], Int32Array.of(base)));
      const queue = (x: ReturnType<typeof side>, stream: number) => {
        const { inputs: i, outs: o } = x;
        b.native.kvWrite({ c: i.c, kpe: i.kpe, cacheC: o.cacheC, cacheKpe: o.cacheKpe, slots: slot, stream });
        b.native.mlaAttention({ qNope: i.qNope, qPe: i.qPe, kvB, cacheC: o.cacheC, cacheKpe: o.cacheKpe, out: o.out, base, scale: 1 / Math.sqrt(192), stream });
        b.native.ddtreeBuild({ draftLogits: i.draft, root: 7, budget, start, tokens: o.tokens, parents: o.parents, depths: o.depths, positions: o.positions, mask: o.mask, size: o.size, stream });
        b.native.ddtreeAccept({ tokens: o.tokens, parents: o.parents, size: o.size, targetArgmax: i.targetArgmax, path: o.path, pathLen: o.pathLen, bonus: o.bonus, stream });
        b.native.kvCommit({ caches: [o.committed], path: o.path, pathLen: o.pathLen, start, stream });
      };
      const g = side();
      const d = side();
      return onStream(b, (s, graphs) => {
        const graph = b.capture(s, () => queue(g, s));
        graphs.push(graph);
        if (graph.calls !== 5) fail(`the graph holds ${graph.calls} calls, expected 5`);
        for (let round = 0; round < 3; round++) {
          const seed = 900 + 10 * round;
          // token `round` leads every depth of the draft and the target agrees: the accepted path is
          // the whole chain of it (depth + 1 nodes to commit)
          const draft = randomF32(depth * vocab, seed + 4, 3);
          for (let dd = 0; dd < depth; dd++) draft[dd * vocab + round] = 20;
          const argmax = new Int32Array(n).fill(round);
          for (const x of [g, d]) {
            const i = x.inputs;
            b.native.upload(i.qNope.buffer, randomF32(h * nope, seed));
            b.native.upload(i.qPe.buffer, randomF32(h * rope, seed + 1));
            b.native.upload(i.c.buffer, randomF32(rank, seed + 2));
            b.native.upload(i.kpe.buffer, randomF32(rope, seed + 3));
            b.native.upload(i.draft.buffer, draft);
            b.native.upload(i.targetArgmax.buffer, argmax);
          }
          b.native.launchGraph(graph, s);
          queue(d, 0);
          b.synchronize();
          expectSameTensors(b, `launch ${round + 1}`, g.outs, d.outs);
          const pathLen = (b.toArray(g.outs.pathLen) as Int32Array)[0];
          if (pathLen !== depth + 1) fail(`launch ${round + 1}: accepted ${pathLen} nodes, expected the draft's whole chain of ${depth + 1}`);
        }
        return { detail: `3 launches equal to direct calls, each committing a path of ${depth + 1} nodes` };
      });
    });
  },
};

/**
 * A speculative step that never returns to the host: the committed length L and the root token live
 * on the device, so one graph, captured once, serves every step. Build (root = the last bonus, start
 * = L), the tree's cache slots (arange from L), kv_write, the tree verify's attention over the
 * first L slots (read on the device, bounded by the cache), accept, and kv_commit from L, which also
 * moves L past the accepted path. The direct calls take L and the root from the host, read back
 * after each step as an engine without device scalars would.
 */
const deviceLoop: KernelCheck = {
  name: "graphs: a DDTree step with the committed length and the root on the device (build, arange slots, kv_write, tree-verify mla_attention at Kimi K2's per-rank dims with a bf16 cache, accept, kv_commit moving the length on) captured once replays 4 steps to the bits of direct calls given the length by the host",
  run(b) {
    return withTensors(b, (track) => {
      const [h, nope, rope, v, rank, slots] = [8, 128, 64, 128, 512, 320];
      const [depth, vocab, budget, L0, root0] = [4, 3000, 16, 130, 7];
      const n = budget + 1;
      const bound = slots - n; // the most committed slots a verify of n nodes may see
      const kvB = track(b.fromArray('bf16', [h * (nope + v), rank], f32ArrayToBf16(randomF32(h * (nope + v) * rank, 140, 0.05))));
      const cacheC0 = f32ArrayToBf16(randomF32(slots * rank, 141));
      const cacheKpe0 = f32ArrayToBf16(randomF32(slots * rope, 142));
      const side = () => ({
        inputs: {
          qNope: track(b.empty('f32', [n, h, nope])),
          qPe: track(b.empty('f32', [n, h, rope])),
          c: track(b.empty('f32', [n, rank])),
          kpe: track(b.empty('f32', [n, rope])),
          draft: track(b.empty('f32', [depth, vocab])),
          targetArgmax: track(b.empty('i32', [n])),
        },
        outs: {
          cacheC: track(b.fromArray('bf16', [slots, rank], cacheC0)),
          cacheKpe: track(b.fromArray('bf16', [slots, rope], cacheKpe0)),
          out: track(b.zeros('f32', [n, h, v])),
          ...treeStepBuffers(b, track, n),
          slots: track(b.zeros('i32', [n])),
          bonus: track(b.fromArray('i32', [1], Int32Array.of(root0))),
        },
      });
      const scale = 1 / Math.sqrt(nope + rope);
      const g = side();
      const d = side();
      const L = track(b.fromArray('i32', [1], Int32Array.of(L0)));
      const queueOnDevice = (stream: number) => {
        const { inputs: i, outs: o } = g;
        b.native.ddtreeBuild({ draftLogits: i.draft, rootOnDevice: o.bonus, budget, startOnDevice: L, tokens: o.tokens, parents: o.parents, depths: o.depths, positions: o.positions, mask: o.mask, size: o.size, stream });
        b.native.arange({ startOnDevice: L, out: o.slots, stream });
        b.native.kvWrite({ c: i.c, kpe: i.kpe, cacheC: o.cacheC, cacheKpe: o.cacheKpe, slots: o.slots, stream });
        b.native.mlaAttention({ qNope: i.qNope, qPe: i.qPe, kvB, cacheC: o.cacheC, cacheKpe: o.cacheKpe, mask: o.mask, out: o.out, base: bound, baseOnDevice: L, scale, stream });
        b.native.ddtreeAccept({ tokens: o.tokens, parents: o.parents, size: o.size, targetArgmax: i.targetArgmax, path: o.path, pathLen: o.pathLen, bonus: o.bonus, stream });
        b.native.kvCommit({ caches: [o.cacheC, o.cacheKpe], path: o.path, pathLen: o.pathLen, startOnDevice: L, nextStart: L, stream });
      };
      let committed = L0;
      let root = root0;
      const stepFromHost = () => {
        const { inputs: i, outs: o } = d;
        b.native.ddtreeBuild({ draftLogits: i.draft, root, budget, start: committed, tokens: o.tokens, parents: o.parents, depths: o.depths, positions: o.positions, mask: o.mask, size: o.size });
        b.native.upload(o.slots.buffer, Int32Array.from({ length: n }, (_, k) => committed + k));
        b.native.kvWrite({ c: i.c, kpe: i.kpe, cacheC: o.cacheC, cacheKpe: o.cacheKpe, slots: o.slots });
        b.native.mlaAttention({ qNope: i.qNope, qPe: i.qPe, kvB, cacheC: o.cacheC, cacheKpe: o.cacheKpe, mask: o.mask, out: o.out, base: committed, scale });
        b.native.ddtreeAccept({ tokens: o.tokens, parents: o.parents, size: o.size, targetArgmax: i.targetArgmax, path: o.path, pathLen: o.pathLen, bonus: o.bonus });
        b.native.kvCommit({ caches: [o.cacheC, o.cacheKpe], path: o.path, pathLen: o.pathLen, start: committed });
        committed += (b.toArray(o.pathLen) as Int32Array)[0];
        root = (b.toArray(o.bonus) as Int32Array)[0];
      };
      return onStream(b, (s, graphs) => {
        const graph = b.capture(s, () => queueOnDevice(s));
        graphs.push(graph);
        if (graph.calls !== 6) fail(`the graph holds ${graph.calls} calls, expected 6`);
        const lengths: number[] = [];
        for (let step = 0; step < 4; step++) {
          const seed = 1500 + 10 * step;
          // even steps: the target agrees with the draft's leading token all the way (a path of depth + 1);
          // odd steps: random targets (most often the root alone)
          const lead = 100 + step;
          const draft = randomF32(depth * vocab, seed + 4, 3);
          for (let dd = 0; dd < depth; dd++) draft[dd * vocab + lead] = 20;
          const r = rng(seed + 5);
          const argmax = step % 2 === 0 ? new Int32Array(n).fill(lead) : Int32Array.from({ length: n }, () => Math.floor(r.uniform() * vocab));
          for (const x of [g, d]) {
            const i = x.inputs;
            b.native.upload(i.qNope.buffer, randomF32(n * h * nope, seed));
            b.native.upload(i.qPe.buffer, randomF32(n * h * rope, seed + 1));
            b.native.upload(i.c.buffer, randomF32(n * rank, seed + 2));
            b.native.upload(i.kpe.buffer, randomF32(n * rope, seed + 3));
            b.native.upload(i.draft.buffer, draft);
            b.native.upload(i.targetArgmax.buffer, argmax);
          }
          b.native.launchGraph(graph, s);
          b.synchronize(s);
          stepFromHost();
          expectSameTensors(b, `step ${step + 1}`, g.outs, d.outs);
          const onDevice = (b.toArray(L) as Int32Array)[0];
          if (onDevice !== committed) fail(`step ${step + 1}: the device's committed length is ${onDevice}, the host's ${committed}`);
          lengths.push(committed);
        }
        if (lengths[0] !== L0 + depth + 1) fail(`step 1 committed ${lengths[0] - L0} slots, expected the draft's whole chain of ${depth + 1}`);
        return { detail: `committed length ${L0} -> ${lengths.join(' -> ')}, every step equal to direct calls` };
      });
    });
  },
};

/**
 * Plain greedy decoding that never returns to the host: a toy one-layer model whose next token is
 * the argmax of its logits, with the token, the committed length L and the positions on the
 * device. embedding (x, q, and the new key's c and kpe, all by the current token) -> positions
 * and slot from L (arange) -> RoPE -> kv_write -> mla_attention over the first L slots read on
 * the device -> residual add -> rms_norm -> lm_head (W4A16 GEMM) -> argmax into the token buffer
 * -> L += 1 in place (arange). Captured once, replayed step after step, it must produce the
 * tokens, caches and logits of the same ops given L by the host; its steps cross a chunk edge.
 */
const decodeLoop: KernelCheck = {
  name: 'graphs: greedy decoding with the token, the committed length and the positions on the device (embedding, arange, rope, kv_write, mla_attention, add, rms_norm, W4A16 lm_head, argmax, L += 1) captured once replays 8 steps to the tokens and bits of direct calls given the length by the host, across a 64-key chunk edge',
  run(b) {
    return withTensors(b, (track) => {
      const [vocab, h, nope, rope, v, rank, slots, L0, steps] = [384, 2, 16, 8, 64, 32, 128, 58, 8];
      const hidden = h * v; // 128: the lm_head's K
      const bound = slots - 1;
      const table = (width: number, seed: number) => track(b.fromArray('f32', [vocab, width], randomF32(vocab * width, seed)));
      const w = {
        x: table(hidden, 160),
        qNope: table(h * nope, 161),
        qPe: table(h * rope, 162),
        c: table(rank, 163),
        kpe: table(rope, 164),
        kvB: track(b.fromArray('f32', [h * (nope + v), rank], randomF32(h * (nope + v) * rank, 165, 0.2))),
        norm: track(b.fromArray('f32', [hidden], randomF32(hidden, 166, 0.1).map((x) => 1 + x))),
        lmHead: trackedInt4(b, track, int4(vocab, hidden, 32, 'BF16', 167)),
        invFreq: track(b.fromArray('f64', [rope / 2], Float64Array.from({ length: rope / 2 }, (_, i) => 1 / 10000 ** ((2 * i) / rope)))),
      };
      const cache0 = { c: randomF32(slots * rank, 168), kpe: randomF32(slots * rope, 169) };
      const side = () => ({
        token: track(b.fromArray('i32', [1], Int32Array.of(5))),
        positions: track(b.zeros('i32', [1])),
        outs: {
          cacheC: track(b.fromArray('f32', [slots, rank], cache0.c)),
          cacheKpe: track(b.fromArray('f32', [slots, rope], cache0.kpe)),
          x: track(b.zeros('f32', [1, hidden])),
          qNope: track(b.zeros('f32', [1, h, nope])),
          qPe: track(b.zeros('f32', [1, h, rope])),
          c: track(b.zeros('f32', [1, rank])),
          kpe: track(b.zeros('f32', [1, rope])),
          attn: track(b.zeros('f32', [1, h, v])),
          normed: track(b.zeros('f32', [1, hidden])),
          logits: track(b.zeros('f32', [1, vocab])),
        },
      });
      const L = track(b.fromArray('i32', [1], Int32Array.of(L0)));
      const queue = (x: ReturnType<typeof side>, base: number | undefined, stream: number) => {
        const o = x.outs;
        b.native.embedding({ table: w.x, ids: x.token, out: o.x, stream });
        b.native.embedding({ table: w.qNope, ids: x.token, out: { ...o.qNope, shape: [1, h * nope] }, stream });
        b.native.embedding({ table: w.qPe, ids: x.token, out: { ...o.qPe, shape: [1, h * rope] }, stream });
        b.native.embedding({ table: w.c, ids: x.token, out: o.c, stream });
        b.native.embedding({ table: w.kpe, ids: x.token, out: o.kpe, stream });
        if (base === undefined) b.native.arange({ startOnDevice: L, out: x.positions, stream });
        b.native.rope({ x: o.qPe, positions: x.positions, invFreq: w.invFreq, stream });
        b.native.rope({ x: { ...o.kpe, shape: [1, 1, rope] }, positions: x.positions, invFreq: w.invFreq, stream });
        b.native.kvWrite({ c: o.c, kpe: o.kpe, cacheC: o.cacheC, cacheKpe: o.cacheKpe, slots: x.positions, stream });
        const attention = { qNope: o.qNope, qPe: o.qPe, kvB: w.kvB, cacheC: o.cacheC, cacheKpe: o.cacheKpe, out: o.attn, scale: 1 / Math.sqrt(nope + rope), stream };
        b.native.mlaAttention(base === undefined ? { ...attention, base: bound, baseOnDevice: L } : { ...attention, base });
        b.native.add({ a: o.x, b: { ...o.attn, shape: [1, hidden] }, out: o.x, stream });
        b.native.rmsNorm({ x: o.x, weight: w.norm, out: o.normed, eps: 1e-6, stream });
        b.native.w4a16Gemm({ x: o.normed, qw: w.lmHead.qw, sc: w.lmHead.sc, y: o.logits, group: 32, stream });
        b.native.argmax({ x: o.logits, out: x.token, stream });
        if (base === undefined) b.native.arange({ startOnDevice: L, out: L, start: 1, stream });
      };
      const g = side();
      const d = side();
      return onStream(b, (s, graphs) => {
        const graph = b.capture(s, () => queue(g, undefined, s));
        graphs.push(graph);
        if (graph.calls !== 15) fail(`the graph holds ${graph.calls} calls, expected 15`);
        const tokens: number[] = [];
        for (let step = 0; step < steps; step++) {
          b.native.launchGraph(graph, s);
          b.synchronize(s);
          b.native.upload(d.positions.buffer, Int32Array.of(L0 + step));
          queue(d, L0 + step, 0);
          b.synchronize();
          expectSameTensors(b, `step ${step + 1}`, { token: g.token, ...g.outs }, { token: d.token, ...d.outs });
          const committed = (b.toArray(L) as Int32Array)[0];
          if (committed !== L0 + step + 1) fail(`step ${step + 1}: the device's committed length is ${committed}, expected ${L0 + step + 1}`);
          tokens.push((b.toArray(g.token) as Int32Array)[0]);
        }
        if (new Set(tokens).size < 2) fail(`the decoded tokens never change (${tokens.join(' ')}): the loop does not depend on its state`);
        return { detail: `tokens ${tokens.join(' ')} over slots ${L0}-${L0 + steps - 1}, every step equal to direct calls` };
      });
    });
  },
};

const misuse: KernelCheck = {
  name: 'graphs: misuse throws (the default stream, nested or missing captures, waits and events inside a capture, launching into a capture, freed buffers and graphs, another backend\'s graph); an op rejected during a capture leaves it going',
  run(b) {
    withTensors(b, (track) => {
      const s = b.native.createStream();
      const a = track(b.fromArray('f32', [1, 4], new Float32Array([1, 2, 3, 4])));
      const y = track(b.empty('f32', [1, 4]));
      const event = b.native.createEvent();
      const other = new Backend({ ...b.loaded, native: b.loaded.module.createBackend('cpu') });
      try {
        expectThrows('default stream', () => b.native.beginCapture(0), /stream 0 \(the default stream\) cannot be captured/);
        expectThrows('unknown stream', () => b.native.beginCapture(99), /unknown stream 99/);
        expectThrows('end without begin', () => b.native.endCapture(s), /endCapture: stream \d+ is not capturing/);
        b.native.beginCapture(s);
        expectThrows('nested', () => b.native.beginCapture(s), /beginCapture: stream \d+ is already capturing/);
        expectThrows('synchronize the stream', () => b.native.synchronize(s), /synchronize: stream \d+ is capturing a graph; call endCapture/);
        expectThrows('synchronize the device', () => b.native.synchronize(), /synchronize: stream \d+ is capturing a graph/);
        expectThrows('record an event', () => b.native.recordEvent(event, s), /recordEvent: stream \d+ is capturing a graph/);
        expectThrows('destroy the stream', () => b.native.destroyStream(s), /destroyStream: stream \d+ is capturing a graph/);
        expectThrows('bad shape inside', () => b.native.add({ a, b: { ...a, shape: [1, 3] }, out: y, stream: s }), /add/);
        b.native.add({ a, b: a, out: y, stream: s });
        b.native.add({ a: y, b: a, out: y, stream: s }); // y = 3a
        const graph = b.native.endCapture(s);
        if (graph.calls !== 2) fail(`the capture holds ${graph.calls} calls; the rejected op must not count`);
        b.native.beginCapture(s);
        expectThrows('launch into a capture', () => b.native.launchGraph(graph, s), /launchGraph: stream \d+ is capturing; a graph is not launched into a capture/);
        b.native.freeGraph(b.native.endCapture(s));
        b.native.launchGraph(graph, s);
        b.synchronize(s);
        expectEqual('graph of the capture with a rejected op', b.toArray(y) as Float32Array, new Float32Array([3, 6, 9, 12]));
        expectThrows('capture() whose queue throws', () => b.capture(s, () => b.native.add({ a, b: { ...a, dtype: 'i32' }, out: y, stream: s })), /add/);
        b.native.freeGraph(b.capture(s, () => b.native.add({ a, b: a, out: y, stream: s }))); // the stream captures again
        expectThrows('not a graph', () => b.native.launchGraph({} as Graph), /launchGraph: graph must be a Graph from endCapture\(\)/);
        const os = other.native.createStream();
        const oa = other.zeros('f32', [4]);
        const foreign = other.capture(os, () => other.native.add({ a: oa, b: oa, out: oa, stream: os }));
        expectThrows('another backend\'s graph', () => b.native.launchGraph(foreign), /launchGraph: graph belongs to another backend/);
        other.native.freeGraph(foreign);
        other.free(oa);
        const scratch = b.empty('f32', [1, 4]);
        const uses = b.capture(s, () => b.native.add({ a, b: a, out: scratch, stream: s }));
        b.free(scratch);
        expectThrows('freed buffer', () => b.native.launchGraph(uses, s), /launchGraph: buffer \d+ of the graph \(16 bytes\) was freed after the capture/);
        b.native.freeGraph(uses);
        expectThrows('freed graph', () => b.native.launchGraph(uses, s), /launchGraph: use of a freed graph/);
        expectThrows('double free', () => b.native.freeGraph(uses), /freeGraph: use of a freed graph/);
        b.native.freeGraph(graph);
      } finally {
        b.native.destroyEvent(event);
        b.native.destroyStream(s);
      }
    });
  },
};

export const GRAPH_CHECKS: KernelCheck[] = [replay, attentionAndTree, deviceLoop, decodeLoop, misuse];
