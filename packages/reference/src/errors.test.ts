import { describe, expect, it } from 'vitest';
import * as reference from './index.js';
import { ConfigError, GoldenReferenceError, ReferenceUsageError, WeightError } from './errors.js';

describe('errors', () => {
  it('share the base class GoldenReferenceError, which does not shadow the global ReferenceError', () => {
    for (const error of [new ConfigError('missing', 'hidden_size', 'config.json'), new WeightError('bad shape', 'lm_head.weight', 'm.kdtr'), new ReferenceUsageError('token 9 out of range')]) {
      expect(error).toBeInstanceOf(GoldenReferenceError);
      expect(error).not.toBeInstanceOf(globalThis.ReferenceError);
      expect(error.code).toMatch(/^KDTREE_/);
    }
    expect('ReferenceError' in reference).toBe(false);
    expect(new ConfigError('missing', 'hidden_size', 'config.json').message).toBe('config.json: hidden_size: missing');
  });
});
