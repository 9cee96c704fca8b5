import { mkdtempSync, rmSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { openBundle, writeSafetensors } from '@kdtree/format';
import {
  dflashConfigJson,
  dflashWeightSpecs,
  loadDflashModel,
  loadModel,
  parseDflashConfig,
  presetConfigJson,
  parseModelConfig,
  randomDflashWeights,
  writeDflashDirectory,
  writeSyntheticModel,
} from '@kdtree/reference';
import { runCli } from './test-support/run-cli.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-dflash-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const target = join(dir, 'tiny.kdtr');
const drafterDir = join(dir, 'tiny-dflash');
const tiny = parseModelConfig(presetConfigJson('tiny'), 'tiny');
const drafterJson = dflashConfigJson(tiny, { blockSize: 4, nestedBlockSize: true });
const drafterConfig = parseDflashConfig(drafterJson);

beforeAll(async () => {
  await writeSyntheticModel(target, { preset: 'tiny', seed: 1 }, 'test');
  await writeDflashDirectory(drafterDir, drafterJson, randomDflashWeights(drafterConfig, 5));
});

describe('kdtree import / inspect of a DFlash drafter', () => {
  it('imports the directory as a drafter that fits its target, and inspect shows its taps, block and mask', async () => {
    const out = join(dir, 'drafter.kdtr');
    const imp = runCli(['import', drafterDir, '-o', out, '--target', target, '--json']);
    expect(imp.stderr).toBe('');
    expect(imp.status).toBe(0);
    const expected = { kind: 'dflash', block_size: 4, depths: 3, target_layer_ids: [0, 1], num_target_layers: 2, mask_token_id: 126, hidden_size: 64, vocab_size: 128, layers: 2 };
    expect(JSON.parse(imp.stdout)).toMatchObject({ output: out, tensors: dflashWeightSpecs(drafterConfig).length, drafter: expected });
    const bundle = await openBundle(out);
    try {
      expect(bundle.metadata).toMatchObject({ drafter: expected, config: drafterJson });
    } finally {
      await bundle.close();
    }
    const line = 'drafter    dflash, block_size 4 (depths 1..3), target layers [0, 1] of 2, mask token 126, 2 layers, hidden 64, vocab 128';
    const shown = runCli(['inspect', out]);
    expect(shown.status).toBe(0);
    expect(shown.stdout).toContain(line);
    expect(runCli(['inspect', drafterDir]).stdout).toContain(line);
    expect(JSON.parse(runCli(['inspect', out, '--json']).stdout).drafter).toEqual(expected);
    expect(JSON.parse(runCli(['inspect', target, '--json']).stdout).drafter).toBeNull();
    // the bundle drafts as the directory does (the reference reads either)
    const { model } = await loadModel(target);
    const fromBundle = await loadDflashModel(out, model);
    const fromDir = await loadDflashModel(drafterDir, model);
    const context = Float32Array.from({ length: 2 * fromDir.model.contextWidth }, (_, i) => Math.cos(i));
    expect(fromBundle.model.draft(fromBundle.model.newCache(), context, 2, 9).logits).toEqual(fromDir.model.draft(fromDir.model.newCache(), context, 2, 9).logits);
  });

  it('says on the one line what does not fit the target', async () => {
    const other = join(dir, 'small.json');
    writeFileSync(other, JSON.stringify(presetConfigJson('small')));
    const r = runCli(['import', drafterDir, '-o', join(dir, 'no.kdtr'), '--target', other, '-q']);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(
      `kdtree: error: ${join(drafterDir, 'config.json')} does not fit ${other}: hidden_size 64 != the target's 256 (the drafter reads the target's hidden states); vocab_size 128 != the target's 512 (the drafter uses the target's embed_tokens and lm_head); num_target_layers 2 != the target's 4 layers (it was trained for another target)\n`,
    );
  });

  it('refuses a drafter whose config or tensors are wrong, naming the field or tensor', async () => {
    const bad = join(dir, 'bad-dflash');
    await writeDflashDirectory(bad, drafterJson, randomDflashWeights(drafterConfig, 5));
    writeFileSync(join(bad, 'config.json'), JSON.stringify({ ...drafterJson, dflash_config: { target_layer_ids: [0, 1], block_size: 4 } }));
    const noMask = runCli(['import', bad, '-o', join(dir, 'bad.kdtr'), '-q']);
    expect(noMask.status).toBe(1);
    expect(noMask.stderr).toMatch(/config.json: dflash_config.mask_token_id: missing/);

    writeFileSync(join(bad, 'config.json'), JSON.stringify(drafterJson));
    unlinkSync(join(bad, 'model.safetensors'));
    const weights = randomDflashWeights(drafterConfig, 5);
    const specs = dflashWeightSpecs(drafterConfig).filter((s) => s.name !== 'layers.1.self_attn.k_norm.weight');
    await writeSafetensors(join(bad, 'model.safetensors'), specs.map((s) => ({ name: s.name, dtype: 'F32' as const, shape: s.shape, data: new Uint8Array(weights.get(s.name)!.buffer) })));
    const missing = runCli(['import', bad, '-o', join(dir, 'bad.kdtr'), '-q']);
    expect(missing.status).toBe(1);
    expect(missing.stderr).toMatch(/tensor 'layers.1.self_attn.k_norm.weight': missing/);
  });

  it('kdtree run --drafter dflash:BUNDLE drafts greedy-exactly with chain and ddtree (depth block_size - 1 by default), and refuses a drafter for another target', async () => {
    const bundle = join(dir, 'run-drafter.kdtr');
    expect(runCli(['import', drafterDir, '-o', bundle, '--target', target, '-q']).status).toBe(0);
    const prompt = [3, 1, 4, 1, 5, 9];
    const greedy = runCli(['run', target, '--prompt', prompt.join(','), '--max-new', '12', '--eos', '', '--backend', 'cpu', '--json']);
    expect(greedy.status, greedy.stderr).toBe(0);
    const tokens = JSON.parse(greedy.stdout).tokens;
    for (const spec of ['chain', 'ddtree']) {
      const r = runCli(['run', target, '--prompt', prompt.join(','), '--max-new', '12', '--eos', '', '--backend', 'cpu', '--spec', spec, '--drafter', `dflash:${bundle}`, '--budget', '5', '--json', '--trace']);
      expect(r.status, r.stderr).toBe(0);
      const out = JSON.parse(r.stdout);
      expect(out.tokens).toEqual(tokens);
      expect(out.stats.drafter).toBe(`dflash:${bundle}`);
      expect(out.steps[0].draft_top1).toHaveLength(3);
    }
    // a block of 4 drafts depths 1..3: deeper is the flag's error, naming where the bound comes from
    const deep = runCli(['run', target, '--prompt', prompt.join(','), '--max-new', '4', '--backend', 'cpu', '--spec', 'ddtree', '--drafter', `dflash:${bundle}`, '--depth', '4']);
    expect(deep.status).toBe(2);
    expect(deep.stderr).toMatch(new RegExp(`--depth: expected an integer in \\[1, 3\\] \\(the deepest draft of dflash:${bundle.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}\\), got 4`));
    const small = join(dir, 'small-dflash');
    const smallJson = dflashConfigJson(parseModelConfig(presetConfigJson('small'), 'small'));
    await writeDflashDirectory(small, smallJson, randomDflashWeights(parseDflashConfig(smallJson), 6));
    const refused = runCli(['run', target, '--prompt', '1,2', '--max-new', '4', '--backend', 'cpu', '--spec', 'ddtree', '--drafter', `dflash:${small}`]);
    expect(refused.status).toBe(1);
    expect(refused.stderr).toMatch(new RegExp(`${small} does not fit the target model: hidden_size 256 != the target's 64`));
  });

  it('refuses --target for a model that is not a drafter', () => {
    const r = runCli(['import', target, '-o', join(dir, 'copy.kdtr'), '--target', target]);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/--target is for DFlash drafters/);
  });
});

describe('kdtree gen-model --structure walk --dflash DIR', () => {
  it('writes a walk target and a DFlash drafter that predicts it: run --drafter dflash: is greedy-exact and accepts several tokens a step', () => {
    const walkTarget = join(dir, 'walk.kdtr');
    const walkDrafter = join(dir, 'walk-dflash');
    const gen = runCli(['gen-model', '--preset', 'small', '--structure', 'walk', '--quant', 'kimi-k2', '-o', walkTarget, '--dflash', walkDrafter, '--dflash-block', '6', '--json']);
    expect(gen.status, gen.stderr).toBe(0);
    expect(JSON.parse(gen.stdout)).toMatchObject({ structure: 'walk', dflash: { output: walkDrafter, block_size: 6 } });
    const inspect = JSON.parse(runCli(['inspect', walkDrafter, '--json']).stdout);
    expect(inspect.drafter).toMatchObject({ kind: 'dflash', block_size: 6, depths: 5 });
    const args = ['run', walkTarget, '--prompt', '1,2,3', '--max-new', '24', '--eos', '', '--backend', 'cpu', '--json'];
    const greedy = JSON.parse(runCli(args).stdout);
    for (const spec of ['chain', 'ddtree']) {
      const r = runCli([...args, '--spec', spec, '--drafter', `dflash:${walkDrafter}`, '--budget', spec === 'chain' ? '5' : '12']);
      expect(r.status, r.stderr).toBe(0);
      const out = JSON.parse(r.stdout);
      expect(out.tokens).toEqual(greedy.tokens);
      expect(out.stats.mean_accepted_length, spec).toBeGreaterThan(2);
    }
  });

  it('refuses --dflash without --structure walk, --dflash-block without --dflash, and a drafter directory that exists', () => {
    const out = join(dir, 'refused.kdtr');
    const random = runCli(['gen-model', '--preset', 'tiny', '-o', out, '--dflash', join(dir, 'refused-dflash')]);
    expect(random.status).toBe(2);
    expect(random.stderr).toMatch(/--dflash needs --structure walk/);
    const block = runCli(['gen-model', '--preset', 'tiny', '-o', out, '--structure', 'walk', '--dflash-block', '4']);
    expect(block.status).toBe(2);
    expect(block.stderr).toMatch(/--dflash-block needs --dflash/);
    const exists = runCli(['gen-model', '--preset', 'tiny', '-o', out, '--structure', 'walk', '--dflash', drafterDir]);
    expect(exists.status).toBe(2);
    expect(exists.stderr).toMatch(/already exists and is not empty/);
    const same = runCli(['gen-model', '--preset', 'tiny', '-o', out, '--structure', 'walk', '--dflash', out]);
    expect(same.status).toBe(2);
    expect(same.stderr).toMatch(/--dflash and -o name the same path/);
  });
});
