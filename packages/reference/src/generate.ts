/** Greedy decoding and teacher-forced logits on the reference model. */
import { ReferenceUsageError } from './errors.js';
import type { LatentKvCache } from './kv-cache.js';
import type { ReferenceModel } from './model.js';
import { argmax } from './tensor-ops.js';

export interface GreedyOptions {
  maxNew: number;
  /** Stop after emitting any of these (the token is included). Default: the config's eos ids. */
  eos?: readonly number[];
  /** Called with each new token as it is chosen. */
  onToken?: (token: number, index: number) => void;
}

export interface GreedyResult {
  tokens: number[];
  stoppedBy: 'eos' | 'max';
}

/** Greedy decoding: prefill the prompt, then one token at a time through the KV cache. */
export function greedyDecode(model: ReferenceModel, prompt: readonly number[], options: GreedyOptions, cache?: LatentKvCache): GreedyResult {
  if (prompt.length === 0) throw new ReferenceUsageError('the prompt needs at least one token');
  if (!Number.isInteger(options.maxNew) || options.maxNew < 0) throw new ReferenceUsageError(`maxNew must be a non-negative integer, got ${options.maxNew}`);
  const eos = new Set(options.eos ?? model.config.eosTokenIds);
  const kv = cache ?? model.newCache(prompt.length + options.maxNew + 1);
  const tokens: number[] = [];
  if (options.maxNew === 0) return { tokens, stoppedBy: 'max' };
  let logits = model.forward(prompt, kv, { logitRows: [prompt.length - 1] });
  for (;;) {
    const next = argmax(logits);
    tokens.push(next);
    options.onToken?.(next, tokens.length - 1);
    if (eos.has(next)) return { tokens, stoppedBy: 'eos' };
    if (tokens.length >= options.maxNew) return { tokens, stoppedBy: 'max' };
    logits = model.forward([next], kv);
  }
}

/** Logits [T, vocab] of every position of `tokens` in one forward pass (teacher forcing). */
export function teacherForcedLogits(model: ReferenceModel, tokens: readonly number[]): Float32Array {
  return model.forward(tokens, model.newCache(tokens.length));
}
