// Host time of one native call of @kdtree/cuda: argument parsing (tensors as {buffer, dtype, shape}),
// validation and the launch (cuda) or the tiny op itself (cpu), against the floor of a native call
// that parses nothing (synchronize() with no stream). The engine issues ~10-15 calls per layer and
// token; without CUDA graphs their host time adds up against kernels of 3-20 us. The second table
// times one MoE layer's tail (6 calls) called directly against the same calls captured as a graph;
// the third a DDTree step of one attention layer with the committed length and the root on the
// device (one graph, no read-back) against the same step given them by the host.
//   node tools/bench/host-cost.mjs [--backend cpu|cuda] [--addon-dir DIR] [--calls 100000] [--steps 2000]
// --addon-dir loads the addon from DIR (its kdtree_<variant>.node and .json), e.g. an older build.
import { parseArgs } from 'node:util';
import { createBackend } from '@kdtree/cuda';
import { machine, median, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { backend: { type: 'string', default: 'cpu' }, 'addon-dir': { type: 'string' }, calls: { type: 'string', default: '100000' }, steps: { type: 'string', default: '2000' } } });
const calls = Number(values.calls);
const steps = Number(values.steps);
const dir = values['addon-dir'];
const b = createBackend({ backend: values.backend, ...(dir ? { searchPaths: [dir], onlySearchPaths: true } : {}) });

/** Median over 5 rounds of `calls` calls, after a warm-up; microseconds per call. */
function perCall(fn) {
  for (let i = 0; i < Math.min(calls, 5000); i++) fn();
  b.synchronize();
  const rounds = [];
  for (let r = 0; r < 5; r++) {
    const t = performance.now();
    for (let i = 0; i < calls; i++) fn();
    b.synchronize();
    rounds.push(((performance.now() - t) * 1e3) / calls);
  }
  return median(rounds);
}

const f32 = (shape) => b.zeros('f32', shape);
const i32 = (shape, values) => (values ? b.fromArray('i32', shape, Int32Array.from(values)) : b.zeros('i32', shape));
const ops = [
  { name: 'add', tensors: 3, call: ((a, c, o) => () => b.native.add({ a, b: c, out: o }))(f32([1, 4]), f32([1, 4]), f32([1, 4])) },
  { name: 'siluMul', tensors: 2, call: ((x, out) => () => b.native.siluMul({ x, out }))(f32([1, 8]), f32([1, 4])) },
  {
    name: 'w4a16Gemm (1 x 128 x 16)',
    tensors: 4,
    call: ((x, qw, sc, y) => () => b.native.w4a16Gemm({ x, qw, sc, y }))(b.zeros('bf16', [1, 128]), i32([1, 1, 256]), b.zeros('bf16', [1, 1, 64]), f32([1, 16])),
  },
  {
    name: 'moeGemm gather (1 token, top-2 of 4 experts, 16 x 128)',
    tensors: 5,
    call: ((x, qw, sc, ids, y) => () => b.native.moeGemm({ x, qw, sc, ids, y, mode: 'gather' }))(b.zeros('bf16', [1, 128]), i32([4, 1, 1, 256]), b.zeros('bf16', [4, 1, 1, 64]), i32([1, 2], [0, 3]), f32([2, 16])),
  },
  {
    name: 'mlaAttention decode (1 head, rank 32 + rope 8, 64 slots)',
    tensors: 6,
    call: ((qNope, qPe, kvB, cacheC, cacheKpe, out) => () => b.native.mlaAttention({ qNope, qPe, kvB, cacheC, cacheKpe, out, base: 63, scale: 0.1 }))(
      f32([1, 1, 16]),
      f32([1, 1, 8]),
      f32([32, 32]),
      f32([64, 32]),
      f32([64, 8]),
      f32([1, 1, 16]),
    ),
  },
  {
    name: 'ddtreeAccept (9 nodes)',
    tensors: 7,
    call: ((tokens, parents, size, targetArgmax, path, pathLen, bonus) => () => b.native.ddtreeAccept({ tokens, parents, size, targetArgmax, path, pathLen, bonus }))(
      i32([9]),
      i32([9], [-1, 0, 0, 1, 1, 2, 2, 3, 3]),
      i32([1], [9]),
      i32([9]),
      i32([9]),
      i32([1]),
      i32([1]),
    ),
  },
];

const floor = perCall(() => b.native.synchronize());
const rows = [['synchronize() (the floor: parses nothing)', 0, floor.toFixed(2), '-', '-']];
for (const op of ops) {
  const us = perCall(op.call);
  rows.push([op.name, op.tensors, us.toFixed(2), (us - floor).toFixed(2), ((us - floor) / op.tensors).toFixed(2)]);
}
console.log(`host time per native call, ${b.info().name}${dir ? ` (addon from ${dir})` : ''}; median of 5 x ${calls} calls`);
console.log(`machine: ${machine()}`);
console.log(table(['call', 'tensors', 'us per call', 'us over the floor', 'us per tensor'], rows));

// The calls of one MoE block per step: rms_norm, router, gate_up GEMM with SiLU (bf16 x), down GEMM
// summed over the experts, residual add, copy. cuda: one tensor-parallel rank of Kimi K2 at decode
// (hidden 7168, 384 experts of I 256, top-8; constant weights: the kernels' time does not depend on
// the values); cpu: a small block, as the twin runs the GEMMs on the host. Per step: host us (until
// the calls return, with the stream held so that nothing waits for the device), device us (events
// around 100 steps queued behind a hold) and wall us (a loop of `steps` steps, then a synchronize:
// the larger of the two once the loop runs long).
if (typeof b.native.beginCapture !== 'function') {
  console.log('\n(this build has no graphs: the MoE block table is skipped)');
  process.exit(0);
}
const block = b.kind === 'cuda' ? { H: 7168, E: 384, I: 256, topk: 8 } : { H: 256, E: 16, I: 64, topk: 2 };
const { H, E, I, topk } = block;
const stream = b.native.createStream();
const packedConstant = (rows, k, experts, interleaveGateUp = false) => {
  const qw = b.empty('i32', [experts, rows, k / 8]);
  const sc = b.empty('bf16', [experts, rows, k / 32]);
  b.native.fill(qw.buffer, 0x5a);
  b.native.fill(sc.buffer, 0x3c);
  const packed = b.packW4A16(qw, sc, 32, undefined, { interleaveGateUp });
  b.free(qw, sc);
  return packed;
};
const gateUp = packedConstant(2 * I, H, E, true);
const down = packedConstant(H, I, E);
const t = {
  x: b.fromArray('f32', [1, H], new Float32Array(H).fill(0.5)),
  norm: b.fromArray('f32', [H], new Float32Array(H).fill(1)),
  h: f32([1, H]),
  hBf16: b.fromArray('bf16', [1, H], new Uint16Array(H).fill(0x3f00)),
  logits: b.fromArray('f32', [1, E], Float32Array.from({ length: E }, (_, e) => Math.sin(e))),
  bias: f32([E]),
  ids: i32([1, topk]),
  weights: f32([1, topk]),
  act: b.zeros('bf16', [topk, I]),
  moe: f32([1, H]),
  out: f32([1, H]),
  copied: f32([1, H]),
};
const blockCalls = [
  ['rmsNorm', () => b.native.rmsNorm({ x: t.x, weight: t.norm, out: t.h, eps: 1e-6, stream })],
  ['router', () => b.native.router({ logits: t.logits, bias: t.bias, ids: t.ids, weights: t.weights, topk, stream })],
  ['moeGemm gate_up + SiLU', () => b.native.moeGemm({ x: t.hBf16, qw: gateUp.qw, sc: gateUp.sc, ids: t.ids, y: t.act, mode: 'gather', epilogue: 'siluMul', stream })],
  ['moeGemm down, summed', () => b.native.moeGemm({ x: t.act, qw: down.qw, sc: down.sc, ids: t.ids, weights: t.weights, y: t.moe, mode: 'sum', stream })],
  ['add', () => b.native.add({ a: t.x, b: t.moe, out: t.out, stream })],
  ['copy', () => b.native.copy({ dst: t.copied.buffer, src: t.out.buffer, stream })],
];
const queueBlock = () => {
  for (const [, call] of blockCalls) call();
};
const graph = b.capture(stream, queueBlock);
const launch = () => b.native.launchGraph(graph, stream);

const HOLD_US = 50_000;
const QUEUED = 100;
/** Device us per run of `fn`: events around `queued` runs queued behind a hold; median of 5. */
const deviceUs = (fn, queued = QUEUED) => median(Array.from({ length: 5 }, () => (b.time(() => { for (let i = 0; i < queued; i++) fn(); }, stream, HOLD_US) * 1e3) / queued));
/**
 * Host us, device us and wall us per step; medians of 5 rounds. `queued` steps go behind the hold:
 * few enough that their kernels fit the device's launch queue (~1000 launches), or the host waits
 * for the hold and its time is the hold's.
 */
function perStep(step, queued = QUEUED) {
  for (let i = 0; i < Math.min(steps, 200); i++) step();
  b.synchronize(stream);
  const host = [];
  const wall = [];
  for (let r = 0; r < 5; r++) {
    b.native.hold(HOLD_US, stream);
    const t0 = performance.now();
    for (let i = 0; i < queued; i++) step();
    host.push(((performance.now() - t0) * 1e3) / queued);
    b.synchronize(stream);
    const t1 = performance.now();
    for (let i = 0; i < steps; i++) step();
    b.synchronize(stream);
    wall.push(((performance.now() - t1) * 1e3) / steps);
  }
  return { host: median(host), device: deviceUs(step, queued), wall: median(wall) };
}
console.log(`\nMoE block per step (hidden ${H}, ${E} experts of I ${I}, top-${topk}, 1 token): device us per call`);
console.log(table(['call', 'device us'], blockCalls.map(([name, call]) => [name, deviceUs(call).toFixed(2)])));
const direct = perStep(queueBlock);
const replay = perStep(launch);
console.log(`\nthe ${graph.calls} calls direct vs one launchGraph of their graph; host us with the stream held, wall us over ${steps} steps; medians of 5`);
console.log(
  table(
    ['step', 'host us per step', 'device us per step', 'wall us per step'],
    [
      [`${graph.calls} calls`, direct.host.toFixed(2), direct.device.toFixed(2), direct.wall.toFixed(2)],
      ['launchGraph', replay.host.toFixed(2), replay.device.toFixed(2), replay.wall.toFixed(2)],
    ],
  ),
);
b.native.freeGraph(graph);

// A DDTree step of one attention layer: build (root = the last bonus, start = the committed length
// L), the nodes' cache slots, kv_write, the tree verify's attention, accept, commit. cuda: Kimi K2's
// per-rank attention (8 heads, rank 512 + 64 rope, bf16 cache of 4096 committed slots, bound 8192)
// and draft (8 depths of 163840 logits), budget 64; cpu: a small one. With the length and the root
// on the device the step is one graph and nothing is read back; given by the host, each step reads
// pathLen and bonus back before the next can be queued. The commit writes the next length to a
// buffer of its own, so L stays where it is and every step does the same work.
if (typeof b.native.arange !== 'function') {
  console.log('\n(this build has no device scalars: the DDTree step table is skipped)');
  process.exit(0);
}
const att = b.kind === 'cuda' ? { h: 8, nope: 128, rope: 64, v: 128, rank: 512, committed: 4096, bound: 8192, depth: 8, vocab: 163840, budget: 64 } : { h: 2, nope: 16, rope: 8, v: 16, rank: 32, committed: 200, bound: 400, depth: 4, vocab: 2000, budget: 16 };
const n = att.budget + 1;
const a = {
  draft: b.fromArray('f32', [att.depth, att.vocab], Float32Array.from({ length: att.depth * att.vocab }, (_, i) => Math.sin(i * 0.37))),
  qNope: b.fromArray('f32', [n, att.h, att.nope], new Float32Array(n * att.h * att.nope).fill(0.01)),
  qPe: b.fromArray('f32', [n, att.h, att.rope], new Float32Array(n * att.h * att.rope).fill(0.01)),
  c: f32([n, att.rank]),
  kpe: f32([n, att.rope]),
  kvB: b.zeros('bf16', [att.h * (att.nope + att.v), att.rank]),
  cacheC: b.zeros('bf16', [att.bound + n, att.rank]),
  cacheKpe: b.zeros('bf16', [att.bound + n, att.rope]),
  out: f32([n, att.h, att.v]),
  tree: { tokens: i32([n]), parents: i32([n]), depths: i32([n]), positions: i32([n]), mask: b.zeros('u8', [n, n]), size: i32([1]) },
  slots: i32([n]),
  targetArgmax: i32([n]),
  path: i32([n]),
  pathLen: i32([1]),
  bonus: i32([1], [7]),
  L: i32([1], [att.committed]),
  nextL: i32([1]),
};
const scale = 1 / Math.sqrt(att.nope + att.rope);
const stepOnDevice = () => {
  b.native.ddtreeBuild({ draftLogits: a.draft, rootOnDevice: a.bonus, budget: att.budget, startOnDevice: a.L, ...a.tree, stream });
  b.native.arange({ startOnDevice: a.L, out: a.slots, stream });
  b.native.kvWrite({ c: a.c, kpe: a.kpe, cacheC: a.cacheC, cacheKpe: a.cacheKpe, slots: a.slots, stream });
  b.native.mlaAttention({ qNope: a.qNope, qPe: a.qPe, kvB: a.kvB, cacheC: a.cacheC, cacheKpe: a.cacheKpe, mask: a.tree.mask, out: a.out, base: att.bound, baseOnDevice: a.L, scale, stream });
  b.native.ddtreeAccept({ tokens: a.tree.tokens, parents: a.tree.parents, size: a.tree.size, targetArgmax: a.targetArgmax, path: a.path, pathLen: a.pathLen, bonus: a.bonus, stream });
  b.native.kvCommit({ caches: [a.cacheC, a.cacheKpe], path: a.path, pathLen: a.pathLen, startOnDevice: a.L, nextStart: a.nextL, stream });
};
let root = 7;
const slotsFromHost = Int32Array.from({ length: n }, (_, k) => att.committed + k);
const stepFromHost = () => {
  b.native.ddtreeBuild({ draftLogits: a.draft, root, budget: att.budget, start: att.committed, ...a.tree, stream });
  b.native.upload(a.slots.buffer, slotsFromHost);
  b.native.kvWrite({ c: a.c, kpe: a.kpe, cacheC: a.cacheC, cacheKpe: a.cacheKpe, slots: a.slots, stream });
  b.native.mlaAttention({ qNope: a.qNope, qPe: a.qPe, kvB: a.kvB, cacheC: a.cacheC, cacheKpe: a.cacheKpe, mask: a.tree.mask, out: a.out, base: att.committed, scale, stream });
  b.native.ddtreeAccept({ tokens: a.tree.tokens, parents: a.tree.parents, size: a.tree.size, targetArgmax: a.targetArgmax, path: a.path, pathLen: a.pathLen, bonus: a.bonus, stream });
  b.native.kvCommit({ caches: [a.cacheC, a.cacheKpe], path: a.path, pathLen: a.pathLen, start: att.committed, stream });
  // what the next step needs from this one: the committed length moves by pathLen, the root is the bonus
  b.synchronize(stream);
  root = b.toArray(a.bonus)[0];
  b.toArray(a.pathLen);
};
const ddtreeGraph = b.capture(stream, stepOnDevice);
const launchStep = () => b.native.launchGraph(ddtreeGraph, stream);
/** Wall us per step of a loop of `steps` steps (a step that reads back cannot be timed with the stream held); median of 5. */
function wallPerStep(step) {
  for (let i = 0; i < Math.min(steps, 100); i++) step();
  b.synchronize(stream);
  return median(
    Array.from({ length: 5 }, () => {
      const t0 = performance.now();
      for (let i = 0; i < steps; i++) step();
      b.synchronize(stream);
      return ((performance.now() - t0) * 1e3) / steps;
    }),
  );
}
const fromHostWall = wallPerStep(stepFromHost);
// ~15 kernels a step: 40 steps stay inside the launch queue
const onDevice = perStep(stepOnDevice, 40);
const graphStep = perStep(launchStep, 40);
console.log(`\nDDTree step (budget ${att.budget}, ${att.depth} x ${att.vocab} draft logits; attention ${att.h} heads, rank ${att.rank} + ${att.rope}, ${att.committed} committed slots): us per step`);
console.log(
  table(
    ['step', 'host us per step', 'device us per step', 'wall us per step'],
    [
      ['6 calls + read back (host scalars)', '-', '-', fromHostWall.toFixed(2)],
      ['6 calls (device scalars)', onDevice.host.toFixed(2), onDevice.device.toFixed(2), onDevice.wall.toFixed(2)],
      ['launchGraph (device scalars)', graphStep.host.toFixed(2), graphStep.device.toFixed(2), graphStep.wall.toFixed(2)],
    ],
  ),
);
b.native.freeGraph(ddtreeGraph);
