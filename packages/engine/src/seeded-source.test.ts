import { describe, expect, it } from 'vitest';
import { presetConfigJson } from '@kdtree/reference';
import { createEngine, SeededSource } from './index.js';
import { TEST_BACKEND } from './test-support/models.js';

describe('SeededSource: weights made in memory', () => {
  const json = presetConfigJson('small');

  it('reads the same rows whole or selected, repeats rows and experts with its periods, and INT4 only where its scheme says', async () => {
    const s = new SeededSource(json, { seed: 5, distinctRows: 8, distinctExperts: 2 });
    const whole = await s.readBf16('model.layers.0.self_attn.q_b_proj.weight', [192, 128]);
    const some = await s.readBf16('model.layers.0.self_attn.q_b_proj.weight', [192, 128], [3, 17, 40]);
    expect(some.bits).toEqual(Uint16Array.from([3, 17, 40].flatMap((r) => Array.from(whole.bits.subarray(r * 128, (r + 1) * 128)))));
    expect(whole.bits.subarray(0, 128)).toEqual(whole.bits.subarray(8 * 128, 9 * 128));
    expect(whole.bits.subarray(0, 128)).not.toEqual(whole.bits.subarray(128, 256));
    const e0 = await s.readInt4('model.layers.1.mlp.experts.0.up_proj.weight', [64, 256]);
    const e2 = await s.readInt4('model.layers.1.mlp.experts.2.up_proj.weight', [64, 256]);
    const e1 = await s.readInt4('model.layers.1.mlp.experts.1.up_proj.weight', [64, 256]);
    expect(e2.qw).toEqual(e0.qw);
    expect(e1.qw).not.toEqual(e0.qw);
    expect(s.int4('model.layers.1.mlp.experts.3.gate_proj.weight')).toMatchObject({ shape: [64, 256], group_size: 32 });
    expect(s.int4('model.layers.1.mlp.shared_experts.gate_proj.weight')).toBeUndefined();
    expect(new SeededSource(json, { seed: 5, quant: 'seed' }).int4('model.layers.0.mlp.down_proj.weight')).toMatchObject({ shape: [256, 512] });
  });

  it('loads on the engine: finite logits, and DDTree equals greedy', async () => {
    const engine = await createEngine({ model: new SeededSource(json, { seed: 9 }), backend: TEST_BACKEND, cacheTokens: 128, maxBudget: 16 });
    try {
      const { logits } = await engine.teacherForced([1, 2, 3]);
      expect(logits.every(Number.isFinite)).toBe(true);
      const greedy = await engine.complete([1, 2, 3], { maxNew: 12, eos: [] });
      const tree = await engine.complete([1, 2, 3], { maxNew: 12, eos: [], spec: 'ddtree', drafter: 'ngram', budget: 8, depth: 3 });
      expect(tree.tokens).toEqual(greedy.tokens);
      expect(new Set(greedy.tokens).size).toBeGreaterThan(1);
    } finally {
      await engine.dispose();
    }
  });
});
