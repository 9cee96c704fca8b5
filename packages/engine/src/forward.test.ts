/**
 * The engine's forward pass, composed from the addon's ops, against the golden reference layer by
 * layer: the residual stream after every layer and the logits, per row, on transformers'
 * DeepseekV3 fixtures (@kdtree/reference/fixtures/hf) and a synthetic Kimi K2-shaped bundle.
 *
 * Tolerance: the reference stores f32 and sums in f64; the engine stores f32 activations and sums
 * in f32 in another order (bf16 weights are exact: every fixture stores bf16 or INT4). With an f32
 * cache a row differs by f32 rounding compounded over each layer's ~10 dependent ops: ~1e-6 of the
 * row's largest value is seen, and rows are held to 2e-5. A bf16 cache rounds the latent KV to 8 bits of mantissa
 * (relative 2^-9) before attention reads it, so its rows are held to 2e-2; bf16 activations round
 * every GEMM's input the same way (2^-9 relative per element), and are held to the same 2e-2.
 */
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { loadModel } from '@kdtree/reference';
import { createEngine, type Engine } from './index.js';
import { syntheticPair, tempDir, TEST_BACKEND } from './test-support/models.js';

const HF = join(import.meta.dirname, '..', '..', 'reference', 'fixtures', 'hf');

/** Worst per-row error relative to the row's largest reference value, over rows of `width`. */
function worstRowError(ours: Float32Array, ref: Float32Array, width: number): { error: number; row: number } {
  let worst = { error: 0, row: -1 };
  for (let r = 0; r < ref.length / width; r++) {
    let max = 0;
    let diff = 0;
    for (let i = r * width; i < (r + 1) * width; i++) {
      max = Math.max(max, Math.abs(ref[i]));
      diff = Math.max(diff, Math.abs(ours[i] - ref[i]));
    }
    const error = diff / Math.max(max, 1e-30);
    if (!(error <= worst.error)) worst = { error, row: r };
  }
  return worst;
}

async function compare(path: string, tokens: number[], cacheDtype: 'f32' | 'bf16', tolerance: number, activations: 'f32' | 'bf16' = 'f32'): Promise<Float32Array> {
  const { model } = await loadModel(path);
  const hidden: Float32Array[] = [];
  const refLogits = model.forward(tokens, model.newCache(tokens.length), { onLayer: (_, x) => hidden.push(x.slice()) });
  const engine = await createEngine({ model: path, backend: TEST_BACKEND, cacheTokens: 64, cacheDtype, activations, maxBudget: 32 });
  try {
    const ours = await engine.teacherForced(tokens);
    const H = model.config.hiddenSize;
    expect(ours.hidden.length).toBe(model.config.numLayers);
    ours.hidden.forEach((h, l) => {
      const { error, row } = worstRowError(h, hidden[l], H);
      expect(error, `layer ${l}, row ${row}`).toBeLessThanOrEqual(tolerance);
    });
    const { error, row } = worstRowError(ours.logits, refLogits, model.config.vocabSize);
    expect(error, `logits row ${row}`).toBeLessThanOrEqual(tolerance);
    return ours.logits;
  } finally {
    await engine.dispose();
  }
}

const TOKENS = [1, 7, 42, 3, 99, 5, 64, 11, 2, 77, 13, 8, 100, 31, 4, 9, 55];

describe(`engine forward vs the reference, layer by layer (${TEST_BACKEND})`, () => {
  for (const fixture of ['yarn-qlora-moe', 'yarn-qlora-moe-int4', 'rope-noqlora-grouped', 'rope-noqlora-grouped-int4-k25', 'yarn-mscale-dense']) {
    it(`${fixture}: every layer's hidden state and the logits, per row, f32 cache within 2e-5`, async () => {
      await compare(join(HF, fixture), TOKENS.map((t) => t % 128), 'f32', 2e-5);
    });
  }

  it('yarn-qlora-moe-int4 with a bf16 cache: within 2e-2', async () => {
    await compare(join(HF, 'yarn-qlora-moe-int4'), TOKENS.map((t) => t % 128), 'bf16', 2e-2);
  });

  for (const fixture of ['yarn-qlora-moe-int4', 'yarn-mscale-dense']) {
    it(`${fixture} with bf16 activations and a bf16 cache (the cuda defaults): within 2e-2`, async () => {
      const tokens = TOKENS.map((t) => t % 128);
      const bf16 = await compare(join(HF, fixture), tokens, 'bf16', 2e-2, 'bf16');
      // the GEMMs really read bf16 inputs: the logits differ from those of f32 activations
      const f32 = await compare(join(HF, fixture), tokens, 'bf16', 2e-2, 'f32');
      expect(Buffer.from(bf16.buffer).equals(Buffer.from(f32.buffer))).toBe(false);
    });
  }

  describe('a synthetic Kimi K2-shaped bundle (INT4 routed experts)', () => {
    let path: string;
    beforeAll(async () => {
      path = (await syntheticPair(tempDir(), 'small', 3)).target;
    });
    it('small preset: every layer and the logits within 2e-5', async () => {
      await compare(path, TOKENS, 'f32', 2e-5);
    });
    it('small preset, float (bf16 routed experts): every layer and the logits within 2e-5', async () => {
      await compare((await syntheticPair(tempDir(), 'small', 4, undefined)).target, TOKENS, 'f32', 2e-5);
    });
  });
});

