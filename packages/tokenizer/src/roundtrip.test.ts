import fc from 'fast-check';
import { afterAll, describe, expect, it } from 'vitest';
import { loadTokenizer } from './load.js';
import { SYNTHETIC_8192_DIR } from './test-support/fixtures.js';

const tokenizer = await loadTokenizer(SYNTHETIC_8192_DIR);
afterAll(() => tokenizer.free());
const runs = Number(process.env.KDTREE_FUZZ_RUNS ?? 300);

// well-formed Unicode: any code point but the surrogates (a lone surrogate cannot round-trip in
// any UTF-8 tokenizer; it is encoded as U+FFFD, as Python tiktoken does)
const unicodeText = fc.string({ unit: 'binary', maxLength: 80 });
// mixes of the scripts and whitespace the pattern treats specially, plus special-token text
const pieces = fc.constantFrom('中文', '分词', 'Hello', " it's", ' 123', '4567', '😀', '👨‍👩‍👧', '\n', '\r\n', '\t', '  ', '\u3000', '\u0085', 'é', 'e\u0301', '<|im_end|>', '<think>', '[BOS]', '<|im_', 'Привет', '!?', '...');
const mixedText = fc.array(fc.oneof(pieces, unicodeText), { maxLength: 12 }).map((parts) => parts.join(''));

describe('round trip', () => {
  it('decode(encode(s)) == s for random well-formed Unicode, special tokens parsed or not', () => {
    fc.assert(
      fc.property(fc.oneof(unicodeText, mixedText), (s) => {
        expect(tokenizer.decode(tokenizer.encode(s))).toBe(s);
        expect(tokenizer.decode(tokenizer.encode(s, { allowSpecial: false }))).toBe(s);
      }),
      { numRuns: runs },
    );
  });

  it('special tokens in the text become single special ids only when allowed', () => {
    const im = tokenizer.specialId('<|im_end|>')!;
    expect(tokenizer.encode('a<|im_end|>b')).toContain(im);
    expect(tokenizer.encode('a<|im_end|>b', { allowSpecial: false })).not.toContain(im);
    fc.assert(
      fc.property(mixedText, (s) => {
        for (const id of tokenizer.encode(s, { allowSpecial: false })) expect(id).toBeLessThan(tokenizer.numBaseTokens);
      }),
      { numRuns: runs },
    );
  });

  it('a lone surrogate is encoded as U+FFFD, as Python tiktoken does', () => {
    expect(tokenizer.decode(tokenizer.encode('a\ud800b'))).toBe('a\ufffdb');
  });

  it('the stream decoder never splits a character and adds up to decode()', () => {
    fc.assert(
      fc.property(mixedText, fc.array(fc.integer({ min: 1, max: 4 }), { minLength: 1, maxLength: 10 }), (s, sizes) => {
        const ids = tokenizer.encode(s);
        const stream = tokenizer.streamDecoder();
        const chunks: string[] = [];
        for (let i = 0, k = 0; i < ids.length; k++) {
          const n = sizes[k % sizes.length];
          chunks.push(stream.push(ids.slice(i, i + n)));
          i += n;
        }
        chunks.push(stream.flush());
        expect(chunks.join('')).toBe(s);
        for (const c of chunks) {
          expect(c.includes('\ufffd') && !s.includes('\ufffd'), 'a chunk holds a replacement character').toBe(false);
          expect(/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(c), 'a chunk ends or starts in the middle of a surrogate pair').toBe(false);
        }
      }),
      { numRuns: runs },
    );
  });

  it('the stream decoder holds an incomplete character back until it completes', () => {
    // ranks 0..255 of the synthetic tokenizer are the single bytes, rank = byte value
    const byteIds = [...Buffer.from('中😀')];
    for (const b of byteIds) expect([...tokenizer.tokenBytes(b)]).toEqual([b]);
    const stream = tokenizer.streamDecoder();
    expect(byteIds.map((id) => stream.push(id))).toEqual(['', '', '中', '', '', '', '😀']);
    expect(stream.flush()).toBe('');
    const cut = tokenizer.streamDecoder();
    expect(cut.push([0xe4, 0xb8])).toBe('');
    expect(cut.flush()).toBe('\ufffd');
    expect(() => cut.push(65)).toThrow(/push after flush/);
  });
});
