/**
 * The reference against HuggingFace transformers' DeepseekV3ForCausalLM (float64), on tiny random
 * models made by tools/fixtures/gen_deepseek_fixtures.py: max |logit - hf| / max |hf| <= 1e-4 at
 * every position, and the same greedy tokens wherever the top-2 margin exceeds 1e-3.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { readNpy } from '@kdtree/format';
import { greedyDecode, teacherForcedLogits } from './generate.js';
import { loadModel } from './load.js';
import { ropeTables, softmaxScale } from './rope.js';
import { argmax, top2Margin } from './tensor-ops.js';

const ROOT = join(import.meta.dirname, '..', 'fixtures', 'hf');
const FIXTURES = readdirSync(ROOT, { withFileTypes: true }).filter((d) => d.isDirectory()).map((d) => d.name).sort();

interface Golden {
  prompt: number[];
  tokens: number[];
  max_new: number;
  hf: { inv_freq: number[]; attention_scaling: number; softmax_scale: number; mla_norm_eps: Record<string, number>; rms_norm_eps: number };
}

describe('golden forward vs transformers DeepseekV3', () => {
  it('has the float and INT4 fixtures', () => {
    expect(FIXTURES).toEqual(['rope-noqlora-grouped', 'rope-noqlora-grouped-int4-k25', 'yarn-mscale-dense', 'yarn-qlora-moe', 'yarn-qlora-moe-int4']);
  });

  for (const name of FIXTURES) {
    it(`${name}: logits within 1e-4 of transformers, same greedy tokens`, async () => {
      const dir = join(ROOT, name);
      const golden = JSON.parse(readFileSync(join(dir, 'golden.json'), 'utf8')) as Golden;
      const { model, config } = await loadModel(dir);
      // the derived constants transformers used
      const rope = ropeTables(config);
      const invFreqError = Math.max(...Array.from(rope.invFreq, (f, i) => Math.abs(f - golden.hf.inv_freq[i]) / golden.hf.inv_freq[i]));
      expect(invFreqError).toBeLessThan(1e-6); // transformers computes them in f32
      expect(rope.attentionFactor).toBeCloseTo(golden.hf.attention_scaling, 12);
      expect(softmaxScale(config)).toBeCloseTo(golden.hf.softmax_scale, 12);
      expect(config.rmsNormEps).toBe(golden.hf.rms_norm_eps);
      for (const eps of Object.values(golden.hf.mla_norm_eps)) expect(config.mlaNormEps).toBe(eps);

      const hf = await readNpy(join(dir, 'logits.npy'));
      const hfLogits = new Float32Array(hf.data.slice().buffer);
      const seq = [...golden.prompt, ...golden.tokens];
      expect(hf.shape).toEqual([seq.length, config.vocabSize]);
      const ours = teacherForcedLogits(model, seq);
      const V = config.vocabSize;
      for (let t = 0; t < seq.length; t++) {
        let maxHf = 0;
        let maxDiff = 0;
        for (let v = 0; v < V; v++) {
          maxHf = Math.max(maxHf, Math.abs(hfLogits[t * V + v]));
          maxDiff = Math.max(maxDiff, Math.abs(ours[t * V + v] - hfLogits[t * V + v]));
        }
        expect(maxDiff / maxHf, `position ${t}`).toBeLessThanOrEqual(1e-4);
      }
      const { tokens } = greedyDecode(model, golden.prompt, { maxNew: golden.max_new, eos: [] });
      for (let i = 0; i < golden.tokens.length; i++) {
        const row = golden.prompt.length - 1 + i;
        if (top2Margin(hfLogits, row * V, V) > 1e-3) expect(tokens[i], `token ${i}`).toBe(golden.tokens[i]);
        expect(argmax(hfLogits, row * V, V)).toBe(golden.tokens[i]);
      }
    });
  }
});
