/**
 * Tensor-parallel ranks as processes (`tpRanks: 'processes'`: forked ranks over TCP to rank 0):
 * the tokens of one rank and of the golden reference, greedy and DDTree; a rank that is
 * SIGKILLed, exits, stalls or fails to load ends the run within the bound naming it, and no rank
 * process is left behind, nor after a plain dispose, nor when rank 0's own process is killed.
 */
import { spawn } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';
import { writeSyntheticModel, type GoldenRecord } from '@kdtree/reference';
import { createEngine, EngineError, type Engine, type GenerateOptions } from './index.js';
import { goldenTokens, tempDir } from './test-support/models.js';
import { alive, hasProc, rankChildren, until } from './test-support/processes.js';

const dir = tempDir('kdtree-tp-processes-');
// tiny has 2 heads: 2 ranks; k2-mini (4 heads, INT4 experts of 4 groups) runs 4
let tiny = '';
let mini = '';
let tinyGolden: GoldenRecord;
let miniGolden: GoldenRecord;

beforeAll(async () => {
  tiny = join(dir, 'tiny.kdtr');
  tinyGolden = await writeSyntheticModel(tiny, { preset: 'tiny', seed: 7 }, 'engine tp process tests');
  mini = join(dir, 'k2-mini.kdtr');
  miniGolden = await writeSyntheticModel(mini, { preset: 'k2-mini', seed: 7, quant: 'kimi-k2' }, 'engine tp process tests');
}, 120_000);

const greedy: GenerateOptions = { maxNew: 16, eos: [] };
const ddtree: GenerateOptions = { maxNew: 16, eos: [], spec: 'ddtree', budget: 8, depth: 3 };

async function tokens(path: string, golden: GoldenRecord, tp: number, options: GenerateOptions, check?: (engine: Engine) => void): Promise<number[]> {
  const engine = await createEngine({ model: path, backend: 'cpu', cacheTokens: 128, maxBudget: 16, tp, tpRanks: tp > 1 ? 'processes' : undefined });
  let pids: number[] = [];
  try {
    pids = engine.rankPids;
    check?.(engine);
    return await goldenTokens(engine, golden, options);
  } finally {
    await engine.dispose();
    expect(pids.filter(alive), 'rank processes left after dispose').toEqual([]);
  }
}

describe('rank processes give the tokens of one rank and of the golden reference', () => {
  it('tiny, float: tp 2, greedy and DDTree', async () => {
    const golden = tinyGolden.tokens;
    expect(await tokens(tiny, tinyGolden, 1, greedy)).toEqual(golden);
    expect(await tokens(tiny, tinyGolden, 2, greedy, (e) => expect(e.rankPids).toHaveLength(1))).toEqual(golden);
    expect(await tokens(tiny, tinyGolden, 2, ddtree)).toEqual(golden);
  }, 120_000);

  it('k2-mini, INT4 routed experts: tp 4, DDTree', async () => {
    expect(await tokens(mini, miniGolden, 4, ddtree, (e) => expect(e.rankPids).toHaveLength(3))).toEqual(miniGolden.tokens);
  }, 120_000);

  it('rank processes end themselves when the process of rank 0 is SIGKILLed', async () => {
    const index = pathToFileURL(join(import.meta.dirname, '../dist/index.js')).href;
    const script = `const { createEngine } = await import(${JSON.stringify(index)});
      const engine = await createEngine({ model: ${JSON.stringify(tiny)}, backend: 'cpu', cacheTokens: 128, tp: 2, tpRanks: 'processes' });
      console.log(JSON.stringify(engine.rankPids));
      setInterval(() => undefined, 1000);`;
    const file = join(dir, 'rank-0.mjs');
    writeFileSync(file, script);
    const parent = spawn(process.execPath, [file], { stdio: ['ignore', 'pipe', 'pipe'] });
    const pids = await new Promise<number[]>((resolve, reject) => {
      let out = '';
      let err = '';
      parent.stderr.on('data', (chunk: Buffer) => (err += chunk.toString()));
      parent.stdout.on('data', (chunk: Buffer) => {
        out += chunk.toString();
        if (out.includes('\n')) resolve(JSON.parse(out) as number[]);
      });
      parent.on('exit', (code) => reject(new Error(`rank 0's process exited (code ${code}) before printing its ranks: ${err}`)));
    });
    expect(pids).toHaveLength(1);
    expect(pids.filter(alive)).toEqual(pids);
    parent.kill('SIGKILL');
    expect(await until(() => pids.filter(alive).length === 0, 5000), 'rank processes left after rank 0 was killed').toBe(true);
  }, 60_000);

  it('refuses an unknown tpRanks', async () => {
    await expect(createEngine({ model: tiny, backend: 'cpu', tp: 2, tpRanks: 'fibers' as never })).rejects.toMatchObject({ code: 'KDTREE_ENGINE_ARGUMENT', field: 'tpRanks' });
  });
});

describe('a rank process that fails ends the run within the bound, naming it, and leaves no process', () => {
  const timeoutMs = 1500;

  async function failing(options: { fault?: string; kill?: (pids: number[]) => void }): Promise<{ error: EngineError; ms: number; pids: number[] }> {
    const engine = await createEngine({ model: tiny, backend: 'cpu', cacheTokens: 128, tp: 2, tpRanks: 'processes', tpTimeoutMs: timeoutMs, tpFault: options.fault });
    const pids = engine.rankPids;
    const t0 = performance.now();
    try {
      let n = 0;
      for await (const _ of engine.generate(tinyGolden.prompt, { maxNew: 64, eos: [] })) {
        if (++n === 3) options.kill?.(pids);
      }
    } catch (error) {
      const ms = performance.now() - t0;
      // the engine refuses further work with the same error, and disposes without waiting
      await expect(engine.complete([1, 2], greedy)).rejects.toThrow((error as Error).message);
      await engine.dispose();
      return { error: error as EngineError, ms, pids };
    }
    await engine.dispose();
    throw new Error('the run finished');
  }

  it('a rank SIGKILLed mid-run', async () => {
    const { error, ms, pids } = await failing({ kill: (p) => process.kill(p[0], 'SIGKILL') });
    expect(error).toBeInstanceOf(EngineError);
    expect(error).toMatchObject({ code: 'KDTREE_ENGINE_RANK', field: 'rank 1' });
    expect(error.message).toBe('tensor-parallel rank 1 exited (signal SIGKILL)');
    expect(ms).toBeLessThan(timeoutMs + 5000);
    expect(pids.filter(alive)).toEqual([]);
  }, 30_000);

  it('a rank that exits', async () => {
    const { error, pids } = await failing({ fault: '1:collective=40:exit' });
    expect(error.message).toBe('tensor-parallel rank 1 exited (code 3)');
    expect(pids.filter(alive)).toEqual([]);
  }, 30_000);

  it('a rank that throws in a step', async () => {
    const { error, pids } = await failing({ fault: '1:collective=40:throw' });
    expect(error.message).toBe('tensor-parallel rank 1 threw during a decode step: injected fault at collective 40');
    expect(pids.filter(alive)).toEqual([]);
  }, 30_000);

  it('a stalled rank: rank 0 names it and kills it', async () => {
    const { error, ms, pids } = await failing({ fault: '1:collective=40:stall' });
    expect(error).toMatchObject({ code: 'KDTREE_ENGINE_RANK', field: 'rank 1' });
    expect(error.message).toMatch(/^tensor-parallel rank 1 stalled: it did not reach an? (all-reduce|all-gather) \(collective 40\) within 1500 ms$/);
    expect(ms).toBeLessThan(timeoutMs + 5000);
    expect(pids.filter(alive)).toEqual([]);
  }, 30_000);

  it('a rank whose load throws, and one whose load stalls', async () => {
    for (const [fault, message] of [
      ['1:load:throw', 'tensor-parallel rank 1 failed to load: injected fault at load'],
      ['1:load:stall', 'tensor-parallel rank 1 stalled while loading: no part of its shard loaded for 1500 ms'],
    ]) {
      // no engine comes back to ask for its ranks: they are watched as this process's children
      const seen = new Set<number>(rankChildren());
      expect([...seen], 'rank processes before the run').toEqual([]);
      let settled = false;
      const attempt = createEngine({ model: tiny, backend: 'cpu', cacheTokens: 128, tp: 2, tpRanks: 'processes', tpTimeoutMs: timeoutMs, tpFault: fault })
        .catch((e: unknown) => e)
        .finally(() => (settled = true));
      while (!settled) {
        for (const pid of rankChildren()) seen.add(pid);
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      const error = await attempt;
      expect((error as Error).message, fault).toBe(message);
      if (hasProc) expect(seen.size, `${fault}: rank processes seen while loading`).toBe(1);
      expect([...seen].filter(alive), `${fault}: rank processes left`).toEqual([]);
      expect(rankChildren(), `${fault}: rank processes left`).toEqual([]);
    }
  }, 30_000);
});
