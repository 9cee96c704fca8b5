import { join } from 'node:path';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { afterAll, describe, expect, it } from 'vitest';
import { KdtrWriter, openBundle } from '@kdtree/format';
import { GroupShapeError, MissingPartError } from '@kdtree/quant';
import { parseModelConfig } from './config.js';
import { greedyDecode, teacherForcedLogits } from './generate.js';
import { loadModel } from './load.js';
import { checkQuantizable, GOLDEN_PROMPT, lcgTokens, presetConfigJson, randomWeights, SeededRandom, writeSyntheticModel } from './synthetic.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-synth-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('synthetic models', () => {
  it('are reproducible from a seed, with integer-only randomness', () => {
    const a = new SeededRandom(42);
    const b = new SeededRandom(42);
    const xs = Array.from({ length: 5 }, () => a.normal());
    expect(Array.from({ length: 5 }, () => b.normal())).toEqual(xs);
    const config = parseModelConfig(presetConfigJson('tiny'));
    expect(Array.from(randomWeights(config, 7).get('lm_head.weight')!.subarray(0, 4))).toEqual(Array.from(randomWeights(config, 7).get('lm_head.weight')!.subarray(0, 4)));
  });

  it('write a bundle whose golden tokens and logits the reference reproduces', async () => {
    const path = join(dir, 'tiny.kdtr');
    const golden = await writeSyntheticModel(path, { preset: 'tiny', seed: 1 }, 'test');
    expect(golden.tokens).toHaveLength(golden.max_new);
    const { model, metadata } = await loadModel(path);
    expect(metadata.golden).toEqual(golden);
    expect(greedyDecode(model, GOLDEN_PROMPT, { maxNew: golden.max_new, eos: [] }).tokens).toEqual(golden.tokens);
    const b = await openBundle(path);
    expect((await b.verify()).ok).toBe(true);
    const stored = (await b.readTyped('golden.logits', 'F32')) as Float32Array;
    await b.close();
    const ours = teacherForcedLogits(model, [...GOLDEN_PROMPT, ...golden.tokens]);
    expect(Buffer.from(stored.buffer).equals(Buffer.from(ours.buffer))).toBe(true);
  });

  it('a .qw tensor without a descriptor makes the bundle unloadable, even if the model never reads it', async () => {
    const path = join(dir, 'tiny-stray.kdtr');
    await writeSyntheticModel(path, { preset: 'tiny', seed: 1 }, 'test');
    const src = await openBundle(path);
    const stray = join(dir, 'tiny-stray-qw.kdtr');
    const w = await KdtrWriter.create(stray, { metadata: { ...src.metadata } });
    for (const t of src.tensors) await w.add(t, src.chunks(t.name));
    await w.add({ name: 'extra.weight.qw', dtype: 'I32', shape: [4, 4] }, new Int32Array(16));
    await w.close();
    await src.close();
    await expect(loadModel(stray)).rejects.toThrow(MissingPartError);
    await expect(loadModel(stray)).rejects.toThrow(/'extra\.weight\.qw' has no scales 'extra\.weight\.sc'/);
  });

  it('INT4 bundles record the golden of the dequantized weights and the float golden', async () => {
    const path = join(dir, 'tiny-int4.kdtr');
    const golden = await writeSyntheticModel(path, { preset: 'tiny', seed: 1, quant: 'seed' }, 'test');
    expect(golden.float_tokens).toHaveLength(golden.max_new);
    expect(golden.computed_on).toMatch(/dequantized INT4/);
    const b = await openBundle(path);
    expect(b.has('model.layers.0.mlp.gate_proj.weight.qw')).toBe(true); // seed: dense MLP too
    expect(b.has('model.layers.1.self_attn.q_a_proj.weight')).toBe(true); // attention stays bf16
    await b.close();
    const { model } = await loadModel(path);
    expect(greedyDecode(model, GOLDEN_PROMPT, { maxNew: golden.max_new, eos: [] }).tokens).toEqual(golden.tokens);
  });

  it('carry extra metadata entries, and refuse one that would replace their own', async () => {
    const path = join(dir, 'tiny-extra.kdtr');
    await writeSyntheticModel(path, { preset: 'tiny', seed: 1, extraMetadata: { tokenizer: { schema: 'x/1', files: {} } } }, 'test');
    const b = await openBundle(path);
    expect(b.metadata.tokenizer).toEqual({ schema: 'x/1', files: {} });
    expect((b.metadata.config as { vocab_size: number }).vocab_size).toBe(128);
    await b.close();
    await expect(writeSyntheticModel(join(dir, 'tiny-clash.kdtr'), { preset: 'tiny', seed: 1, extraMetadata: { golden: {} } }, 'test')).rejects.toThrow(/extraMetadata: key 'golden' is written by writeSyntheticModel itself/);
  });

  it('refuse to quantize dimensions that do not divide into groups, naming the tensor', () => {
    const config = parseModelConfig({ ...presetConfigJson('tiny'), moe_intermediate_size: 40 });
    expect(() => checkQuantizable(config, 'kimi-k2')).toThrow(GroupShapeError);
    expect(() => checkQuantizable(config, 'kimi-k2')).toThrow(/model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight.*K = 40/);
  });
});

describe('lcgTokens', () => {
  it('draws the recurrence x = 1103515245 x + 12345 mod 2^32 (checked in exact integers), ids modulo the vocabulary', () => {
    for (const [seed, vocab] of [[1, 163840], [3, 163840], [0xdeadbeef, 257]] as const) {
      let x = BigInt(seed);
      const want = Array.from({ length: 200 }, () => Number((x = (1103515245n * x + 12345n) % 2n ** 32n) % BigInt(vocab)));
      expect(lcgTokens(200, seed, vocab)).toEqual(want);
    }
    // the engine benchmark's 64-token prompt starts so (its recorded outputs were decoded from it)
    expect(lcgTokens(5, 1, 163840)).toEqual([65190, 110823, 91284, 72509, 155442]);
  });
});
