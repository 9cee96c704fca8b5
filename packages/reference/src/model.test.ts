import { beforeAll, describe, expect, it } from 'vitest';
import { greedyDecode, teacherForcedLogits } from './generate.js';
import type { ReferenceModel } from './model.js';
import { tinyModel } from './test-support/tiny-model.js';

let model: ReferenceModel;
beforeAll(async () => {
  model = await tinyModel(3);
});

const sameBits = (a: Float32Array, b: Float32Array) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength));

describe('reference forward', () => {
  it('incremental decode through the KV cache gives the same logits as a full recompute, bit for bit', () => {
    const tokens = [1, 7, 42, 3, 99, 5, 64, 11, 17, 23];
    const V = model.config.vocabSize;
    const full = teacherForcedLogits(model, tokens);
    const cache = model.newCache(tokens.length);
    const prefill = model.forward(tokens.slice(0, 4), cache);
    expect(sameBits(prefill, full.subarray(0, 4 * V))).toBe(true);
    for (let t = 4; t < tokens.length; t++) {
      const step = model.forward([tokens[t]], cache);
      expect(sameBits(step, full.subarray(t * V, (t + 1) * V)), `position ${t}`).toBe(true);
    }
  });

  it('is batch-invariant: a row does not depend on the other rows of the call', () => {
    const V = model.config.vocabSize;
    const a = teacherForcedLogits(model, [5, 9, 2]);
    const b = teacherForcedLogits(model, [5, 9, 2, 77, 31, 8]);
    expect(sameBits(a, b.subarray(0, 3 * V))).toBe(true);
  });

  it('greedy decoding stops at eos (included) and at maxNew', () => {
    const free = greedyDecode(model, [1, 2, 3], { maxNew: 6, eos: [] });
    expect(free.tokens).toHaveLength(6);
    expect(free.stoppedBy).toBe('max');
    const stop = greedyDecode(model, [1, 2, 3], { maxNew: 6, eos: [free.tokens[2]] });
    expect(stop.tokens).toEqual(free.tokens.slice(0, 3));
    expect(stop.stoppedBy).toBe('eos');
  });

  it('rejects tokens outside the vocabulary and cache overflow', () => {
    expect(() => model.forward([128], model.newCache(4))).toThrow(/token 128 is outside the vocabulary \[0, 128\)/);
    expect(() => model.forward([1, 2, 3], model.newCache(2))).toThrow(/KV cache overflow: 0 tokens \+ 3 new > capacity 2/);
  });
});
