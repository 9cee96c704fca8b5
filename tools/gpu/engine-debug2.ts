import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend } from '@kdtree/cuda';
import { f32ArrayToBf16, bf16ArrayToF32 } from '@kdtree/format';

const here = dirname(fileURLToPath(import.meta.url));
const b = createBackend({ backend: (process.env.DBG_BACKEND ?? 'cuda') as 'cuda', searchPaths: [here], onlySearchPaths: true });
const cs = b.native.createStream();
function rnd(n: number, seed: number) { let x = seed; return Float32Array.from({ length: n }, () => { x = (Math.imul(x, 1103515245) + 12345) >>> 0; return x / 2 ** 32 - 0.5; }); }
for (const [M, N, K, xd] of [[1, 32, 64, 'f32'], [1, 32, 64, 'bf16'], [1, 96, 448, 'f32'], [1, 1536, 7168, 'f32'], [3, 37, 2056, 'f32'], [1, 37, 2056, 'bf16']] as [number, number, number, 'f32' | 'bf16'][]) {
  const wv = bf16ArrayToF32(f32ArrayToBf16(rnd(N * K, 5)));
  const w = b.fromArray('bf16', [N, K], f32ArrayToBf16(wv));
  const xv = rnd(M * K, 9);
  const x0 = xd === 'f32' ? b.fromArray('f32', [M, K], xv) : b.fromArray('bf16', [M, K], f32ArrayToBf16(xv));
  const x = b.empty(xd, [M, K]);
  const normW = b.fromArray('f32', [K], new Float32Array(K).fill(1));
  const yD = b.zeros('f32', [M, N]);
  const yG = b.zeros('f32', [M, N]);
  const yG2 = b.zeros('f32', [M, N]);
  // direct: copy x0 -> x, gemm
  b.native.copy({ dst: x.buffer, src: x0.buffer, stream: 0 });
  b.native.gemm({ x, w, y: yD, stream: 0 });
  // graph 1: gemm alone, x already there
  const g1 = b.capture(cs, () => b.native.gemm({ x, w, y: yG, stream: cs }));
  b.native.launchGraph(g1, cs); b.native.synchronize(cs);
  // graph 2: a kernel writing x just before (rmsNorm for f32; copy for bf16), then gemm
  b.native.fill(x.buffer, 0);
  const g2 = b.capture(cs, () => {
    if (xd === 'f32') { b.native.copy({ dst: x.buffer, src: x0.buffer, stream: cs }); b.native.rmsNorm({ x: x0, weight: normW, out: x, eps: 1e30, stream: cs }); b.native.add({ a: x0, b: x0, out: x, stream: cs }); b.native.add({ a: x, b: x0, out: x, stream: cs }); }
    else b.native.copy({ dst: x.buffer, src: x0.buffer, stream: cs });
    b.native.gemm({ x, w, y: yG2, stream: cs });
  });
  b.native.launchGraph(g2, cs); b.native.synchronize(cs);
  const d = b.toArray(yD) as Float32Array, g = b.toArray(yG) as Float32Array, g2a = b.toArray(yG2) as Float32Array;
  const ref = new Float32Array(M * N);
  for (let m = 0; m < M; m++) for (let n = 0; n < N; n++) { let s = 0; for (let k = 0; k < K; k++) s += xv[m * K + k] * wv[n * K + k]; ref[m * N + n] = s; }
  const mx = (a: Float32Array, c: Float32Array) => Math.max(...a.map((v, i) => Math.abs(v - c[i])));
  const scale = xd === 'f32' ? 3 : 1; // graph 2 computes x = 3 x0 for f32
  console.log(`M ${M} N ${N} K ${K} x ${xd}: |direct-ref| ${mx(d, ref).toExponential(2)}  |graph-direct| ${mx(g, d).toExponential(2)}  |graph2/${scale}-direct| ${mx(g2a.map((v) => v / scale), d).toExponential(2)}  direct[0..3] ${Array.from(d.slice(0, 3), (v) => v.toFixed(4))} graph[0..3] ${Array.from(g.slice(0, 3), (v) => v.toFixed(4))} graph2[0..3] ${Array.from(g2a.slice(0, 3), (v) => (v / scale).toFixed(4))}`);
  b.native.freeGraph(g1); b.native.freeGraph(g2);
  b.free(w, x0, x, normW, yD, yG, yG2);
}
{
  // the engine's first four ops of a decode step, as it queues them (views of 64-row buffers)
  const [V, H, R] = [128, 64, 32];
  const view = (t: any, shape: number[]) => ({ buffer: t.buffer, dtype: t.dtype, shape, offset: 0 });
  const table = b.fromArray('bf16', [V, H], f32ArrayToBf16(rnd(V * H, 3)));
  const norm = b.fromArray('f32', [H], new Float32Array(H).fill(1.1));
  const w = b.fromArray('bf16', [R, H], f32ArrayToBf16(rnd(R * H, 4)));
  const token = b.fromArray('i32', [1], Int32Array.of(95));
  const L = b.fromArray('i32', [1], Int32Array.of(8));
  const pos = b.zeros('i32', [64]);
  const xb = b.zeros('f32', [64, H]), hb = b.zeros('f32', [64, H]), qb = b.zeros('f32', [64, R]);
  const queue = (s: number) => {
    b.native.arange({ out: view(pos, [1]), startOnDevice: L, stream: s });
    b.native.embedding({ table, ids: token, out: view(xb, [1, H]), stream: s });
    b.native.rmsNorm({ x: view(xb, [1, H]), weight: norm, out: view(hb, [1, H]), eps: 1e-5, stream: s });
    b.native.gemm({ x: view(hb, [1, H]), w, y: view(qb, [1, R]), stream: s });
  };
  queue(0); b.synchronize();
  const d = (b.toArray(qb) as Float32Array).slice(0, R);
  const mx = (a: Float32Array, c: Float32Array) => Math.max(...a.map((v, i) => Math.abs(v - c[i])));
  const trial = (label: string, queueFn: (s: number) => void, launchOn: 'cs' | '0') => {
    let bad = 0;
    const g = b.capture(cs, () => queueFn(cs));
    for (let t = 0; t < 20; t++) {
      b.native.fill(qb.buffer, 0); b.native.fill(hb.buffer, 0); b.native.fill(xb.buffer, 0);
      b.synchronize();
      if (launchOn === 'cs') { b.native.launchGraph(g, cs); b.native.synchronize(cs); } else { b.native.launchGraph(g, 0); b.synchronize(); }
      if (mx((b.toArray(qb) as Float32Array).slice(0, R), d) > 0) bad++;
    }
    b.native.freeGraph(g);
    console.log(`${label} on ${launchOn}: ${bad}/20 launches wrong`);
  };
  for (const form of ['', 'split', 'rows']) {
    if (form) process.env.KDTREE_GEMM_FORM = form; else delete process.env.KDTREE_GEMM_FORM;
    for (const on of ['cs', '0'] as const) trial(`arange+embedding+rmsNorm+gemm form '${form || 'default'}'`, queue, on);
  }
  delete process.env.KDTREE_GEMM_FORM;
  const noArange = (s: number) => {
    b.native.embedding({ table, ids: token, out: view(xb, [1, H]), stream: s });
    b.native.rmsNorm({ x: view(xb, [1, H]), weight: norm, out: view(hb, [1, H]), eps: 1e-5, stream: s });
    b.native.gemm({ x: view(hb, [1, H]), w, y: view(qb, [1, R]), stream: s });
  };
  for (const on of ['cs', '0'] as const) trial('embedding+rmsNorm+gemm', noArange, on);
  const withAdd = (s: number) => {
    b.native.embedding({ table, ids: token, out: view(xb, [1, H]), stream: s });
    b.native.rmsNorm({ x: view(xb, [1, H]), weight: norm, out: view(hb, [1, H]), eps: 1e-5, stream: s });
    b.native.add({ a: view(hb, [1, H]), b: view(xb, [1, H]), out: view(xb, [1, H]), stream: s });
    b.native.gemm({ x: view(hb, [1, H]), w, y: view(qb, [1, R]), stream: s });
  };
  for (const on of ['cs', '0'] as const) trial('embedding+rmsNorm+add+gemm(h)', withAdd, on);
  delete process.env.KDTREE_GEMM_FORM;
}
