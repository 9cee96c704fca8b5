/**
 * The GPU benchmark of @kdtree/cuda (bundled into .gpu/bench.mjs; see docs/benchmarks/cuda.md):
 *   - device-to-device copy bandwidth, measured here (the physical ceiling for W4A16 at small M)
 *   - W4A16 GEMM, bf16 activations, on the Kimi K2 shapes at M = 1..128 and at prefill sizes 512 and 2048: time, effective
 *     bandwidth (weights + scales + x + y), fraction of the copy bandwidth, and speedup over the
 *     dense bf16 GEMM of torch/cuBLAS measured in the same run (dense_baseline.py -> argv[2]), and
 *     against torch's int4 weight-only GEMM (tinygemm, group 32) in the same run (int4_peer.py -> argv[3])
 *   - gemm (bf16 weights as stored) on the layers Kimi K2 keeps in bf16, against torch's bf16
 *     linear (cuBLAS) in the same run and the time to read the weights at the copy bandwidth
 *   - the grouped MoE decode step of Kimi K2 (384 experts, 8 per token, gate_up + SiLU + down)
 *   - MLA attention of one tensor-parallel rank (8 heads): decode, tree verifies of 9-129 nodes,
 *     prefill, vs the time to read the cache once at the copy bandwidth
 *   - what a verify forward of a DDTree budget of 8-128 nodes costs one rank's layer (routed MoE
 *     experts + attention) against a decode step
 *   - DDTree build + accept at budgets 64..512 over a 163840-token vocabulary
 *   - the one-launch DDTree builds (budgets 1-32, a DFlash block of 8) against the argmax that
 *     drafts a chain of the same depths, on the demo's 8192-token and Kimi K2's 163840-token vocabularies
 * Each W4A16 shape is validated against the C++ twin on the same random weights before it is
 * timed; the other kernels' correctness comes from the self-test (selftest.mjs), whose MLA checks
 * include Kimi K2's per-rank dims.
 * Weights rotate over copies larger than the L2 cache, so timings are HBM timings.
 */
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { bf16ArrayToF32, f32ArrayToBf16 } from '@kdtree/format';
import { SeededRandom } from '@kdtree/reference';
import { createBackend, type DeviceTensor, type KdtreeBackend } from '../../packages/cuda/src/backend.js';
import { packedW4A16Shapes } from '../../packages/cuda/src/w4a16-layout.js';
import { treeMask } from './tree-mask.js';

const here = dirname(fileURLToPath(import.meta.url));
const gpu = createBackend({ backend: 'cuda', searchPaths: [here], onlySearchPaths: true });
const cpu = createBackend({ backend: 'cpu', searchPaths: [here], onlySearchPaths: true });
const info = gpu.info();
const dense = process.argv[2] ? JSON.parse(readFileSync(process.argv[2], 'utf8')) : undefined;
// {kernel, shapes: {NxK: {M: ms}}}, or {kernel, error} where the GPU host's torch had no usable one
const int4Peer = process.argv[3] ? JSON.parse(readFileSync(process.argv[3], 'utf8')) : undefined;
const rng = new SeededRandom(2026);
const report: Record<string, unknown> = { device: info };
const lines: string[] = [];
const log = (s: string) => {
  lines.push(s);
  console.log(s);
};

function median(v: number[]): number {
  const s = [...v].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

/**
 * Median over 5 event-timed batches of `reps` launches, after a warm-up; ms per launch. The stream
 * is held while the batch queues (a native call costs the host tens of microseconds, more than
 * many of these kernels take), so the figures are device time, as a CUDA graph replay would see.
 */
function timeLaunches(b: KdtreeBackend, launch: (r: number) => void, reps = 20): number {
  for (let r = 0; r < 3; r++) launch(r);
  b.synchronize();
  const t0 = performance.now();
  launch(0);
  const hostUs = (performance.now() - t0) * 1e3;
  b.synchronize();
  const holdUs = Math.ceil(Math.max(2000, 3 * hostUs * reps));
  return median(Array.from({ length: 5 }, () => b.time(() => { for (let r = 0; r < reps; r++) launch(r); }, 0, holdUs) / reps));
}

/** The outputs of a ddtreeBuild of `nodes` nodes (budget + 1): tokens, parents, depths, positions, the ancestor mask and the size. */
function treeOutputs(b: KdtreeBackend, nodes: number) {
  return { tokens: b.empty('i32', [nodes]), parents: b.empty('i32', [nodes]), depths: b.empty('i32', [nodes]), positions: b.empty('i32', [nodes]), mask: b.empty('u8', [nodes, nodes]), size: b.empty('i32', [1]) };
}

/** Whether `call` runs without throwing (a native error: the build does not support it). */
function attempt(call: () => void): boolean {
  try {
    call();
    return true;
  } catch {
    return false;
  }
}

/**
 * Runs `call` on `b` without forced kernel forms (KDTREE_GEMM_FORM, KDTREE_W4A16_PREFILL, read when
 * the backend was created): a forced form that cannot run a call throws, and the 4-row validations
 * run forms the timed sizes need not.
 */
function withoutOverrides<T>(b: KdtreeBackend, call: () => T): T {
  const saved = b.native.setForcedForms({});
  try {
    return call();
  } finally {
    b.native.setForcedForms(saved);
  }
}

function randomWords(n: number): Int32Array {
  return Int32Array.from({ length: n }, () => (rng.uniform() * 4294967296) | 0);
}
function randomScales(n: number): Uint16Array {
  return f32ArrayToBf16(Float32Array.from({ length: n }, () => 0.005 + 0.015 * rng.uniform()));
}
function randomBf16(n: number): Uint16Array {
  return f32ArrayToBf16(Float32Array.from({ length: n }, () => rng.normal()));
}
/** Checkpoint-layout weights uploaded to `b` and packed for the GEMM (the checkpoint copy freed). */
function packCheckpoint(b: KdtreeBackend, qShape: number[], qw: Int32Array, sShape: number[], sc: Uint16Array): { qw: DeviceTensor; sc: DeviceTensor } {
  const q = b.fromArray('i32', qShape, qw);
  const s = b.fromArray('bf16', sShape, sc);
  const packed = b.packW4A16(q, s, 32);
  b.free(q, s);
  return packed;
}

function relError(a: Float32Array, b: Float32Array): number {
  let num = 0;
  let den = 0;
  for (let i = 0; i < a.length; i++) {
    num += (a[i] - b[i]) ** 2;
    den += b[i] ** 2;
  }
  return Math.sqrt(num / den);
}

const table = (header: string[], rows: string[][]) => {
  const w = header.map((h, c) => Math.max(h.length, ...rows.map((r) => r[c].length)));
  const line = (cells: string[]) => `| ${cells.map((x, c) => x.padEnd(w[c])).join(' | ')} |`;
  return [line(header), `|${w.map((x) => '-'.repeat(x + 2)).join('|')}|`, ...rows.map(line)].join('\n');
};

// 1. copy bandwidth
const copyBytes = 2 ** 31;
const src = gpu.empty('u8', [copyBytes]);
const dst = gpu.empty('u8', [copyBytes]);
gpu.native.fill(src.buffer, 0x5a);
const copyMs = timeLaunches(gpu, () => gpu.native.copy({ dst: dst.buffer, src: src.buffer }), 5);
const copyGBs = (2 * copyBytes) / (copyMs * 1e-3) / 1e9;
gpu.free(src, dst);
log(`device: ${info.name}, ${info.multiprocessors} SMs, compute ${info.computeCapability}, driver ${info.driverVersion}, runtime ${info.runtimeVersion}`);
log(`device-to-device copy: ${copyGBs.toFixed(0)} GB/s (read + write of 2 GiB)${dense ? `; torch measured ${dense.copy_gbps.toFixed(0)} GB/s` : ''}`);
report.copyGBs = copyGBs;

// 2. W4A16 GEMM on Kimi K2 shapes
const SHAPES = [[4096, 7168, 'expert gate+up'], [7168, 2048, 'expert down'], [18432, 7168, 'dense gate/up'], [7168, 18432, 'dense down']] as const;
// 512 and 2048: prefill. KDTREE_BENCH_MS=512,2048 (ascending) limits an A/B run to some of them.
const MS = process.env.KDTREE_BENCH_MS ? process.env.KDTREE_BENCH_MS.split(',').map(Number) : [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048];
if (!MS.every((m, i) => Number.isInteger(m) && m > 0 && (i === 0 || m > MS[i - 1]))) {
  throw new Error(`KDTREE_BENCH_MS: expected ascending positive token counts like 512,2048, got ${process.env.KDTREE_BENCH_MS}`);
}
const gemmRows: string[][] = [];
const gemmReport: unknown[] = [];
// KDTREE_BENCH_ONLY=gemm runs only the W4A16 and MoE figures, =float only the bf16-weight gemm,
// =attention only the attention and DDTree ones, =ddtree only the one-launch DDTree builds, =small
// only the small ops (A/B runs)
const only = process.env.KDTREE_BENCH_ONLY;
const SECTIONS = ['gemm', 'float', 'attention', 'ddtree', 'small'] as const;
if (only !== undefined && !(SECTIONS as readonly string[]).includes(only)) throw new Error(`KDTREE_BENCH_ONLY: expected ${SECTIONS.join(', ')}, got ${only}`);
const runs = (section: (typeof SECTIONS)[number]) => only === undefined || only === section;
for (const [n, k, what] of runs('gemm') ? SHAPES : []) {
  const words = (n * k) / 8;
  const groups = (n * k) / 32;
  const weightBytes = words * 4 + groups * 2;
  const copies = Math.max(2, Math.ceil(240e6 / weightBytes));
  // copy 0 random (validated), the others filled with a byte pattern (timing only)
  const qws: DeviceTensor[] = [];
  const scs: DeviceTensor[] = [];
  const qw0 = randomWords(words);
  const sc0 = randomScales(groups);
  const packedShapes = packedW4A16Shapes(n, k, 32);
  for (let c = 0; c < copies; c++) {
    if (c === 0) {
      const packed = packCheckpoint(gpu, [n, k / 8], qw0, [n, k / 32], sc0);
      qws.push(packed.qw);
      scs.push(packed.sc);
    } else {
      qws.push(gpu.empty('i32', packedShapes.qw));
      scs.push(gpu.empty('bf16', packedShapes.sc));
      gpu.native.fill(qws[c].buffer, 0x5a);
      gpu.native.fill(scs[c].buffer, 0x3c);
    }
  }
  const mMax = Math.max(4, MS[MS.length - 1]);  // the validation below runs 4 rows
  const xHost = randomBf16(mMax * k);
  const x = gpu.fromArray('bf16', [mMax, k], xHost);
  const y = gpu.empty('bf16', [mMax, n]);
  // validation: cuda vs the C++ twin at M = 4 (bf16 out; tolerance of bf16 activations)
  {
    const xc = cpu.fromArray('bf16', [4, k], xHost.subarray(0, 4 * k));
    const { qw: qc, sc: scc } = packCheckpoint(cpu, [n, k / 8], qw0, [n, k / 32], sc0);
    const yc = cpu.empty('f32', [4, n]);
    cpu.native.w4a16Gemm({ x: xc, qw: qc, sc: scc, y: yc, group: 32 });
    const yg = gpu.empty('f32', [4, n]);
    withoutOverrides(gpu, () => gpu.native.w4a16Gemm({ x: { ...x, shape: [4, k] }, qw: qws[0], sc: scs[0], y: yg, group: 32 }));
    const e = relError(gpu.toArray(yg) as Float32Array, cpu.toArray(yc) as Float32Array);
    if (!(e <= 1e-4)) throw new Error(`validation failed for ${n}x${k}: cuda vs cpu twin rel ${e}`);
    log(`validated ${n}x${k} (${what}): cuda vs C++ twin at M=4, rel ${e.toExponential(1)}`);
    cpu.free(xc, qc, scc, yc);
    gpu.free(yg);
  }
  for (const m of MS) {
    const ms = timeLaunches(gpu, (r) => gpu.native.w4a16Gemm({ x: { ...x, shape: [m, k] }, qw: qws[r % copies], sc: scs[r % copies], y: { ...y, shape: [m, n] }, group: 32 }));
    const bytes = weightBytes + m * k * 2 + m * n * 2;
    const gbs = bytes / (ms * 1e-3) / 1e9;
    const denseMs: number | undefined = dense?.shapes?.[`${n}x${k}`]?.[m];
    const peerMs: number | undefined = int4Peer?.shapes?.[`${n}x${k}`]?.[m];
    const us = (v: number | undefined) => (v ? (v * 1e3).toFixed(1) : '-');
    const ratio = (v: number | undefined) => (v ? (v / ms).toFixed(2) : '-');
    gemmRows.push([`${n}x${k}`, String(m), us(ms), gbs.toFixed(0), `${((gbs / copyGBs) * 100).toFixed(0)}%`, us(denseMs), ratio(denseMs), us(peerMs), ratio(peerMs)]);
    gemmReport.push({ n, k, m, us: ms * 1e3, gbs, fractionOfCopy: gbs / copyGBs, denseUs: denseMs ? denseMs * 1e3 : null, int4PeerUs: peerMs ? peerMs * 1e3 : null });
  }
  gpu.free(...qws, ...scs, x, y);
}
report.gemm = gemmReport;
if (int4Peer) report.int4Peer = { kernel: int4Peer.kernel, torch: int4Peer.torch, error: int4Peer.error ?? null };

if (runs('gemm')) {
  log('');
  if (int4Peer) log(`int4 peer: ${int4Peer.kernel}, torch ${int4Peer.torch}${int4Peer.error ? `: not measured (${int4Peer.error})` : ', group 32'}`);
  log(table(['N x K', 'M', 'W4A16 us', 'GB/s', 'of copy', 'dense bf16 us', 'speedup', 'int4 peer us', 'vs peer'], gemmRows));
  log('');
}

// 2b. gemm (bf16 weights as stored) on the layers a Kimi K2 checkpoint keeps in bf16, one
// tensor-parallel rank of 8 where the layer is split, against torch's bf16 linear (cuBLAS) on the
// same shapes and the time to read the weights once at the copy bandwidth
const FLOAT_SHAPES = [
  [1536, 7168, 'q_a_proj'],
  [576, 7168, 'kv_a_proj_with_mqa'],
  [1536, 1536, 'q_b_proj (rank)'],
  [7168, 1024, 'o_proj (rank)'],
  [4608, 7168, 'layer 0 gate_up (rank)'],
  [7168, 2304, 'layer 0 down (rank)'],
  [20480, 7168, 'lm_head (rank)'],
  [18432, 7168, 'dense gate/up (whole)'],
] as const;
const floatRows: string[][] = [];
const floatReport: unknown[] = [];
for (const [n, k, what] of runs('float') ? FLOAT_SHAPES : []) {
  const weightBytes = n * k * 2;
  const copies = Math.max(2, Math.ceil(240e6 / weightBytes));
  const w0 = randomBf16(n * k);
  const ws = Array.from({ length: copies }, (_, c) => {
    if (c === 0) return gpu.fromArray('bf16', [n, k], w0);
    const t = gpu.empty('bf16', [n, k]);
    gpu.native.fill(t.buffer, 0x3c);
    return t;
  });
  const mMax = Math.max(4, MS[MS.length - 1]);  // the validation below runs 4 rows
  const xHost = randomBf16(mMax * k);
  const x = gpu.fromArray('bf16', [mMax, k], xHost);
  const y = gpu.empty('bf16', [mMax, n]);
  {
    // validation: cuda vs the C++ twin at M = 4, f32 out (both sum exact products in f32)
    const xc = cpu.fromArray('bf16', [4, k], xHost.subarray(0, 4 * k));
    const wc = cpu.fromArray('bf16', [n, k], w0);
    const yc = cpu.empty('f32', [4, n]);
    cpu.native.gemm({ x: xc, w: wc, y: yc });
    const yg = gpu.empty('f32', [4, n]);
    withoutOverrides(gpu, () => gpu.native.gemm({ x: { ...x, shape: [4, k] }, w: ws[0], y: yg }));
    const e = relError(gpu.toArray(yg) as Float32Array, cpu.toArray(yc) as Float32Array);
    if (!(e <= 1e-5)) throw new Error(`gemm validation failed for ${n}x${k}: cuda vs cpu twin rel ${e}`);
    log(`validated gemm ${n}x${k} (${what}): cuda vs C++ twin at M=4, rel ${e.toExponential(1)}`);
    cpu.free(xc, wc, yc);
    gpu.free(yg);
  }
  for (const m of MS) {
    const ms = timeLaunches(gpu, (r) => gpu.native.gemm({ x: { ...x, shape: [m, k] }, w: ws[r % copies], y: { ...y, shape: [m, n] } }));
    const bytes = weightBytes + m * k * 2 + m * n * 2;
    const gbs = bytes / (ms * 1e-3) / 1e9;
    const floorMs = (bytes / (copyGBs * 1e9)) * 1e3;
    const denseMs: number | undefined = dense?.shapes?.[`${n}x${k}`]?.[m];
    const us = (v: number | undefined) => (v ? (v * 1e3).toFixed(1) : '-');
    floatRows.push([`${n}x${k}`, what, String(m), us(ms), gbs.toFixed(0), `${((gbs / copyGBs) * 100).toFixed(0)}%`, us(floorMs), us(denseMs), denseMs ? (denseMs / ms).toFixed(2) : '-']);
    floatReport.push({ n, k, what, m, us: ms * 1e3, gbs, fractionOfCopy: gbs / copyGBs, floorUs: floorMs * 1e3, cublasUs: denseMs ? denseMs * 1e3 : null });
  }
  gpu.free(...ws, x, y);
}
if (floatRows.length) {
  report.floatGemm = floatReport;
  log(table(['N x K', 'layer', 'M', 'gemm us', 'GB/s', 'of copy', 'read floor us', 'cuBLAS bf16 us', 'cuBLAS / gemm'], floatRows));
  log('');
}

// 3. grouped MoE decode step of Kimi K2: 384 experts, 8 per token, H 7168, I 2048, group 32; and
// the same step on one tensor-parallel rank of 8 (each expert's intermediate split: I 256), which
// is what the engine runs per GPU
const E = 384;
const TOPK = 8;
const H = 7168;
const I = 2048;
const moeWeights = (inter: number) => {
  const guShapes = packedW4A16Shapes(2 * inter, H, 32, E);
  const dnShapes = packedW4A16Shapes(H, inter, 32, E);
  const w = { guQ: gpu.empty('i32', guShapes.qw), guS: gpu.empty('bf16', guShapes.sc), dnQ: gpu.empty('i32', dnShapes.qw), dnS: gpu.empty('bf16', dnShapes.sc) };
  for (const t of [w.guQ, w.dnQ]) gpu.native.fill(t.buffer, 0x5a);
  for (const t of [w.guS, w.dnS]) gpu.native.fill(t.buffer, 0x3c);
  // bytes of one token's top-k experts: codes + bf16 scales of gate_up and down
  const bytes = TOPK * ((2 * inter * H) / 2 + 2 * inter * (H / 32) * 2 + (H * inter) / 2 + H * (inter / 32) * 2);
  return { ...w, inter, bytes, free: () => gpu.free(w.guQ, w.guS, w.dnQ, w.dnS) };
};
// fused: SiLU-and-multiply in the gate_up GEMM's epilogue (weights packed with interleaveGateUp;
// these are constant bytes, so the same buffers serve) instead of a kernel of its own
const moeDecode = (w: ReturnType<typeof moeWeights>, label: string, minWarpSteps = 0, fused = false) => {
  const route = new SeededRandom(1000);  // the same routing for every variant of the step
  const idSets = Array.from({ length: 16 }, () => {
    const chosen = new Set<number>();
    while (chosen.size < TOPK) chosen.add(Math.floor(route.uniform() * E));
    return gpu.fromArray('i32', [1, TOPK], Int32Array.from([...chosen].sort((a, b) => a - b)));
  });
  const topkW = gpu.fromArray('f32', [1, TOPK], Float32Array.from({ length: TOPK }, () => 0.1 + rng.uniform() * 0.3));
  const xTok = gpu.fromArray('bf16', [1, H], randomBf16(H));
  const gu = gpu.empty('bf16', [TOPK, 2 * w.inter]);
  const act = gpu.empty('bf16', [TOPK, w.inter]);
  const out = gpu.empty('bf16', [1, H]);
  const step = (r: number) => {
    const ids = idSets[r % idSets.length];
    if (fused) {
      gpu.native.moeGemm({ x: xTok, qw: w.guQ, sc: w.guS, ids, y: act, mode: 'gather', epilogue: 'siluMul', minWarpSteps });
    } else {
      gpu.native.moeGemm({ x: xTok, qw: w.guQ, sc: w.guS, ids, y: gu, mode: 'gather', minWarpSteps });
      gpu.native.siluMul({ x: gu, out: act });
    }
    gpu.native.moeGemm({ x: act, qw: w.dnQ, sc: w.dnS, ids, weights: topkW, y: out, mode: 'sum', minWarpSteps });
  };
  const ms = timeLaunches(gpu, step);
  const gbs = w.bytes / (ms * 1e-3) / 1e9;
  log(`MoE decode step (${label}: ${E} experts, top-${TOPK}, gate_up + SiLU + down${fused ? ' with SiLU in the gate_up epilogue' : ''}, I ${w.inter}, bf16): ${(ms * 1e3).toFixed(1)} us, ${(w.bytes / 1e6).toFixed(1)} MB of expert weights, ${gbs.toFixed(0)} GB/s = ${((gbs / copyGBs) * 100).toFixed(0)}% of copy`);
  gpu.free(...idSets, topkW, xTok, gu, act, out);
  return { us: ms * 1e3, intermediate: w.inter, minWarpSteps, siluEpilogue: fused, bytes: w.bytes, gbs, fractionOfCopy: gbs / copyGBs };
};
// The same MoE layer at a DDTree verify: T tokens (65: a 64-node tree + root), top-8 each, so at
// 65 most of the 384 experts get one or two rows. Routing is uniform at random: the most experts T
// tokens can touch (a drafted tree shares its context, so a real one touches fewer). Bytes: the
// experts actually used, once.
const moeVerify = (w: ReturnType<typeof moeWeights>, label: string, minWarpSteps = 0, T = 65, fused = false, step = 'verify step') => {
  const route = new SeededRandom(1000 + T);  // the same routing for every variant of the step
  const sets = Array.from({ length: 4 }, () => {
    const ids = new Int32Array(T * TOPK);
    for (let t = 0; t < T; t++) {
      const chosen = new Set<number>();
      while (chosen.size < TOPK) chosen.add(Math.floor(route.uniform() * E));
      ids.set([...chosen].sort((a, b) => a - b), t * TOPK);
    }
    return { ids: gpu.fromArray('i32', [T, TOPK], ids), used: new Set(ids).size };
  });
  const weights = gpu.fromArray('f32', [T, TOPK], Float32Array.from({ length: T * TOPK }, () => 0.1 + rng.uniform() * 0.3));
  const xs = gpu.fromArray('bf16', [T, H], randomBf16(T * H));
  const guV = gpu.empty('bf16', [T * TOPK, 2 * w.inter]);
  const actV = gpu.empty('bf16', [T * TOPK, w.inter]);
  const outV = gpu.empty('bf16', [T, H]);
  const verifyStep = (r: number) => {
    const { ids } = sets[r % sets.length];
    if (fused) {
      gpu.native.moeGemm({ x: xs, qw: w.guQ, sc: w.guS, ids, y: actV, mode: 'gather', epilogue: 'siluMul', minWarpSteps });
    } else {
      gpu.native.moeGemm({ x: xs, qw: w.guQ, sc: w.guS, ids, y: guV, mode: 'gather', minWarpSteps });
      gpu.native.siluMul({ x: guV, out: actV });
    }
    gpu.native.moeGemm({ x: actV, qw: w.dnQ, sc: w.dnS, ids, weights, y: outV, mode: 'sum', minWarpSteps });
  };
  const ms = timeLaunches(gpu, verifyStep, 4);
  const used = sets.reduce((n, s) => n + s.used, 0) / sets.length;
  const bytes = (used * w.bytes) / TOPK;
  const gbs = bytes / (ms * 1e-3) / 1e9;
  log(`MoE ${step} (${label}${T} tokens, top-${TOPK}: ${used.toFixed(0)} of ${E} experts used, I ${w.inter}${fused ? ', SiLU in the gate_up epilogue' : ''}): ${(ms * 1e3).toFixed(1)} us, ${(bytes / 1e6).toFixed(0)} MB of expert weights, ${gbs.toFixed(0)} GB/s = ${((gbs / copyGBs) * 100).toFixed(0)}% of copy`);
  gpu.free(...sets.map((s) => s.ids), weights, xs, guV, actV, outV);
  return { tokens: T, us: ms * 1e3, intermediate: w.inter, minWarpSteps, siluEpilogue: fused, expertsUsed: used, bytes, gbs, fractionOfCopy: gbs / copyGBs };
};
// Tokens of a verify forward in the tree-size sweep: the root + a budget of 0 (decode) to 128 nodes.
const TREE_TOKENS = [1, 9, 17, 33, 65, 129];
if (runs('gemm')) {
  const full = moeWeights(I);
  // builds from before the SiLU epilogue (an A/B against them) skip its rows: they ignore the
  // `epilogue` argument, so a name no build knows passes there and throws here
  const probe = { x: gpu.zeros('bf16', [1, 128]), qw: gpu.zeros('i32', [1, 1, 256]), sc: gpu.zeros('bf16', [1, 1, 64]), y: gpu.empty('bf16', [1, 16]) };
  const siluEpilogue = !attempt(() => gpu.native.w4a16Gemm({ ...probe, epilogue: 'none of these' as never }));
  gpu.free(probe.x, probe.qw, probe.sc, probe.y);
  report.moe = moeDecode(full, 'Kimi K2');
  if (siluEpilogue) report.moeFused = moeDecode(full, 'Kimi K2', 0, true);
  report.moeVerify = moeVerify(full, '');
  // several sequences decoding together (no tree): 2-4 tokens, whose <= 32 pairs the GEMM routes itself
  report.moeBatch = [2, 4].map((T) => moeVerify(full, '', 0, T, false, 'decode step of a batch'));
  if (siluEpilogue) report.moeVerifyFused = moeVerify(full, '', 0, 65, true);
  full.free();
  const rank = moeWeights(I / 8);
  report.moeRank = moeDecode(rank, 'one tensor-parallel rank of 8');
  report.moeVerifyRank = moeVerify(rank, 'one tensor-parallel rank of 8: ');
  if (siluEpilogue) report.moeRankFused = moeDecode(rank, 'one tensor-parallel rank of 8', 0, true);
  if (siluEpilogue) report.moeVerifyRankFused = moeVerify(rank, 'one tensor-parallel rank of 8: ', 0, 65, true);
  // the same with longer warp ranges (16 steps): what an engine that mostly verifies would choose
  report.moeRankLongRanges = moeDecode(rank, 'one rank, minWarpSteps 16', 16);
  report.moeVerifyRankLongRanges = moeVerify(rank, 'one rank, minWarpSteps 16: ', 16);
  // the rank's MoE layer at every tree size of the verify-cost table (section 5); 65 tokens is the
  // verify step above
  report.moeRankByTokens = TREE_TOKENS.map((T) => (T === 65 ? report.moeVerifyRank : moeVerify(rank, 'one rank, tree sweep: ', 0, T)));
  rank.free();
}

if (runs('attention')) {
  // 4. MLA attention of one tensor-parallel rank (8 of Kimi K2's 64 heads) over a 4096-slot latent
  // cache in f32 and in bf16 (the same values): decode (T = 1), tree verifies of 9-129 nodes (the
  // ancestor mask of a binary tree) and a 512-token causal prefill. The floor reads the cache and
  // kv_b once at the copy bandwidth.
  const ATT = { H: 8, NOPE: 128, ROPE: 64, V: 128, R: 512, S: 4096 };
  const kvB = gpu.fromArray('bf16', [ATT.H * (ATT.NOPE + ATT.V), ATT.R], randomBf16(ATT.H * (ATT.NOPE + ATT.V) * ATT.R));
  const cacheValues = {
    c: bf16ArrayToF32(randomBf16((ATT.S + 512) * ATT.R)),
    kpe: bf16ArrayToF32(randomBf16((ATT.S + 512) * ATT.ROPE)),
  };
  const caches = {
    f32: { c: gpu.fromArray('f32', [ATT.S + 512, ATT.R], cacheValues.c), kpe: gpu.fromArray('f32', [ATT.S + 512, ATT.ROPE], cacheValues.kpe) },
    bf16: { c: gpu.fromArray('bf16', [ATT.S + 512, ATT.R], f32ArrayToBf16(cacheValues.c)), kpe: gpu.fromArray('bf16', [ATT.S + 512, ATT.ROPE], f32ArrayToBf16(cacheValues.kpe)) },
  };
  const attRows: string[][] = [];
  const attReport: unknown[] = [];
  const attCases: [string, number, 'f32' | 'bf16'][] = [];
  for (const cache of ['f32', 'bf16'] as const) {
    attCases.push(['decode', 1, cache], ...TREE_TOKENS.slice(1).map((T): [string, number, 'f32' | 'bf16'] => ['tree verify', T, cache]), ['prefill', 512, cache]);
  }
  for (const [label, T, cache] of attCases) {
    const base = label === 'prefill' ? 0 : ATT.S;
    const qNope = gpu.fromArray('f32', [T, ATT.H, ATT.NOPE], Float32Array.from({ length: T * ATT.H * ATT.NOPE }, () => rng.normal()));
    const qPe = gpu.fromArray('f32', [T, ATT.H, ATT.ROPE], Float32Array.from({ length: T * ATT.H * ATT.ROPE }, () => rng.normal()));
    const out = gpu.empty('f32', [T, ATT.H, ATT.V]);
    const mask = label === 'tree verify' ? gpu.fromArray('u8', [T, T], treeMask(T)) : undefined;
    const call = () => gpu.native.mlaAttention({ qNope, qPe, kvB, cacheC: caches[cache].c, cacheKpe: caches[cache].kpe, mask, out, base, scale: 1 / Math.sqrt(ATT.NOPE + ATT.ROPE) });
    // an A/B build from before bf16 caches rejects them: its rows are left out
    const supported = cache === 'f32' || attempt(call);
    if (supported) {
      const ms = timeLaunches(gpu, call, 10);
      const keys = base + T;
      const bytes = keys * (ATT.R + ATT.ROPE) * (cache === 'f32' ? 4 : 2) + ATT.H * (ATT.NOPE + ATT.V) * ATT.R * 2;
      const floorUs = (bytes / (copyGBs * 1e9)) * 1e6;
      attRows.push([label, String(T), String(keys), cache, (ms * 1e3).toFixed(1), floorUs.toFixed(1), `${((floorUs / (ms * 1e3)) * 100).toFixed(0)}%`]);
      attReport.push({ label, T, keys, cache, us: ms * 1e3, floorUs });
    }
    gpu.free(qNope, qPe, out, ...(mask ? [mask] : []));
  }
  gpu.free(caches.f32.c, caches.f32.kpe, caches.bf16.c, caches.bf16.kpe);
  report.attention = attReport;
  log('');
  log(table(['MLA attention (8 heads)', 'T', 'keys', 'cache', 'us', 'floor us', 'of floor'], attRows));

  // The committed slots read on the device (baseOnDevice): what a graph captured at a bound pays
  // for the chunks past the committed length (blocks that find no keys and return), against the
  // same call given the committed length by the host. bf16 cache, 4096 committed slots. Builds
  // without device scalars (no arange) would ignore baseOnDevice: left out.
  if (typeof (gpu.native as { arange?: unknown }).arange === 'function') {
    const committed = 4096;
    const bounds = [4096, 8192, 32768];
    const slots = bounds[bounds.length - 1] + 512;
    const c = gpu.fromArray('bf16', [slots, ATT.R], randomBf16(slots * ATT.R));
    const kpe = gpu.fromArray('bf16', [slots, ATT.ROPE], randomBf16(slots * ATT.ROPE));
    const baseOnDevice = gpu.fromArray('i32', [1], Int32Array.of(committed));
    const devRows: string[][] = [];
    const devReport: unknown[] = [];
    for (const T of [1, 17]) {
      const qNope = gpu.fromArray('f32', [T, ATT.H, ATT.NOPE], Float32Array.from({ length: T * ATT.H * ATT.NOPE }, () => rng.normal()));
      const qPe = gpu.fromArray('f32', [T, ATT.H, ATT.ROPE], Float32Array.from({ length: T * ATT.H * ATT.ROPE }, () => rng.normal()));
      const out = gpu.empty('f32', [T, ATT.H, ATT.V]);
      const mask = T > 1 ? gpu.fromArray('u8', [T, T], treeMask(T)) : undefined;
      const args = { qNope, qPe, kvB, cacheC: c, cacheKpe: kpe, mask, out, scale: 1 / Math.sqrt(ATT.NOPE + ATT.ROPE) };
      const hostUs = timeLaunches(gpu, () => gpu.native.mlaAttention({ ...args, base: committed }), 10) * 1e3;
      const row = (bound: string, us: number) => {
        devRows.push([T === 1 ? 'decode' : `tree verify`, String(T), bound, us.toFixed(1), `${((us / hostUs - 1) * 100).toFixed(0)}%`]);
        devReport.push({ T, committed, bound, us });
      };
      row('host base', hostUs);
      for (const bound of bounds) row(String(bound), timeLaunches(gpu, () => gpu.native.mlaAttention({ ...args, base: bound, baseOnDevice }), 10) * 1e3);
      gpu.free(qNope, qPe, out, ...(mask ? [mask] : []));
    }
    gpu.free(c, kpe, baseOnDevice);
    report.attentionDeviceBase = devReport;
    log('');
    log(table([`MLA, ${committed} committed slots on the device (bf16 cache)`, 'T', 'bound', 'us', 'vs host base'], devRows));
  }
  gpu.free(kvB);

  // 5. What a verify forward of T tokens (a DDTree budget of T - 1) costs one rank's MoE layer
  // (routed experts) and its attention, against a decode step: a tree pays off only when a verify
  // emits more tokens than this ratio (before the drafter and the layers' other GEMMs).
  const moeByT = (report.moeRankByTokens ?? []) as { tokens: number; us: number; expertsUsed: number }[];
  const attUs = (T: number, cache = 'f32') =>
    (attReport as { T: number; us: number; label: string; cache: string }[]).find((r) => r.T === T && r.label !== 'prefill' && r.cache === cache)?.us ?? NaN;
  const stepUs = (i: number, cache = 'f32') => moeByT[i].us + attUs(TREE_TOKENS[i], cache);
  if (moeByT.length > 0) {
    const costRows = TREE_TOKENS.map((T, i) => [
      String(T - 1),
      String(T),
      moeByT[i].expertsUsed.toFixed(0),
      moeByT[i].us.toFixed(1),
      attUs(T).toFixed(1),
      stepUs(i).toFixed(1),
      (stepUs(i) / stepUs(0)).toFixed(2),
      attUs(T, 'bf16').toFixed(1),
      (stepUs(i, 'bf16') / stepUs(0, 'bf16')).toFixed(2),
    ]);
    report.verifyCost = TREE_TOKENS.map((T, i) => ({
      budget: T - 1,
      tokens: T,
      expertsUsed: moeByT[i].expertsUsed,
      moeUs: moeByT[i].us,
      attentionUs: attUs(T),
      us: stepUs(i),
      ofDecode: stepUs(i) / stepUs(0),
      attentionBf16CacheUs: attUs(T, 'bf16'),
      ofDecodeBf16Cache: stepUs(i, 'bf16') / stepUs(0, 'bf16'),
    }));
    log('');
    log(table(['tree budget', 'tokens', 'experts used', 'MoE us (one rank)', 'MLA us', 'layer us', 'x decode', 'MLA us (bf16 cache)', 'x decode (bf16 cache)'], costRows));
  }

  // 6. DDTree build + accept on a Kimi K2 vocabulary
  const V = 163840;
  const DEPTH = 8;
  const draft = gpu.fromArray('f32', [DEPTH, V], Float32Array.from({ length: DEPTH * V }, () => 3 * rng.normal()));
  const ddRows: string[][] = [];
  const ddReport: unknown[] = [];
  for (const budget of [64, 128, 256, 512]) {
    const nodes = budget + 1;
    const t = treeOutputs(gpu, nodes);
    const argmax = gpu.fromArray('i32', [nodes], Int32Array.from({ length: nodes }, () => Math.floor(rng.uniform() * V)));
    const path = gpu.empty('i32', [nodes]);
    const pathLen = gpu.empty('i32', [1]);
    const bonus = gpu.empty('i32', [1]);
    const build = () => gpu.native.ddtreeBuild({ draftLogits: draft, root: 1, budget, start: 1000, ...t });
    const accept = () => gpu.native.ddtreeAccept({ tokens: t.tokens, parents: t.parents, size: t.size, targetArgmax: argmax, path, pathLen, bonus });
    const buildMs = timeLaunches(gpu, build, 10);
    const acceptMs = timeLaunches(gpu, accept, 10);
    if (budget === 64) {
      // what a launch costs the host (argument parsing, validation, the CUDA launch): the floor per
      // kernel when the host launches one at a time instead of replaying a captured graph
      gpu.synchronize();
      const t0 = performance.now();
      for (let i = 0; i < 1000; i++) accept();
      const hostUs = (performance.now() - t0);
      gpu.synchronize();
      log(`host cost of one native call (ddtreeAccept, 7 tensors): ${hostUs.toFixed(1)} us`);
      report.hostCallUs = hostUs;
    }
    ddRows.push([String(budget), String(DEPTH), (buildMs * 1e3).toFixed(1), (acceptMs * 1e3).toFixed(1), ((buildMs + acceptMs) * 1e3).toFixed(1)]);
    ddReport.push({ budget, depth: DEPTH, buildUs: buildMs * 1e3, acceptUs: acceptMs * 1e3 });
    gpu.free(...Object.values(t), argmax, path, pathLen, bonus);
  }
  gpu.free(draft);
  report.ddtree = ddReport;
  log('');
  log(table(['budget', 'depth', 'build us', 'accept us', 'total us'], ddRows));

}

// 7. The one-launch DDTree builds of a DFlash block of 8 (7 draft depths) against the argmax that
// drafts a chain of the same depths from the same logits: what a DDTree step pays over a chain
// step of equal nodes before its verify. The demo's walk target has 8192 tokens (the cluster
// build), Kimi K2 163840 (the fused build).
if (runs('ddtree')) {
  const DEPTH = 7;
  const rows: string[][] = [];
  const smallReport: unknown[] = [];
  // a DFlash drafter's rows (N(0, 3) logits), and an ngram drafter's: every unseen token at -1e4,
  // two continuations a depth (almost every value ties at the cluster build's threshold)
  const ngramRows = (V: number) => {
    const rows = new Float32Array(DEPTH * V).fill(-1e4);
    for (let d = 0; d < DEPTH; d++) for (const [token, logit] of [[17 + 31 * d, Math.log(0.75)], [4000 + d, Math.log(0.25)]]) rows[d * V + token] = logit;
    return rows;
  };
  for (const [V, drafter] of [[8192, 'dflash'], [163840, 'dflash'], [8192, 'ngram']] as const) {
    const draft = gpu.fromArray('f32', [DEPTH, V], drafter === 'ngram' ? ngramRows(V) : Float32Array.from({ length: DEPTH * V }, () => 3 * rng.normal()));
    const top1 = gpu.empty('i32', [DEPTH]);
    const argmaxUs = timeLaunches(gpu, () => gpu.native.argmax({ x: draft, out: top1 })) * 1e3;
    for (const budget of [1, 3, 7, 16, 32]) {
      const nodes = budget + 1;
      const t = treeOutputs(gpu, nodes);
      const buildUs = timeLaunches(gpu, () => gpu.native.ddtreeBuild({ draftLogits: draft, root: 1, budget, start: 1000, ...t })) * 1e3;
      const form = gpu.native.lastForm() ?? '?';
      rows.push([drafter, String(V), String(budget), form, buildUs.toFixed(2), argmaxUs.toFixed(2), (buildUs - argmaxUs).toFixed(2)]);
      smallReport.push({ drafter, vocab: V, depth: DEPTH, budget, form, buildUs, argmaxUs });
      gpu.free(...Object.values(t));
    }
    gpu.free(draft, top1);
  }
  report.ddtreeOneLaunch = smallReport;
  log('');
  log(table(['rows', 'vocabulary', 'budget', 'build', 'build us', 'argmax us (chain)', 'difference us'], rows));
}

// The small ops of a Kimi K2 decode step at their sizes (one token; attention heads and the cache of
// one tensor-parallel rank), against the floor of the same chain: an add of 4 floats. Each is a
// launch or two of little work, so the floor is most of them; what is above it is the op.
if (runs('small')) {
  const V = 163840;
  const H = 7168;
  const floorArgs = { a: gpu.zeros('f32', [1, 4]), b: gpu.zeros('f32', [1, 4]), out: gpu.empty('f32', [1, 4]) };
  const table_ = gpu.zeros('bf16', [V, H]);
  const x = gpu.fromArray('f32', [1, H], Float32Array.from({ length: H }, () => rng.normal()));
  const t = {
    ids: gpu.fromArray('i32', [1], Int32Array.from([12345])),
    embedded: gpu.empty('f32', [1, H]),
    norm: gpu.fromArray('bf16', [H], randomBf16(H)),
    normed: gpu.empty('f32', [1, H]),
    q: gpu.zeros('f32', [1, 8, 192]),
    positions: gpu.fromArray('i32', [1], Int32Array.from([4000])),
    invFreq: gpu.fromArray('f64', [32], Float64Array.from({ length: 32 }, (_, i) => 50000 ** (-i / 32))),
    routerLogits: gpu.fromArray('f32', [1, 384], Float32Array.from({ length: 384 }, () => rng.normal())),
    routerBias: gpu.zeros('f32', [384]),
    routerIds: gpu.empty('i32', [1, 8]),
    routerWeights: gpu.empty('f32', [1, 8]),
    logits: gpu.fromArray('f32', [1, V], Float32Array.from({ length: V }, () => rng.normal())),
    argmax: gpu.empty('i32', [1]),
    topValues: gpu.empty('f32', [1, 8]),
    topIds: gpu.empty('i32', [1, 8]),
    draft: gpu.fromArray('f32', [8, V], Float32Array.from({ length: 8 * V }, () => rng.normal())),
    draftValues: gpu.empty('f32', [8, 64]),
    draftIds: gpu.empty('i32', [8, 64]),
    gateUp: gpu.fromArray('bf16', [8, 512], randomBf16(8 * 512)),
    act: gpu.empty('bf16', [8, 256]),
    sum: gpu.empty('f32', [1, H]),
    c: gpu.zeros('f32', [1, 512]),
    kpe: gpu.zeros('f32', [1, 64]),
    cacheC: gpu.zeros('bf16', [4096, 512]),
    cacheKpe: gpu.zeros('bf16', [4096, 64]),
    slots: gpu.fromArray('i32', [1], Int32Array.from([4000])),
  };
  const ops: [string, string, () => void][] = [
    ['embedding', `bf16 table [${V}, ${H}] -> [1, ${H}]`, () => gpu.native.embedding({ table: table_, ids: t.ids, out: t.embedded })],
    ['rmsNorm', `[1, ${H}]`, () => gpu.native.rmsNorm({ x, weight: t.norm, out: t.normed, eps: 1e-6 })],
    ['rope', '8 heads x 64 rope dims (YaRN)', () => gpu.native.rope({ x: t.q, positions: t.positions, invFreq: t.invFreq, offset: 128, attentionFactor: 1.1 })],
    ['router', '384 experts, top-8', () => gpu.native.router({ logits: t.routerLogits, bias: t.routerBias, ids: t.routerIds, weights: t.routerWeights, topk: 8, scaling: 2.827 })],
    ['siluMul', '8 experts x I 256, bf16', () => gpu.native.siluMul({ x: t.gateUp, out: t.act })],
    ['add', `[1, ${H}]`, () => gpu.native.add({ a: x, b: t.normed, out: t.sum })],
    ['add, then rmsNorm', `[1, ${H}], two launches`, () => {
      gpu.native.add({ a: x, b: t.embedded, out: t.sum });
      gpu.native.rmsNorm({ x: t.sum, weight: t.norm, out: t.normed, eps: 1e-6 });
    }],
    ['rmsNorm with the residual add', `[1, ${H}], fused`, () => gpu.native.rmsNorm({ x, residual: t.embedded, sum: t.sum, weight: t.norm, out: t.normed, eps: 1e-6 })],
    ['kvWrite', 'rank 512 + rope 64 into a bf16 cache', () => gpu.native.kvWrite({ c: t.c, kpe: t.kpe, cacheC: t.cacheC, cacheKpe: t.cacheKpe, slots: t.slots })],
    ['argmax', `[1, ${V}]`, () => gpu.native.argmax({ x: t.logits, out: t.argmax })],
    ['topk', `[1, ${V}], k 8`, () => gpu.native.topk({ x: t.logits, values: t.topValues, ids: t.topIds, k: 8 })],
    ['topk', `[8, ${V}], k 64 (a DDTree draft, B = 64)`, () => gpu.native.topk({ x: t.draft, values: t.draftValues, ids: t.draftIds, k: 64 })],
  ];
  const floorUs = timeLaunches(gpu, () => gpu.native.add(floorArgs), 50) * 1e3;
  const smallRows: string[][] = [['add of 4 floats (the floor)', '[1, 4]', floorUs.toFixed(2), '-']];
  const smallReport: unknown[] = [{ op: 'floor', shape: '[1, 4]', us: floorUs }];
  for (const [op, shape, call] of ops) {
    const us = timeLaunches(gpu, call, 50) * 1e3;
    smallRows.push([op, shape, us.toFixed(2), (us - floorUs).toFixed(2)]);
    smallReport.push({ op, shape, us });
  }
  gpu.free(...Object.values(floorArgs), table_, x, ...Object.values(t));
  report.smallOps = smallReport;
  log('');
  log('small ops of a Kimi K2 decode step (one token; one rank\'s heads and cache), device us per call:');
  log(table(['op', 'shape', 'us', 'us over the floor'], smallRows));
}

if (process.env.OUT) {
  mkdirSync(process.env.OUT, { recursive: true }); // a hand run may name a directory run.sh has not made
  writeFileSync(join(process.env.OUT, 'bench.json'), `${JSON.stringify(report, null, 1)}\n`);
  writeFileSync(join(process.env.OUT, 'bench.txt'), `${lines.join('\n')}\n`);
}
