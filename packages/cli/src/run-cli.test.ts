import { mkdtempSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-run-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const target = join(dir, 'tiny.kdtr');
const draft = join(dir, 'draft.kdtr');
let golden: { prompt: number[]; tokens: number[] };

describe('kdtree run', () => {
  beforeAll(() => {
    const r = runCli(['gen-model', '--preset', 'tiny', '--seed', '4', '-o', target, '--quant', 'kimi-k2', '--draft', draft, '--json']);
    expect(r.status, r.stderr).toBe(0);
    golden = JSON.parse(r.stdout).golden;
  });

  it('greedy on the engine reproduces kdtree golden (--json, schema kdtree.run/1)', () => {
    const r = runCli(['run', target, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--json']);
    expect(r.status, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out).toMatchObject({ schema: 'kdtree.run/1', prompt: golden.prompt, tokens: golden.tokens, stats: { backend: 'cpu', spec: 'greedy', steps: 15 } });
    for (const key of ['tokens_per_second', 'prefill_ms', 'calibration_ms', 'decode_ms', 'target_forwards', 'mean_accepted_length']) expect(typeof out.stats[key]).toBe('number');
    expect(out.stats.calibration_ms).toBe(0);
  });

  it('ddtree and chain with the draft model stream the same tokens; --trace records each step', () => {
    for (const spec of ['ddtree', 'chain']) {
      const r = runCli(['run', target, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--spec', spec, '--drafter', `model:${draft}`, '--budget', '6', '--depth', '3', '--trace']);
      expect(r.status, r.stderr).toBe(0);
      expect(r.stdout.trim()).toBe(golden.tokens.join(', '));
      expect(r.stderr).toMatch(/step 1: draft top-1 \[\d+, \d+, \d+\], tree \d+ nodes, \d+ accepted/);
      // stderr is no terminal here: one line a step, no blank lines between them
      expect(r.stderr).toMatch(/^step 1: .*\nstep 2: /m);
      expect(r.stderr).not.toMatch(/\n\n/);
      expect(r.stderr).toMatch(new RegExp(`16 tokens, ${spec} \\(model:.*\\) on cpu`));
    }
    const j = runCli(['run', target, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--spec', 'ddtree', '--drafter', `model:${draft}`, '--json', '--trace']);
    const out = JSON.parse(j.stdout);
    expect(out.tokens).toEqual(golden.tokens);
    expect(out.steps.length).toBe(out.stats.steps);
    expect(out.steps[0]).toMatchObject({ tree_size: 17, draft_top1: expect.any(Array), accepted: expect.any(Number) });
  });

  it('runs the safetensors checkpoint kdtree export writes (its NAME.config.json beside it, or one named by --config)', () => {
    const exported = join(dir, 'tiny-export.safetensors');
    const e = runCli(['export', target, '-o', exported]);
    expect(e.status, e.stderr).toBe(0);
    const r = runCli(['run', exported, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--json']);
    expect(r.status, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout).tokens).toEqual(golden.tokens);
    // elsewhere, the config is named with --config
    const config = join(dir, 'elsewhere.json');
    renameSync(join(dir, 'tiny-export.config.json'), config);
    const bare = runCli(['run', exported, '--prompt', '1,2', '--max-new', '2', '--backend', 'cpu']);
    expect(bare.status).toBe(1);
    expect(bare.stderr).toMatch(/tiny-export\.safetensors: config\.json: no model config beside the checkpoint \(looked for \S*tiny-export\.config\.json and \S*config\.json; pass one explicitly, e\.g\. --config FILE\)/);
    const named = runCli(['run', exported, '--config', config, '--prompt', golden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--json']);
    expect(named.status, named.stderr).toBe(0);
    expect(JSON.parse(named.stdout).tokens).toEqual(golden.tokens);
  });

  it('bad requests exit with one clear line', () => {
    const cases: [string[], number, RegExp][] = [
      [['--prompt', '1,500', '--max-new', '4'], 2, /--prompt: id 2: token 500 is outside the vocabulary \[0, 128\)/],
      [['--prompt', '1,2', '--max-new', '4', '--eos', '3,999'], 2, /--eos: token 999 is outside the vocabulary \[0, 128\)/],
      [['--prompt', '1,2', '--max-new', '4', '--cache-tokens', '0'], 2, /--cache-tokens: must be >= 2, got '0'/],
      [['--prompt', '1,2', '--max-new', '4', '--spec', 'ddtree', '--budget', '0'], 2, /--budget: must be in \[1, 1024\], got '0'/],
      [['--prompt', '1,2', '--max-new', '4', '--depth', '3'], 2, /--drafter, --budget and --depth apply to --spec chain or ddtree/],
      [['--prompt', '1,2', '--max-new', '4', '--spec', 'ddtree', '--drafter', 'model:/nonexistent.kdtr'], 1, /nonexistent\.kdtr/],
      // the engine's refusals of a flag's value are usage errors named by the flag
      [['--prompt', '1,2', '--max-new', '5000'], 2, /--max-new: prompt \(2\) \+ maxNew \(5000\) .* exceed the KV cache of 512 tokens \(the model's max_position_embeddings\)/],
      [['--prompt', '1,2', '--max-new', '5000', '--cache-tokens', '100'], 2, /--max-new: .* exceed the KV cache of 100 tokens \(cacheTokens; kdtree run --cache-tokens\)/],
      [['--prompt', '1,2', '--max-new', '4', '--cache-tokens', '999999'], 2, /--cache-tokens: expected an integer in \[2, 512\] \(the model's max_position_embeddings\), got 999999/],
      [['--prompt', '1,2', '--max-new', '4', '--spec', 'chain', '--budget', 'auto'], 2, /--budget: 'auto' chooses a DDTree budget; chain decoding takes a number/],
    ];
    for (const [args, status, message] of cases) {
      const r = runCli(['run', target, '--backend', 'cpu', ...args]);
      expect(r.status, r.stderr).toBe(status);
      expect(r.stderr).toMatch(message);
      expect(r.stderr).not.toMatch(/internal error|    at /);
    }
    // a model that is not there, and a JSON file that is no model
    const notJson = join(dir, 'notes.json');
    writeFileSync(notJson, '{"hello": 1}');
    const models: [string, RegExp][] = [
      [join(dir, 'absent.kdtr'), /^kdtree: error: model: .*absent\.kdtr: no such file or directory$/m],
      [notJson, /notes\.json: field 'weight_map': not a safetensors index \(model\.safetensors\.index\.json\) or a KDTR index .*found \(absent\)/],
    ];
    for (const [model, message] of models) {
      const r = runCli(['run', model, '--backend', 'cpu', '--prompt', '1,2', '--max-new', '4']);
      expect(r.status, r.stderr).toBe(1);
      expect(r.stderr).toMatch(message);
      expect(r.stderr).not.toMatch(/internal error|    at /);
    }
  });
});

describe('kdtree run --tp', () => {
  const float = join(dir, 'tiny-float.kdtr');
  let floatGolden: { prompt: number[]; tokens: number[] };
  beforeAll(() => {
    const r = runCli(['gen-model', '--preset', 'tiny', '--seed', '4', '-o', float, '--json']);
    expect(r.status, r.stderr).toBe(0);
    floatGolden = JSON.parse(r.stdout).golden;
  });

  it('2 ranks (worker threads) reproduce kdtree golden, greedy and DDTree', () => {
    for (const spec of [[], ['--spec', 'ddtree', '--budget', '6', '--depth', '3']]) {
      const r = runCli(['run', float, '--prompt', floatGolden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--tp', '2', '--json', ...spec]);
      expect(r.status, r.stderr).toBe(0);
      expect(JSON.parse(r.stdout)).toMatchObject({ tokens: floatGolden.tokens, stats: { backend: 'cpu', tp: 2 } });
    }
  });

  it('2 rank processes (--ranks processes) reproduce kdtree golden, greedy and DDTree', () => {
    for (const spec of [[], ['--spec', 'ddtree', '--budget', '6', '--depth', '3']]) {
      const r = runCli(['run', float, '--prompt', floatGolden.prompt.join(','), '--max-new', '16', '--eos', '', '--backend', 'cpu', '--tp', '2', '--ranks', 'processes', '--json', ...spec]);
      expect(r.status, r.stderr).toBe(0);
      expect(JSON.parse(r.stdout)).toMatchObject({ tokens: floatGolden.tokens, stats: { backend: 'cpu', tp: 2 } });
    }
  });

  it('a rank process that stalls ends the run: exit 1, one line naming the rank', () => {
    // a rank process left running would hold the pipes open: spawnSync would not return
    const r = runCli(['run', float, '--prompt', '1,2,3', '--max-new', '8', '--backend', 'cpu', '--tp', '2', '--ranks', 'processes', '--tp-timeout', '1000'], { env: { KDTREE_TP_FAULT: '1:collective=12:stall' }, timeoutMs: 60_000 });
    expect(r.status, r.stderr).toBe(1);
    expect(r.stderr).toMatch(/tensor-parallel rank 1 stalled: it did not reach an? (all-reduce|all-gather) \(collective 12\) within 1000 ms/);
    const bad = runCli(['run', float, '--prompt', '1,2', '--max-new', '2', '--backend', 'cpu', '--tp', '2', '--ranks', 'fibers']);
    expect(bad.status).toBe(2);
    expect(bad.stderr).toMatch(/--ranks/);
  });

  it('a rank that throws or stalls ends the run: exit 1, one line naming the rank, no thread left behind', () => {
    const cases: [string, RegExp][] = [
      ['1:collective=12:throw', /tensor-parallel rank 1 threw during a decode step: injected fault at collective 12/],
      ['1:collective=12:stall', /tensor-parallel rank 1 stalled: it did not reach an? (all-reduce|all-gather) \(collective 12\) within 1000 ms/],
    ];
    for (const [fault, message] of cases) {
      const t0 = Date.now();
      // a worker thread left running would keep the process alive: spawnSync would not return
      const r = runCli(['run', float, '--prompt', '1,2,3', '--max-new', '8', '--backend', 'cpu', '--tp', '2', '--tp-timeout', '1000'], { env: { KDTREE_TP_FAULT: fault }, timeoutMs: 60_000 });
      expect(r.status, r.stderr).toBe(1);
      expect(r.stderr).toMatch(message);
      expect(r.stderr).not.toMatch(/internal error|    at /);
      expect(Date.now() - t0).toBeLessThan(20_000);
    }
    const bad = runCli(['run', float, '--prompt', '1,2', '--max-new', '2', '--backend', 'cpu', '--tp', '4']);
    expect(bad.status).toBe(1);
    expect(bad.stderr).toMatch(/q_b_proj\.weight \[48, 32\]: its heads \(num_attention_heads\) \(2\) does not split over 4 ranks/);
  });
});

