// Host time of one native call of @kdtree/cuda: argument parsing (tensors as {buffer, dtype, shape}),
// validation and the launch (cuda) or the tiny op itself (cpu), against the floor of a native call
// that parses nothing (synchronize() with no stream). The engine issues ~10-15 calls per layer and
// token; without CUDA graphs their host time adds up against kernels of 3-20 us.
//   node tools/bench/host-cost.mjs [--backend cpu|cuda] [--addon-dir DIR] [--calls 100000]
// --addon-dir loads the addon from DIR (its kdtree_<variant>.node and .json), e.g. an older build.
import { parseArgs } from 'node:util';
import { createBackend } from '@kdtree/cuda';
import { machine, median, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { backend: { type: 'string', default: 'cpu' }, 'addon-dir': { type: 'string' }, calls: { type: 'string', default: '100000' } } });
const calls = Number(values.calls);
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
