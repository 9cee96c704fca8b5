/**
 * The DFlash drafter against the public PyTorch implementation (z-lab/dflash model.py on
 * transformers' Qwen3 classes, float64), on the tiny random drafters of
 * tools/fixtures/gen_dflash_fixtures.py paired with the DeepseekV3 targets of fixtures/hf.
 *
 * Tolerance. The oracle runs in float64 except where transformers' Qwen3 code computes in float32
 * (RMSNorm, RoPE tables, softmax); ours stores every activation in f32 and accumulates in f64.
 * Each stored value is off by at most u = 2^-24 relative; along the drafter's longest path (fc,
 * hidden_norm, then per layer norm, projection, head norm, RoPE, softmax, o_proj, residual, norm,
 * MLP) some 12 f32 roundings per layer stack up, each amplified at most by the layer's gain (a
 * few units for these weights; 8 is taken), and the oracle's own f32 steps are of the same kind:
 * 2^-24 x 12 x layers x 8 bounds the logit error relative to the row's largest logit (1.1e-5 for
 * 2 layers). What is measured is printed; it is some 50 times smaller. The same bound holds when
 * the drafter is fed our target's taps instead of the oracle's (the taps agree to a few ulps).
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { readNpy } from '@kdtree/format';
import { targetTaps } from './dflash-decode.js';
import { loadDflashModel, loadModel } from './load.js';
import { argmax, top2Margin } from './tensor-ops.js';

const ROOT = join(import.meta.dirname, '..', 'fixtures', 'dflash');
const HF = join(import.meta.dirname, '..', 'fixtures', 'hf');
const FIXTURES = existsSync(ROOT) ? readdirSync(ROOT, { withFileTypes: true }).filter((d) => d.isDirectory()).map((d) => d.name).sort() : [];
const U = 2 ** -24;
const rowTolerance = (layers: number) => U * 12 * layers * 8; // of the row's largest |logit|; see above

interface Golden {
  format: string;
  version: number;
  target: string;
  sequence: number[];
  prompt_length: number;
  rounds: { start: number; context: [number, number]; positions: [number, number]; block_ids: number[]; draft_top1: number[]; logits: string }[];
  last_hidden_state_is_normed: boolean;
  hf: { inv_freq: number[]; attention_scaling: number; softmax_scale: number; rms_norm_eps: number; head_norm_eps: number; target_layer_ids: number[]; mask_token_id: number; block_size: number; attn_implementation: string };
}

async function f32(path: string): Promise<{ data: Float32Array; shape: number[] }> {
  const a = await readNpy(path);
  return { data: new Float32Array(a.data.slice().buffer), shape: a.shape };
}

/** max |a - b| / max |b| per row of width `width` */
function rowErrors(a: Float32Array, b: Float32Array, width: number): number[] {
  const rows = b.length / width;
  return Array.from({ length: rows }, (_, r) => {
    let maxRef = 0;
    let maxDiff = 0;
    for (let i = r * width; i < (r + 1) * width; i++) {
      maxRef = Math.max(maxRef, Math.abs(b[i]));
      maxDiff = Math.max(maxDiff, Math.abs(a[i] - b[i]));
    }
    return maxDiff / maxRef;
  });
}

describe('DFlash drafter vs the public PyTorch implementation', () => {
  // the fixtures are committed: a missing one fails here rather than leaving the loop below empty
  it(`has both fixtures (top-level and nested block_size) in ${ROOT} (made by tools/fixtures/gen_dflash_fixtures.py)`, () => {
    expect(FIXTURES).toEqual(['rope-b4', 'yarn-b8-nested']);
  });

  for (const name of FIXTURES) {
    it(`${name}: taps, per-depth logits of every round within 2^-24 x 12 x layers x 8 of the row's max`, async () => {
      const dir = join(ROOT, name);
      const golden = JSON.parse(readFileSync(join(dir, 'golden.json'), 'utf8')) as Golden;
      expect(golden.format).toBe('kdtree-dflash-fixture');
      expect(golden.version).toBe(1);
      const { model: target } = await loadModel(join(HF, golden.target));
      const { model: drafter, config } = await loadDflashModel(dir, target);
      const ROW_TOLERANCE = rowTolerance(config.numLayers);
      // the config as the public model read it, and the constants transformers derived
      expect(config.targetLayerIds).toEqual(golden.hf.target_layer_ids);
      expect(config.maskTokenId).toBe(golden.hf.mask_token_id);
      expect(config.blockSize).toBe(golden.hf.block_size);
      expect(config.rmsNormEps).toBe(golden.hf.rms_norm_eps);
      expect(config.rmsNormEps).toBe(golden.hf.head_norm_eps);
      expect(drafter.scale).toBeCloseTo(golden.hf.softmax_scale, 12);
      expect(drafter.rope.attentionFactor).toBeCloseTo(golden.hf.attention_scaling, 12);
      drafter.rope.invFreq.forEach((f, i) => expect(Math.abs(f - golden.hf.inv_freq[i]) / golden.hf.inv_freq[i]).toBeLessThan(1e-6)); // f32 there

      // our target's taps over the sequence (teacher-forced) vs transformers' hidden_states
      const seq = golden.sequence;
      const H = target.config.hiddenSize;
      const width = drafter.contextWidth;
      const context = await f32(join(dir, 'context.npy'));
      expect(context.shape).toEqual([seq.length, width]);
      expect(golden.last_hidden_state_is_normed).toBe(true); // what targetTaps assumes of a tap at the last layer
      const taps = targetTaps(target, config.targetLayerIds, seq.length);
      target.forward(seq, target.newCache(seq.length), { logitRows: [0], onLayer: taps.onLayer });
      const tapErrors = rowErrors(taps.hidden, context.data, H);
      expect(Math.max(...tapErrors), 'taps').toBeLessThanOrEqual(1e-4);

      // the rounds, fed the oracle's own context rows (only the drafter compared), then our taps
      const V = config.vocabSize;
      const B = config.blockSize;
      const measured: number[] = [];
      for (const [source, rows] of [['oracle context', context.data], ['our taps', taps.hidden]] as const) {
        const cache = drafter.newCache();
        for (const [r, round] of golden.rounds.entries()) {
          const [from, to] = round.context;
          expect(cache.length, `round ${r}: cache length`).toBe(from);
          expect(round.block_ids).toEqual([seq[round.start], ...Array.from({ length: B - 1 }, () => config.maskTokenId)]);
          const { logits } = drafter.draft(cache, rows.slice(from * width, to * width), to - from, round.block_ids[0]);
          expect(cache.length).toBe(round.start);
          const hf = await f32(join(dir, round.logits));
          expect(hf.shape).toEqual([B - 1, V]);
          const errors = rowErrors(logits, hf.data, V);
          measured.push(...errors);
          errors.forEach((e, d) => expect(e, `${source}, round ${r} depth ${d + 1}`).toBeLessThanOrEqual(ROW_TOLERANCE));
          // top-1 per depth wherever the oracle's margin exceeds what the tolerance allows
          for (let d = 0; d < B - 1; d++) {
            let maxRef = 0;
            for (let v = 0; v < V; v++) maxRef = Math.max(maxRef, Math.abs(hf.data[d * V + v]));
            expect(argmax(hf.data, d * V, V)).toBe(round.draft_top1[d]);
            if (top2Margin(hf.data, d * V, V) > 2 * ROW_TOLERANCE * maxRef) expect(argmax(logits, d * V, V), `${source}, round ${r} depth ${d + 1} top-1`).toBe(round.draft_top1[d]);
          }
        }
      }
      console.log(`${name}: max per-row logit error ${Math.max(...measured).toExponential(2)} (bound ${ROW_TOLERANCE.toExponential(2)}), taps ${Math.max(...tapErrors).toExponential(2)}`);
    });
  }
});
