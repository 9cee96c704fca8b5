/**
 * Launches each hot kernel a few times at the Kimi K2 decode shapes, for Nsight Compute
 * (`ncu` on the GPU host; .gpu/run.sh profile), which times every kernel on its own with cold
 * caches; and measures the host cost of a native call (wall clock per call, queue not drained).
 * KDTREE_PROFILE_ONLY=gemm|prefill|float|moe|moe-verify|mla|ddtree runs one section.
 */
import { createBackend, type DeviceTensor } from '../../packages/cuda/src/backend.js';
import { packedW4A16Shapes } from '../../packages/cuda/src/w4a16-layout.js';
import { treeMask } from './tree-mask.js';
import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const gpu = createBackend({ backend: 'cuda', searchPaths: [here], onlySearchPaths: true });
const fillPattern = (t: DeviceTensor, byte: number) => gpu.native.fill(t.buffer, byte);
const only = process.env.KDTREE_PROFILE_ONLY;
const want = (section: string) => !only || only === section;

/** W4A16 launches at each M of `ms` on one N x K matrix (group 32, byte-pattern weights and x). */
function w4a16Launches(n: number, k: number, ms: number[]): void {
  const shapes = packedW4A16Shapes(n, k, 32);
  const qw = gpu.empty('i32', shapes.qw);
  const sc = gpu.empty('bf16', shapes.sc);
  fillPattern(qw, 0x5a);
  fillPattern(sc, 0x3c);
  const mMax = Math.max(...ms);
  const x = gpu.empty('bf16', [mMax, k]);
  fillPattern(x, 0x3c);
  const y = gpu.empty('bf16', [mMax, n]);
  for (const m of ms) gpu.native.w4a16Gemm({ x: { ...x, shape: [m, k] }, qw, sc, y: { ...y, shape: [m, n] }, group: 32 });
  gpu.free(qw, sc, x, y);
}
// W4A16 at M = 1 and 16 on the expert shapes and both dense ones (the 16-token launches of the
// dense shapes are the 4th and 6th W4A16Kernel launches: `ncu --kernel-name regex:W4A16Kernel
// --launch-skip 3 --launch-count 1`, or --launch-skip 5)
for (const [n, k] of want('gemm') ? [[4096, 7168], [18432, 7168], [7168, 18432], [7168, 2048]] : []) w4a16Launches(n, k, [1, 16]);
// W4A16 at a 2048-token prefill on the dense shape and an expert shape (the prefill kernel)
for (const [n, k] of want('prefill') ? [[18432, 7168], [4096, 7168]] : []) w4a16Launches(n, k, [2048]);

// gemm (bf16 weights as stored) at 1, 16, 64 and 512 tokens on q_a_proj, kv_a_proj_with_mqa and
// one rank's lm_head share (at 512 tokens the wgmma form on all three: lm_head's is the third
// GemmWgmmaKernel launch, `ncu --kernel-name regex:GemmWgmmaKernel --launch-skip 2 --launch-count 1`)
for (const [n, k] of want('float') ? [[1536, 7168], [576, 7168], [20480, 7168]] : []) {
  const w = gpu.empty('bf16', [n, k]);
  fillPattern(w, 0x3c);
  const x = gpu.empty('bf16', [512, k]);
  fillPattern(x, 0x3c);
  const y = gpu.empty('bf16', [512, n]);
  for (const m of [1, 16, 64, 512]) gpu.native.gemm({ x: { ...x, shape: [m, k] }, w, y: { ...y, shape: [m, n] } });
  gpu.free(w, x, y);
}

// Kimi K2 MoE decode step (384 experts, top-8, H 7168): sort + gate_up, SiLU, sort + down + sum;
// the whole experts (I 2048), then one tensor-parallel rank's share (I 256)
for (const I of want('moe') ? [2048, 256] : []) {
  const [E, TOPK, H] = [384, 8, 7168];
  const gu = packedW4A16Shapes(2 * I, H, 32, E);
  const dn = packedW4A16Shapes(H, I, 32, E);
  const w = [gpu.empty('i32', gu.qw), gpu.empty('bf16', gu.sc), gpu.empty('i32', dn.qw), gpu.empty('bf16', dn.sc)];
  for (const t of w) fillPattern(t, 0x3c);
  const ids = gpu.fromArray('i32', [1, TOPK], Int32Array.from({ length: TOPK }, (_, j) => 7 + 45 * j));
  const weights = gpu.fromArray('f32', [1, TOPK], new Float32Array(TOPK).fill(0.125));
  const x = gpu.empty('bf16', [1, H]);
  fillPattern(x, 0x3c);
  const guOut = gpu.empty('bf16', [TOPK, 2 * I]);
  const act = gpu.empty('bf16', [TOPK, I]);
  const out = gpu.empty('bf16', [1, H]);
  gpu.native.moeGemm({ x, qw: w[0], sc: w[1], ids, y: guOut, mode: 'gather' });
  gpu.native.siluMul({ x: guOut, out: act });
  gpu.native.moeGemm({ x: act, qw: w[2], sc: w[3], ids, weights, y: out, mode: 'sum' });
  gpu.free(...w, ids, weights, x, guOut, act, out);
}

// One tensor-parallel rank's MoE layer at a 65-token DDTree verify (top-8 of 384, I 256): sort +
// gate_up, SiLU, sort + down + sum
if (want('moe-verify')) {
  const [E, TOPK, H, I, T] = [384, 8, 7168, 256, 65];
  const gu = packedW4A16Shapes(2 * I, H, 32, E);
  const dn = packedW4A16Shapes(H, I, 32, E);
  const w = [gpu.empty('i32', gu.qw), gpu.empty('bf16', gu.sc), gpu.empty('i32', dn.qw), gpu.empty('bf16', dn.sc)];
  for (const t of w) fillPattern(t, 0x3c);
  const ids = gpu.fromArray('i32', [T, TOPK], Int32Array.from({ length: T * TOPK }, (_, i) => (Math.floor(i / TOPK) * 53 + (i % TOPK) * 47) % E));
  const weights = gpu.fromArray('f32', [T, TOPK], new Float32Array(T * TOPK).fill(0.125));
  const x = gpu.empty('bf16', [T, H]);
  fillPattern(x, 0x3c);
  const guOut = gpu.empty('bf16', [T * TOPK, 2 * I]);
  const act = gpu.empty('bf16', [T * TOPK, I]);
  const out = gpu.empty('bf16', [T, H]);
  gpu.native.moeGemm({ x, qw: w[0], sc: w[1], ids, y: guOut, mode: 'gather' });
  gpu.native.siluMul({ x: guOut, out: act });
  gpu.native.moeGemm({ x: act, qw: w[2], sc: w[3], ids, weights, y: out, mode: 'sum' });
  gpu.free(...w, ids, weights, x, guOut, act, out);
}

// MLA attention, 8 heads, 4096 committed keys: decode, and a 65-node tree verify (binary-ish tree);
// then a 512-token causal prefill from an empty cache; over an f32 and a bf16 cache
if (want('mla')) for (const cache of ['f32', 'bf16'] as const) {
  const S = 4096 + 65;
  const kvB = gpu.empty('bf16', [8 * 256, 512]);
  const cacheC = gpu.empty(cache, [S, 512]);
  const cacheKpe = gpu.empty(cache, [S, 64]);
  for (const t of [kvB, cacheC, cacheKpe]) fillPattern(t, 0x3c);
  for (const T of [1, 65, 512]) {
    const qNope = gpu.empty('f32', [T, 8, 128]);
    const qPe = gpu.empty('f32', [T, 8, 64]);
    for (const t of [qNope, qPe]) fillPattern(t, 0x3c);
    const out = gpu.empty('f32', [T, 8, 128]);
    const mask = T === 65 ? gpu.fromArray('u8', [T, T], treeMask(T)) : undefined;
    gpu.native.mlaAttention({ qNope, qPe, kvB, cacheC, cacheKpe, mask, out, base: T === 512 ? 0 : 4096, scale: 0.07 });
    gpu.free(qNope, qPe, out, ...(mask ? [mask] : []));
  }
  gpu.free(kvB, cacheC, cacheKpe);
}

// DDTree build (B = 64, depth 8, V 163840) and accept
if (want('ddtree')) {
  const V = 163840;
  const nodes = 65;
  const draft = gpu.fromArray('f32', [8, V], Float32Array.from({ length: 8 * V }, (_, i) => Math.sin(i * 12.9898) * 3));
  const t = { tokens: gpu.empty('i32', [nodes]), parents: gpu.empty('i32', [nodes]), depths: gpu.empty('i32', [nodes]), positions: gpu.empty('i32', [nodes]), mask: gpu.empty('u8', [nodes, nodes]), size: gpu.empty('i32', [1]) };
  gpu.native.ddtreeBuild({ draftLogits: draft, root: 1, budget: 64, start: 0, ...t });
  const argmax = gpu.fromArray('i32', [nodes], new Int32Array(nodes));
  const path = gpu.empty('i32', [nodes]);
  const pathLen = gpu.empty('i32', [1]);
  const bonus = gpu.empty('i32', [1]);
  const accept = () => gpu.native.ddtreeAccept({ tokens: t.tokens, parents: t.parents, size: t.size, targetArgmax: argmax, path, pathLen, bonus });
  accept();
  gpu.synchronize();
  if (!process.env.KDTREE_PROFILE_SKIP_HOST) {
    // host cost per native call: launches queue faster than a tiny kernel runs only if this is small
    const calls = 2000;
    const t0 = performance.now();
    for (let i = 0; i < calls; i++) accept();
    const host = (performance.now() - t0) / calls;
    gpu.synchronize();
    const gpuMs = gpu.time(() => { for (let i = 0; i < calls; i++) accept(); }) / calls;
    console.log(`host cost per ddtreeAccept call: ${(host * 1e3).toFixed(1)} us; event-timed per call: ${(gpuMs * 1e3).toFixed(1)} us`);
  }
  gpu.free(draft, ...Object.values(t), argmax, path, pathLen, bonus);
}
