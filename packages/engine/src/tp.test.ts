/**
 * Tensor parallelism on the cpu backend's ranks (worker threads over shared memory): every rank
 * count (2, 4, 8) gives the tokens of one rank and of the golden reference, greedy and DDTree, INT4 and
 * float; a shard reads exactly the bytes the whole tensor holds there; a weight that cannot be
 * split is refused naming it; a rank that fails to load, throws, exits or stalls ends the run
 * within the bound with an error naming it, and every thread is gone afterwards; prefill,
 * teacher-forced passes and steps run under the collective's guard with a deadline per pass.
 */
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { writeSyntheticModel, type GoldenRecord } from '@kdtree/reference';
import { createBackend } from '@kdtree/cuda';
import { createEngine, DeviceModel, Engine, EngineError, ModelSource, type Collective, type GenerateOptions, type MemoryEstimate, type Runner } from './index.js';
import { goldenTokens, tempDir } from './test-support/models.js';

const dir = tempDir('kdtree-tp-');
// tiny has 2 heads (at most 2 ranks) and INT4 experts too narrow to split (32 = one group), so it
// runs float; k2-mini has 4 heads and 128 intermediate channels per expert: 4 ranks of one group;
// tp8 has 8 heads and 256 channels per MLP: 8 ranks of one group
const models: { name: string; preset: 'tiny' | 'k2-mini' | 'tp8'; quant?: 'kimi-k2' | 'seed'; ranks: number[] }[] = [
  { name: 'tiny, float', preset: 'tiny', ranks: [2] },
  { name: 'k2-mini, INT4 routed experts', preset: 'k2-mini', quant: 'kimi-k2', ranks: [2, 4] },
  { name: 'tp8, float', preset: 'tp8', ranks: [4, 8] },
  { name: 'tp8, INT4 routed experts', preset: 'tp8', quant: 'kimi-k2', ranks: [8] },
];
const paths = new Map<string, string>();
const goldens = new Map<string, GoldenRecord>();

beforeAll(async () => {
  for (const m of [...models, { name: 'tiny, INT4', preset: 'tiny' as const, quant: 'kimi-k2' as const, ranks: [] }, { name: 'k2-mini, INT4 everywhere', preset: 'k2-mini' as const, quant: 'seed' as const, ranks: [] }]) {
    const path = join(dir, `${m.preset}-${m.quant ?? 'float'}.kdtr`);
    goldens.set(m.name, await writeSyntheticModel(path, { preset: m.preset, seed: 7, quant: m.quant }, 'engine tp tests'));
    paths.set(m.name, path);
  }
}, 120_000);

const greedy: GenerateOptions = { maxNew: 16, eos: [] };
const ddtree: GenerateOptions = { maxNew: 16, eos: [], spec: 'ddtree', budget: 8, depth: 3 };

async function run(path: string, tp: number, options: GenerateOptions, extra: Partial<Parameters<typeof createEngine>[0]> = {}): Promise<number[]> {
  const engine = await createEngine({ model: path, backend: 'cpu', cacheTokens: 128, maxBudget: 16, tp, ...extra });
  try {
    const golden = goldens.get([...paths].find(([, p]) => p === path)![0])!;
    return await goldenTokens(engine, golden, options);
  } finally {
    await engine.dispose();
  }
}

describe('tensor-parallel ranks give the tokens of one rank and of the golden reference', () => {
  for (const m of models) {
    it(`${m.name}: tp ${m.ranks.join(', ')}, greedy and DDTree`, async () => {
      const path = paths.get(m.name)!;
      const golden = goldens.get(m.name)!.tokens;
      expect(await run(path, 1, greedy)).toEqual(golden);
      for (const tp of m.ranks) {
        expect(await run(path, tp, greedy), `tp ${tp} greedy`).toEqual(golden);
        expect(await run(path, tp, ddtree), `tp ${tp} ddtree`).toEqual(golden);
      }
    }, 120_000);
  }

  it('k2-mini with every MLP INT4 (dense, shared and routed down split along K in whole groups): tp 4, DDTree', async () => {
    const path = paths.get('k2-mini, INT4 everywhere')!;
    expect(await run(path, 4, ddtree)).toEqual(goldens.get('k2-mini, INT4 everywhere')!.tokens);
  }, 60_000);

  it('chain speculation over 2 ranks: the tree of a chain is broadcast as well', async () => {
    const path = paths.get('tiny, float')!;
    expect(await run(path, 2, { ...ddtree, spec: 'chain', budget: 3 })).toEqual(goldens.get('tiny, float')!.tokens);
  }, 60_000);
});

describe('a shard is the whole tensor\'s bytes there', () => {
  it('ranged reads of rows and K blocks (INT4 and bf16) equal the same cut of the whole, checked tensor', async () => {
    const path = paths.get('k2-mini, INT4 everywhere')!;
    const whole = await ModelSource.open(path);
    const ranged = await ModelSource.open(path, { shard: { rank: 2, world: 4 } });
    try {
      const c = whole.config;
      const down = 'model.layers.1.mlp.experts.5.down_proj.weight';
      const shape = [c.hiddenSize, c.moeIntermediateSize] as [number, number];
      const cols = { start: 64, count: 32 };
      const a = await whole.readInt4(down, shape, undefined, cols);
      const b = await ranged.readInt4(down, shape, undefined, cols);
      expect([b.rows, b.cols, b.qw.length, b.sc.length]).toEqual([c.hiddenSize, 32, (c.hiddenSize * 32) / 8, c.hiddenSize]);
      expect(Buffer.from(b.qw.buffer, b.qw.byteOffset, b.qw.byteLength).equals(Buffer.from(a.qw.buffer, a.qw.byteOffset, a.qw.byteLength))).toBe(true);
      expect(Buffer.from(b.sc.buffer, b.sc.byteOffset, b.sc.byteLength).equals(Buffer.from(a.sc.buffer, a.sc.byteOffset, a.sc.byteLength))).toBe(true);
      // and the K block is those columns of the whole tensor's rows
      const full = await whole.readInt4(down, shape);
      for (const row of [0, 17, c.hiddenSize - 1]) {
        expect(Array.from(b.qw.subarray(row * 4, row * 4 + 4))).toEqual(Array.from(full.qw.subarray(row * 16 + 8, row * 16 + 12)));
      }
      const qb = 'model.layers.0.self_attn.q_b_proj.weight';
      const qbShape = [c.numHeads * (c.qkNopeDim + c.qkRopeDim), c.qLoraRank!] as [number, number];
      const rows = [48, 49, 50, 51, 96, 97, 98];
      const fa = await whole.readBf16(qb, qbShape, rows);
      const fb = await ranged.readBf16(qb, qbShape, rows, { start: 8, count: 40 });
      const fullQ = await whole.readBf16(qb, qbShape);
      rows.forEach((r, i) => {
        expect(Array.from(fa.bits.subarray(i * qbShape[1], (i + 1) * qbShape[1]))).toEqual(Array.from(fullQ.bits.subarray(r * qbShape[1], (r + 1) * qbShape[1])));
        expect(Array.from(fb.bits.subarray(i * 40, (i + 1) * 40))).toEqual(Array.from(fullQ.bits.subarray(r * qbShape[1] + 8, r * qbShape[1] + 48)));
      });
      await expect(ranged.readInt4(down, shape, undefined, { start: 16, count: 32 })).rejects.toThrow(/down_proj\.weight: columns \[16, 48\) of K = 128 are not whole INT4 groups of 32/);
    } finally {
      await whole.close();
      await ranged.close();
    }
  });

  it('a weight that cannot be split is refused, naming the tensor, its shape and the group', async () => {
    const err = await createEngine({ model: paths.get('tiny, INT4')!, backend: 'cpu', cacheTokens: 128, tp: 2 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(EngineError);
    expect(err).toMatchObject({ code: 'KDTREE_ENGINE_SHARD', field: 'model.layers.1.mlp.experts.0.down_proj.weight' });
    expect((err as Error).message).toMatch(/experts\.0\.down_proj\.weight \[64, 32\]: its intermediate size \(K\) \(32\) over 2 ranks is 16 per rank, not a multiple of its INT4 group \(32\)/);
    const heads = await createEngine({ model: paths.get('tiny, float')!, backend: 'cpu', cacheTokens: 128, tp: 4 }).catch((e: unknown) => e);
    expect((heads as Error).message).toMatch(/q_b_proj\.weight \[48, 32\]: its heads \(num_attention_heads\) \(2\) does not split over 4 ranks/);
    const seeded = await createEngine({ model: { config: {} } as never, tp: 2 }).catch((e: unknown) => e);
    expect(seeded).toMatchObject({ code: 'KDTREE_ENGINE_ARGUMENT', field: 'model' });
  });
});

describe('a rank that fails ends the run within the bound, naming the rank', () => {
  const timeoutMs = 1500;
  async function failing(fault: string, tp = 2, model = 'tiny, float'): Promise<{ error: EngineError; ms: number; engine?: Engine }> {
    const t0 = performance.now();
    let engine: Engine | undefined;
    try {
      engine = await createEngine({ model: paths.get(model)!, backend: 'cpu', cacheTokens: 128, tp, tpTimeoutMs: timeoutMs, tpFault: fault });
      await engine.complete(goldens.get(model)!.prompt, greedy);
    } catch (error) {
      return { error: error as EngineError, ms: performance.now() - t0, engine };
    }
    throw new Error(`fault ${fault}: the run finished`);
  }

  for (const [fault, message] of [
    // tiny's forward: 2 layers x 2 all-reduces + the lm_head all-gather; the prompt is one prefill pass
    ['1:collective=3:throw', /^tensor-parallel rank 1 threw during prefill: injected fault at collective 3$/],
    ['1:collective=40:throw', /^tensor-parallel rank 1 threw during a decode step: injected fault at collective 40$/],
    ['1:collective=40:exit', /^tensor-parallel rank 1 exited \(code 3\)$/],
    ['1:collective=40:stall', /^tensor-parallel rank 1 stalled: it did not reach an? (all-reduce|all-gather) \(collective 40\) within 1500 ms$/],
    ['1:load:throw', /^tensor-parallel rank 1 failed to load: injected fault at load$/],
    ['1:load:stall', /^tensor-parallel rank 1 stalled while loading: no part of its shard loaded for 1500 ms$/],
  ] as const) {
    it(`${fault}`, async () => {
      const { error, ms, engine } = await failing(fault);
      expect(error).toBeInstanceOf(EngineError);
      expect(error).toMatchObject({ code: 'KDTREE_ENGINE_RANK', field: 'rank 1' });
      expect(error.message).toMatch(message);
      expect(ms).toBeLessThan(timeoutMs + 5000);
      if (engine) {
        // the engine refuses further work with the same error, and disposes without waiting for the dead rank
        await expect(engine.complete([1, 2], greedy)).rejects.toThrow(error.message);
        await engine.dispose();
      }
    }, 30_000);
  }

  it('a stalled rank among 4: the rank waiting for it names it, the others stop too', async () => {
    const { error, engine } = await failing('3:collective=25:stall', 4, 'k2-mini, INT4 routed experts');
    expect(error.message).toMatch(/^tensor-parallel rank 3 stalled/);
    await engine?.dispose();
  }, 30_000);
});

describe('the collective\'s watchdog guards every forward pass, with a deadline per pass', () => {
  it('rank 0 guards a prefill of 3 chunks for 3 passes, each step and a teacher-forced pass for 1; every rank guards the commands that run passes', async () => {
    const b = createBackend({ backend: 'cpu' });
    const golden = goldens.get('tiny, float')!;
    const prompt = golden.prompt;
    expect(prompt.length).toBeGreaterThanOrEqual(3);
    const prefillChunk = Math.ceil(prompt.length / 3);
    const chunks = Math.ceil(prompt.length / prefillChunk);
    // one rank's collective (its sums and gathers are the identity) that records each guard's passes
    const guarded: number[] = [];
    const spy: Collective = {
      rank: 0,
      world: 1,
      allReduceSum: () => undefined,
      allGather: () => {
        throw new Error('one rank gathers nothing');
      },
      broadcast: () => undefined,
      guard: (work, passes) => {
        guarded.push(passes ?? 1);
        return work();
      },
    };
    const source = await ModelSource.open(paths.get('tiny, float')!);
    const model = await DeviceModel.load(b, source, { rows: 17, collective: spy });
    await source.close();
    const engine = new Engine(b, model, { path: source.path, configJson: source.configJson }, { cacheTokens: 128, cacheDtype: 'f32', activations: 'f32', prefillChunk, maxBudget: 16, maxDepth: 16 }, {} as MemoryEstimate);
    try {
      expect((await engine.complete(prompt, { maxNew: 4, eos: [] })).tokens).toEqual(golden.tokens.slice(0, 4));
      expect(guarded).toEqual([chunks, 1, 1, 1]);
      guarded.length = 0;
      await engine.teacherForced(prompt.slice(0, 4));
      expect(guarded).toEqual([1]);
      // what every other rank guards each of rank 0's commands for (tp-rank.ts): 0 is none
      const runner = (engine as unknown as { runner: Runner }).runner;
      expect(runner.passes({ op: 'prefill', tokens: prompt, start: 0, logits: true })).toBe(chunks);
      expect(runner.passes({ op: 'prefill', tokens: Array.from({ length: 100 * prefillChunk + 1 }, () => 1), start: 0, logits: false })).toBe(101);
      expect(runner.passes({ op: 'teacherForced', tokens: prompt, start: 0 })).toBe(1);
      expect(runner.passes({ op: 'step', step: { kind: 'decode' } })).toBe(1);
      expect(runner.passes({ op: 'committed', length: 3 })).toBe(0);
      expect(runner.passes({ op: 'advance', count: 1 })).toBe(0);
    } finally {
      await engine.dispose();
    }
  }, 30_000);
});
