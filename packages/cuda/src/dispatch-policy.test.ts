/**
 * The cuda GEMMs' dispatch rules (native/src/common/dispatch_policy.cc) on the real Kimi K2 shapes,
 * read through dispatchPolicy() of the cpu variant: the rules are plain C++ in both variants, so
 * CI pins the form every decode (M = 1-16), verify (17-129) and prefill (257+) call takes on an
 * H200. A change of rule must change this table; the GPU self-test and a same-run A/B on the H200
 * (tools/gpu/run.sh ab) say whether the change is right.
 */
import { describe, expect, it } from 'vitest';
import { loadAddon } from './loader.js';
import type { DispatchQuery } from './native-types.js';

const { module } = loadAddon({ backend: 'cpu' });
const H200 = { sms: 132, sm90a: true };
/** Routed experts of Kimi K2: 384, 8 per token. */
const ROUTING = { experts: 384, topk: 8 };

const MS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 65, 128, 257, 512, 2048, 8192] as const;
type Op = Exclude<DispatchQuery['op'], 'ddtreeBuild'>;
/** [op, what, N, K, the form at each M of MS] (W4A16 group 32, bf16 scales, bf16 x). */
const TABLE: [Op, string, number, number, string[]][] = [
  // W4A16 dense (the seed scheme quantizes every MLP projection)
  ['w4a16Gemm', 'layer 0 gate_up', 36864, 7168, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'standard', 'standard', 'wgmma', 'wgmma', 'wgmma', 'wgmma', 'wgmma', 'prefill', 'prefill', 'prefill', 'prefill']],
  ['w4a16Gemm', 'layer 0 down', 7168, 18432, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'standard', 'standard', 'standard', 'standard', 'wgmma', 'wgmma', 'prefill', 'prefill', 'prefill', 'prefill', 'prefill']],
  ['w4a16Gemm', 'shared gate_up', 4096, 7168, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'x-in-place', 'x-in-place', 'standard', 'standard', 'wgmma', 'wgmma', 'wgmma', 'prefill', 'prefill', 'prefill', 'prefill']],
  ['w4a16Gemm', 'shared down', 7168, 2048, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'x-in-place', 'x-in-place', 'standard', 'standard', 'wgmma', 'wgmma', 'prefill', 'prefill', 'prefill', 'prefill', 'prefill']],
  // W4A16 routed experts: M is tokens, the rows are M x 8 pairs over 384 experts
  ['moeGemm', 'routed gate_up', 4096, 7168, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'x-in-place', 'standard', 'standard']],
  ['moeGemm', 'routed down', 7168, 2048, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'even-columns', 'standard', 'standard', 'x-in-place', 'standard', 'standard']],
  ['moeGemm', 'routed gate_up, TP 8', 512, 7168, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'standard-pieces', 'standard-pieces', 'x-in-place', 'standard', 'standard']],
  ['moeGemm', 'routed down, TP 8', 7168, 256, ['one-token', 'even-columns', 'even-columns', 'even-columns', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'even-columns-pieces', 'standard-pieces', 'standard-pieces', 'x-in-place', 'standard', 'standard']],
  // bf16 weights as stored (gemm)
  ['gemm', 'q_a_proj', 1536, 7168, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'q_b_proj', 12288, 1536, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'tiled', 'tiled', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'kv_a_proj_with_mqa', 576, 7168, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'kv_b_proj', 16384, 512, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'tiled', 'tiled', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'o_proj', 7168, 8192, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'shared gate_up', 4096, 7168, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'tiled-split', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'shared down', 7168, 2048, ['split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'split', 'wgmma', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
  ['gemm', 'lm_head', 163840, 7168, ['rows', 'rows', 'rows', 'rows', 'rows', 'rows', 'rows', 'rows', 'tiled', 'tiled', 'tiled', 'tiled', 'wgmma', 'wgmma', 'wgmma', 'wgmma', 'wgmma']],
];

function plan(op: Op, m: number, n: number, k: number, extra: Partial<DispatchQuery> = {}) {
  const q = { op, m, n, k, ...H200, ...(op === 'moeGemm' ? ROUTING : {}), ...extra };
  return op === 'gemm' ? module.dispatchPolicy({ ...q, op }) : module.dispatchPolicy({ ...q, op });
}

describe('the cuda GEMMs choose these forms for the Kimi K2 shapes on an H200 (132 SMs, sm_90a)', () => {
  for (const [op, what, n, k, forms] of TABLE) {
    it(`${op} ${what} (N ${n} x K ${k}) at M = ${MS.join(', ')}`, () => {
      expect(MS.map((m) => plan(op, m, n, k).form)).toEqual(forms);
    });
  }
});

describe('stream-K ranges of a decode step (a function of N, K and the device, never of M)', () => {
  // [op, N, K, blocks, steps per warp]
  const RANGES: [Op, number, number, number, number][] = [
    ['moeGemm', 4096, 7168, 33, 55],
    ['moeGemm', 7168, 2048, 32, 28],
    ['moeGemm', 512, 7168, 32, 7],
    ['moeGemm', 7168, 256, 28, 4],
    ['w4a16Gemm', 36864, 7168, 261, 62],
    ['w4a16Gemm', 7168, 2048, 224, 4],
  ];
  for (const [op, n, k, blocks, stepsPerWarp] of RANGES) {
    it(`${op} N ${n} x K ${k}: ${blocks} blocks of 8 warps, ${stepsPerWarp} steps per warp, at every M`, () => {
      for (const m of [1, 4, 16, 65]) {
        const p = plan(op, m, n, k);
        if (!('blocks' in p)) throw new Error('expected a W4A16 plan');
        expect([p.blocks, p.stepsPerWarp]).toEqual([blocks, stepsPerWarp]);
      }
    });
  }
  it('a decode step of 1 token routes its 8 pairs inside the GEMM, one pair per tile; a verify step sorts them', () => {
    expect(plan('moeGemm', 1, 4096, 7168)).toMatchObject({ routed: true, tileTokens: 1, rows: 8 });
    expect(plan('moeGemm', 4, 4096, 7168)).toMatchObject({ routed: true, tileTokens: 4, rows: 32 });
    expect(plan('moeGemm', 65, 4096, 7168)).toMatchObject({ routed: false, tileTokens: 4, rows: 520 });
  });
  it('minWarpSteps lengthens the ranges and turns the pieces off', () => {
    expect(plan('moeGemm', 65, 512, 7168)).toMatchObject({ form: 'even-columns-pieces', blocks: 32, stepsPerWarp: 7 });
    expect(plan('moeGemm', 65, 512, 7168, { minWarpSteps: 16 })).toMatchObject({ form: 'even-columns', blocks: 14, stepsPerWarp: 16 });
  });
});

describe('how far ahead a decode GEMM loads (chunks of 32 k, 4 KB of weights each at one token)', () => {
  // the decode step's bf16 projections (Kimi K2's shapes): every one 8 chunks ahead at M = 1-8,
  // whatever its ranges
  // the decode step's bf16 projections (Kimi K2's shapes) at M = 1-8: 8 ahead where a warp's range
  // is 32 chunks or longer, 4 on the short ranges (more warps fit an SM)
  const DECODE: [string, number, number, string, number, number][] = [
    ['[q_a; kv_a]', 2112, 7168, 'split', 28, 4],
    ['q_b (nope then rope rows)', 12288, 1536, 'split', 8, 4],
    ['o_proj', 7168, 8192, 'split', 32, 8],
    ['shared gate_up', 4096, 7168, 'split', 28, 4],
    ['shared down', 7168, 2048, 'split', 8, 4],
    ['layer 0 gate_up', 36864, 7168, 'rows', 112, 8],
    ['layer 0 down', 7168, 18432, 'split', 72, 8],
    ['lm_head', 163840, 7168, 'rows', 224, 8],
  ];
  for (const [what, n, k, form, rangeChunks, loadAhead] of DECODE) {
    it(`${what} (N ${n} x K ${k}): the ${form} form, ranges of ${rangeChunks} chunks, ${loadAhead} ahead at M = 1-8`, () => {
      for (const m of [1, 8]) expect(plan('gemm', m, n, k)).toMatchObject({ form, nt: 1, rangeChunks, loadAhead });
    });
  }
  it('wider token tiles and f32 x keep their fragments within 32 registers', () => {
    expect(plan('gemm', 9, 163840, 7168)).toMatchObject({ nt: 2, loadAhead: 4 });
    expect(plan('gemm', 17, 7168, 8192, { gemmForm: 'split' })).toMatchObject({ nt: 4, loadAhead: 2 });
    expect(plan('gemm', 1, 163840, 7168, { xDtype: 'f32' })).toMatchObject({ nt: 1, loadAhead: 2 });
    expect(plan('gemm', 9, 7168, 8192, { xDtype: 'f32' })).toMatchObject({ nt: 2, loadAhead: 1 });
  });
});

describe('the rules where the device or the call differs', () => {
  it('without sm_90a code the warpgroup kernels are never chosen', () => {
    for (const m of [17, 512, 2048]) {
      expect(plan('w4a16Gemm', m, 36864, 7168, { sm90a: false }).form).toBe('standard');
      expect(plan('gemm', m, 163840, 7168, { sm90a: false }).form).toBe('tiled');
    }
  });
  it('f16 and f32 x stay on the stream-K kernel (8 token groups past 8 rows)', () => {
    expect(plan('w4a16Gemm', 512, 36864, 7168, { xDtype: 'f16' })).toMatchObject({ form: 'standard', nt: 8, stagesX: true });
    expect(plan('w4a16Gemm', 512, 36864, 7168, { xDtype: 'f32' })).toMatchObject({ form: 'standard', nt: 8, stagesX: false });
  });
  it('a K that is not whole steps of 128 stages x from 2 rows on', () => {
    expect(plan('w4a16Gemm', 2, 4096, 7200)).toMatchObject({ form: 'standard', nt: 2, stagesX: true });
  });
});

describe('forced forms', () => {
  it('w4a16Prefill always runs the prefill kernel, never keeps the warpgroup kernel', () => {
    expect(plan('w4a16Gemm', 17, 4096, 7168, { w4a16Prefill: 'always' }).form).toBe('prefill');
    expect(plan('w4a16Gemm', 2048, 36864, 7168, { w4a16Prefill: 'never' }).form).toBe('wgmma');
  });
  it('a forced form that cannot run a call throws the error the call would', () => {
    expect(() => plan('w4a16Gemm', 1, 4096, 7168, { w4a16Prefill: 'always' })).toThrow(/KDTREE_W4A16_PREFILL=always cannot run M = 1, N = 4096, K = 7168, group 32 on the prefill kernel: it takes 17 or more tokens/);
    expect(() => plan('moeGemm', 65, 4096, 7168, { w4a16Prefill: 'always' })).toThrow(/MoE calls run the stream-K kernel/);
    expect(() => plan('w4a16Gemm', 512, 4096, 7168, { w4a16Prefill: 'always', group: 128 })).toThrow(/it takes group 32 with bf16 scales or group 64/);
    expect(() => plan('w4a16Gemm', 512, 4096, 7168, { w4a16Prefill: 'always', sm90a: false })).toThrow(/sm_90a code, which this device does not run/);
    expect(() => plan('gemm', 3, 7168, 2048, { gemmForm: 'tiled' })).toThrow(/KDTREE_GEMM_FORM=tiled cannot run M = 3, N = 7168, K = 2048: the tiled and wgmma forms take bf16 or f16 x of 17 or more tokens/);
    expect(() => plan('gemm', 512, 7168, 2048, { gemmForm: 'wgmma', sm90a: false })).toThrow(/the wgmma form is sm_90a code/);
    expect(() => plan('gemm', 512, 7168, 2048, { gemmForm: 'wgmma', xDtype: 'f32' })).toThrow(/take bf16 or f16 x/);
  });
  it('a form that can run is taken whatever the rule prefers', () => {
    expect(plan('gemm', 1, 163840, 7168, { gemmForm: 'split' }).form).toBe('split');
    expect(plan('gemm', 2048, 163840, 7168, { gemmForm: 'rows' }).form).toBe('rows');
  });
  it('unknown values and queries are refused, naming what was expected', () => {
    expect(() => plan('gemm', 1, 64, 64, { gemmForm: 'fast' as never })).toThrow(/KDTREE_GEMM_FORM must be split, rows, tiled, tiled-split or wgmma, got 'fast'/);
    expect(() => plan('w4a16Gemm', 1, 64, 64, { w4a16Prefill: 'sometimes' as never })).toThrow(/KDTREE_W4A16_PREFILL must be always or never, got 'sometimes'/);
    expect(() => module.dispatchPolicy({ op: 'conv' as never, m: 1, n: 1, k: 1, ...H200 })).toThrow(/op must be 'gemm', 'w4a16Gemm', 'moeGemm' or 'ddtreeBuild', got 'conv'/);
    expect(() => module.dispatchPolicy({ op: 'gemm', m: 0, n: 1, k: 1, ...H200 })).toThrow(/dispatchPolicy: m must be an integer in \[1, 2147483647\], got 0/);
  });
});

describe('the backend reports the form a call ran', () => {
  it('cpu: null before a GEMM, then cpu; setForcedForms checks its values and returns the previous setting', () => {
    const b = module.createBackend('cpu');
    expect(b.lastForm()).toBeNull();
    expect(b.setForcedForms({ gemm: 'wgmma', w4a16Prefill: 'always' })).toEqual({ gemm: null, w4a16Prefill: null });
    expect(b.setForcedForms({})).toEqual({ gemm: 'wgmma', w4a16Prefill: 'always' });
    expect(() => b.setForcedForms({ gemm: 'fast' as never })).toThrow(/KDTREE_GEMM_FORM must be split, rows, tiled, tiled-split or wgmma, got 'fast'/);
    expect(() => b.setForcedForms({ gemm: 3 as never })).toThrow(/setForcedForms: gemm must be a string, got the number 3/);
    const x = b.alloc(4 * 64 * 2);
    const w = b.alloc(16 * 64 * 2);
    const y = b.alloc(4 * 16 * 4);
    b.gemm({ x: { buffer: x, dtype: 'bf16', shape: [4, 64] }, w: { buffer: w, dtype: 'bf16', shape: [16, 64] }, y: { buffer: y, dtype: 'f32', shape: [4, 16] } });
    expect(b.lastForm()).toBe('cpu');
    for (const buffer of [x, w, y]) b.free(buffer);
  });
});

describe('ddtree_build: one launch for small trees (a cluster of row blocks for small vocabularies), four passes for the rest', () => {
  const form = (depth: number, vocab: number, budget: number) => module.dispatchPolicy({ op: 'ddtreeBuild', m: depth, n: vocab, k: budget, sms: H200.sms, sm90a: true }).form;
  it('budgets 1..32 over up to 8 depths of up to 8192 tokens take the cluster build, rows past 4096 tokens over two blocks (a DFlash block of 8 on the demo\'s walk target)', () => {
    expect(form(7, 8192, 7)).toBe('cluster-halves');
    expect(form(8, 8192, 32)).toBe('cluster-halves');
    expect(form(3, 4097, 1)).toBe('cluster-halves');
    expect(form(3, 4096, 16)).toBe('cluster');
    expect(form(1, 5, 1)).toBe('cluster');
  });
  it('more depths, or larger vocabularies up to 262144 tokens, are fused (a DFlash block of 8 on Kimi K2\'s vocabulary)', () => {
    expect(form(9, 8192, 7)).toBe('fused');
    expect(form(32, 33, 32)).toBe('fused');
    expect(form(7, 8193, 7)).toBe('fused');
    expect(form(7, 163840, 32)).toBe('fused');
    expect(form(32, 262144, 1)).toBe('fused');
  });
  it('larger budgets, depths or vocabularies take the passes', () => {
    expect(form(7, 163840, 33)).toBe('passes');
    expect(form(33, 8192, 8)).toBe('passes');
    expect(form(4, 262145, 8)).toBe('passes');
  });
});
