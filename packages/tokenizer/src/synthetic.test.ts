import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { trainBpe } from './bpe-train.js';
import { parseTiktokenRanks } from './ranks.js';
import { KIMI_SPECIAL_OFFSETS, MIN_SYNTHETIC_VOCAB, syntheticCorpus, syntheticTokenizerFiles } from './synthetic.js';
import { SYNTHETIC_8192_DIR } from './test-support/fixtures.js';
import { Tokenizer } from './tokenizer.js';

describe('syntheticTokenizerFiles', () => {
  it('reproduces the committed 8192-token tokenizer byte for byte (training is deterministic)', () => {
    const files = syntheticTokenizerFiles({ vocabSize: 8192 });
    for (const name of ['tiktoken.model', 'tokenizer_config.json', 'chat_template.jinja'] as const) {
      expect(files[name] === readFileSync(join(SYNTHETIC_8192_DIR, name), 'utf8'), `${name} differs from fixtures/synthetic-8192: regenerate it with tools/fixtures/write_synthetic_tokenizer.mjs and the golden vectors with gen_tokenizer_fixtures.py`).toBe(true);
    }
  });

  it("fits the model's vocabulary exactly, special tokens at the top in Kimi's order", () => {
    for (const vocabSize of [MIN_SYNTHETIC_VOCAB, 1000, 4096]) {
      const t = new Tokenizer(syntheticTokenizerFiles({ vocabSize }));
      expect(t.vocabSize).toBe(vocabSize);
      expect(t.numBaseTokens).toBe(vocabSize - 256);
      for (const s of KIMI_SPECIAL_OFFSETS) expect(t.specialId(s.content), s.content).toBe(vocabSize - 256 + s.offset);
      expect(t.decode(t.encode('Hello, 世界! 123'))).toBe('Hello, 世界! 123');
      t.free();
    }
    // 512: the 256 byte tokens and the 256 special slots, no merges
    const bytesOnly = new Tokenizer(syntheticTokenizerFiles({ vocabSize: 512 }));
    expect(bytesOnly.encode('hi')).toEqual([104, 105]);
  });

  it('refuses a vocabulary with no room for bytes and special slots, or more than the corpus supports', () => {
    expect(() => syntheticTokenizerFiles({ vocabSize: 128 })).toThrow(/vocabSize: a vocabulary of 128 cannot hold a Kimi-style tokenizer; expected an integer >= 512 \(256 byte tokens \+ 256 special slots\)/);
    expect(() => syntheticTokenizerFiles({ vocabSize: 511 })).toThrow(/>= 512/);
    expect(() => syntheticTokenizerFiles({ vocabSize: 100_000 })).toThrow(/the corpus supports only \d+ ranks, 99744 were asked for/);
  });
});

describe('trainBpe', () => {
  const corpus = syntheticCorpus();
  it('builds each new token from two earlier ones, in merge order, with no duplicates', () => {
    const tokens = trainBpe(corpus, 1500);
    expect(tokens).toHaveLength(1500);
    const rank = new Map(tokens.map((t, i) => [Buffer.from(t).toString('latin1'), i]));
    expect(rank.size).toBe(1500);
    for (let i = 256; i < tokens.length; i++) {
      const t = tokens[i];
      const splits = [...Array(t.length - 1).keys()].map((k) => [rank.get(Buffer.from(t.subarray(0, k + 1)).toString('latin1')), rank.get(Buffer.from(t.subarray(k + 1)).toString('latin1'))]);
      expect(splits.some(([a, b]) => a !== undefined && b !== undefined && a < i && b < i), `token ${i}`).toBe(true);
    }
  });

  it('is a prefix of a longer training (the same merges first) and the written file parses back', () => {
    const short = trainBpe(corpus, 600);
    const long = trainBpe(corpus, 900);
    expect(long.slice(0, 600)).toEqual(short);
    expect(parseTiktokenRanks(syntheticTokenizerFiles({ vocabSize: 600 + 256 })['tiktoken.model'])).toEqual(short);
  });

  it('merges the most frequent pair first', () => {
    expect(Buffer.from(trainBpe('aab aab aab ab', 257)[256]).toString()).toBe('ab');
    expect(() => trainBpe('ab', 200)).toThrow(/numRanks must be an integer >= 256/);
  });
});
