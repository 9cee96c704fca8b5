/**
 * Kimi's pre-tokenizer: the `pat_str` of `tokenization_kimi.py` and the splitting its `encode` does
 * before the pattern runs. See docs/tokenizer.md.
 */

/**
 * The eight alternatives of Kimi's `pat_str`, joined with `|`. The tiktoken engine (Rust
 * fancy-regex, the same in Python `tiktoken` and in the `tiktoken` npm package) runs it unchanged.
 * `[...&&[^\p{Han}]]` is a class intersection: letters other than Han ideographs, so that a Han run
 * is always its own piece (the first alternative) and never glued to Latin letters.
 */
export const KIMI_PATTERN_PARTS: readonly string[] = [
  String.raw`[\p{Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
];

export const KIMI_PAT_STR: string = KIMI_PATTERN_PARTS.join('|');

/** tiktoken's Rust core panics on longer inputs, so Kimi encodes at most this many characters at once. */
export const MAX_ENCODE_CHARS = 400_000;
/**
 * Kimi splits runs of whitespace or of non-whitespace longer than this: the pattern's backtracking
 * on one enormous run is quadratic (openai/tiktoken issue 195).
 */
export const MAX_RUN_CHARS = 25_000;

/**
 * Python's `str.isspace()` for one code point: general category Zs or bidirectional class WS, B or
 * S. Kimi's run splitting uses it, so it must be this set, not JS `\s` (which adds U+FEFF and lacks
 * U+0085 and U+001C..U+001F).
 */
export function isPythonSpace(cp: number): boolean {
  if (cp <= 0x20) return cp === 0x20 || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f);
  if (cp < 0x85) return false;
  return (
    cp === 0x85 ||
    cp === 0xa0 ||
    cp === 0x1680 ||
    (cp >= 0x2000 && cp <= 0x200a) ||
    cp === 0x2028 ||
    cp === 0x2029 ||
    cp === 0x202f ||
    cp === 0x205f ||
    cp === 0x3000
  );
}

/**
 * The pieces Kimi's `encode` hands to tiktoken, in order: the text cut every 400,000 code points
 * (Python counts code points, so a character outside the BMP counts once), then each chunk cut
 * wherever a run of whitespace or of non-whitespace would exceed 25,000 code points. Yields `''`
 * for an empty text, as Python does (encoding it gives no ids).
 */
export function* kimiEncodeChunks(text: string, maxChars = MAX_ENCODE_CHARS, maxRun = MAX_RUN_CHARS): Generator<string> {
  // UTF-16 offsets of each 400,000-code-point chunk
  let chunkStart = 0;
  let count = 0;
  let i = 0;
  while (i < text.length) {
    if (count === maxChars) {
      yield* splitRuns(text.slice(chunkStart, i), maxRun);
      chunkStart = i;
      count = 0;
    }
    i += codePointWidth(text, i);
    count++;
  }
  if (chunkStart < text.length || text.length === 0) yield* splitRuns(text.slice(chunkStart), maxRun);
}

/** Kimi's `_split_whitespaces_or_nonwhitespaces`, on code points. */
function* splitRuns(s: string, maxRun: number): Generator<string> {
  let runLength = 0;
  let runIsSpace = s.length > 0 && isPythonSpace(s.codePointAt(0)!);
  let sliceStart = 0;
  for (let i = 0; i < s.length; i += codePointWidth(s, i)) {
    const isSpace = isPythonSpace(s.codePointAt(i)!);
    if (runIsSpace !== isSpace) {
      runLength = 1;
      runIsSpace = isSpace;
    } else if (++runLength > maxRun) {
      yield s.slice(sliceStart, i);
      sliceStart = i;
      runLength = 1;
    }
  }
  yield s.slice(sliceStart);
}

/** 2 where a surrogate pair starts at `i`, else 1 (a lone surrogate is one code point, as in Python). */
function codePointWidth(s: string, i: number): number {
  const c = s.charCodeAt(i);
  if (c >= 0xd800 && c <= 0xdbff && i + 1 < s.length) {
    const d = s.charCodeAt(i + 1);
    if (d >= 0xdc00 && d <= 0xdfff) return 2;
  }
  return 1;
}

/**
 * Kimi's pattern as a JS RegExp, for pre-tokenizing the synthetic tokenizer's training corpus only
 * (encoding always runs the tiktoken engine on KIMI_PAT_STR). JS has the intersection as the `v`
 * flag's `--` subtraction, but not the scoped `(?i:...)`, so the contractions are spelled out with
 * their case folds (`ſ` folds to `s`); `\p{Han}` is JS's `\p{Script=Han}`; `\s` is the Unicode
 * White_Space set the Rust engine uses.
 */
export function kimiPieceRegExp(): RegExp {
  const ws = String.raw`\t-\r \x85\xA0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000`;
  const upper = String.raw`[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--\p{Script=Han}]`;
  const lower = String.raw`[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--\p{Script=Han}]`;
  const contraction = String.raw`(?:'(?:[sSſ]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))?`;
  const lead = String.raw`[^\r\n\p{L}\p{N}]?`;
  const parts = [
    String.raw`\p{Script=Han}+`,
    `${lead}${upper}*${lower}+${contraction}`,
    `${lead}${upper}+${lower}*${contraction}`,
    String.raw`\p{N}{1,3}`,
    ` ?[^${ws}\\p{L}\\p{N}]+[\\r\\n]*`,
    `[${ws}]*[\\r\\n]+`,
    `[${ws}]+(?![^${ws}])`,
    `[${ws}]+`,
  ];
  return new RegExp(parts.join('|'), 'gv');
}
