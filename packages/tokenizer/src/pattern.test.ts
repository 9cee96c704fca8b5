import { describe, expect, it } from 'vitest';
import { isPythonSpace, KIMI_PATTERN_PARTS, kimiEncodeChunks, kimiPieceRegExp } from './pattern.js';

describe('isPythonSpace', () => {
  it("is exactly Python's str.isspace() set", () => {
    // python3 -c "print([hex(c) for c in range(0x110000) if chr(c).isspace()])"
    const python = [0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000];
    const ours: number[] = [];
    for (let cp = 0; cp < 0x110000; cp++) if (isPythonSpace(cp)) ours.push(cp);
    expect(ours).toEqual(python);
  });
});

describe('kimiEncodeChunks', () => {
  const chunks = (text: string, maxChars: number, maxRun: number) => [...kimiEncodeChunks(text, maxChars, maxRun)];

  it('yields one empty piece for an empty text and the text itself when no limit is reached', () => {
    expect(chunks('', 10, 10)).toEqual(['']);
    expect(chunks('ab cd', 10, 10)).toEqual(['ab cd']);
  });

  it('cuts a run of non-whitespace or of whitespace once it exceeds the limit', () => {
    // Kimi: the run restarts at the cut; a change between space and non-space restarts it too
    expect(chunks('abcdefg', 100, 3)).toEqual(['abc', 'def', 'g']);
    expect(chunks('abc def', 100, 3)).toEqual(['abc def']);
    expect(chunks('ab     cd', 100, 2)).toEqual(['ab  ', '  ', ' cd']);
    expect(chunks('x\u3000\u3000\u3000y', 100, 2)).toEqual(['x\u3000\u3000', '\u3000y']);
    // U+FEFF is not whitespace to Python; U+001C is
    expect(chunks('a\ufeffb', 100, 2)).toEqual(['a\ufeff', 'b']);
    expect(chunks('a\x1c\x1cb', 100, 2)).toEqual(['a\x1c\x1cb']);
  });

  it('cuts the text into chunks of maxChars code points first, then each chunk into runs', () => {
    expect(chunks('abcdefgh', 3, 100)).toEqual(['abc', 'def', 'gh']);
    expect(chunks('abcdef', 3, 100)).toEqual(['abc', 'def']);
    expect(chunks('abcdefgh', 4, 3)).toEqual(['abc', 'd', 'efg', 'h']);
  });

  it('counts code points as Python does: a character outside the BMP is one, a lone surrogate is one', () => {
    expect(chunks('😀😀😀😀', 3, 100)).toEqual(['😀😀😀', '😀']);
    expect(chunks('😀😀😀😀', 100, 2)).toEqual(['😀😀', '😀😀']);
    expect(chunks('\ud800\ud800\ud800', 2, 100)).toEqual(['\ud800\ud800', '\ud800']);
  });
});

describe('kimiPieceRegExp (the training pre-tokenizer)', () => {
  const pieces = (text: string) => [...text.matchAll(kimiPieceRegExp())].map((m) => m[0]);

  it('parses and has the eight alternatives', () => {
    expect(KIMI_PATTERN_PARTS).toHaveLength(8);
    expect(() => kimiPieceRegExp()).not.toThrow();
  });

  // expected pieces: Python regex.findall(KIMI_PAT_STR, text, flags=regex.V1)
  it('splits Han runs from letters, numbers by three, contractions and whitespace as the pattern says', () => {
    expect(pieces('中文English混合')).toEqual(['中文', 'English', '混合']);
    expect(pieces("I'm here, they've gone")).toEqual(["I'm", ' here', ',', " they've", ' gone']);
    expect(pieces('DON\'T 1234567')).toEqual(["DON'T", ' ', '123', '456', '7']);
    expect(pieces('a  b\n\n c')).toEqual(['a', ' ', ' b', '\n\n', ' c']);
    expect(pieces("it'ſ")).toEqual(["it'ſ"]);
  });

  it('covers the whole text: the pieces concatenate to it', () => {
    const text = 'Hello, 世界! 123 tabs\t\tand\r\nlines 😀 e\u0301 ok?  ';
    expect(pieces(text).join('')).toBe(text);
  });
});
