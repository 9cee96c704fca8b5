import { TokenizerError } from './errors.js';

/**
 * `tiktoken.model`: one `base64(token bytes) rank` per line (tiktoken's `load_tiktoken_bpe`). The
 * rank of a token is its id. Kimi numbers its special tokens from the count of ranks on, so ranks
 * must be exactly 0..n-1; every single byte must be a token, or the BPE could meet a byte it
 * cannot encode.
 */
export function parseTiktokenRanks(text: string, source = 'tiktoken.model'): Uint8Array[] {
  const tokens: (Uint8Array | undefined)[] = [];
  const seen = new Map<string, number>();
  const lines = text.split('\n');
  for (let n = 0; n < lines.length; n++) {
    const line = lines[n].replace(/\r$/, '');
    if (line.trim() === '') continue;
    const field = `line ${n + 1}`;
    const m = /^([A-Za-z0-9+/]+={0,2}) (\d{1,9})$/.exec(line);
    if (!m || m[1].length % 4 !== 0) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a tiktoken rank line', { source, field, expected: "'<base64 token> <rank>'", actual: JSON.stringify(line) });
    const bytes = new Uint8Array(Buffer.from(m[1], 'base64'));
    if (bytes.length === 0) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'empty token', { source, field, actual: JSON.stringify(line) });
    const rank = Number(m[2]);
    if (tokens[rank] !== undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `rank ${rank} appears twice`, { source, field });
    const key = Buffer.from(bytes).toString('base64');
    const previous = seen.get(key);
    if (previous !== undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `token ${key} appears twice (ranks ${previous} and ${rank})`, { source, field });
    seen.set(key, rank);
    tokens[rank] = bytes;
  }
  if (tokens.length === 0) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'no ranks', { source, expected: "lines '<base64 token> <rank>'" });
  for (let r = 0; r < tokens.length; r++) {
    if (tokens[r] === undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `rank ${r} is missing (ranks run to ${tokens.length - 1})`, { source, expected: 'ranks 0..n-1, each once' });
  }
  for (let b = 0; b < 256; b++) {
    if (!seen.has(Buffer.from([b]).toString('base64'))) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `no token for the single byte 0x${b.toString(16).padStart(2, '0')}`, { source, expected: 'all 256 single bytes among the tokens' });
  }
  return tokens as Uint8Array[];
}

/** The `tiktoken.model` text of `tokens` (token i has rank i), one line each, newline-terminated. */
export function formatTiktokenRanks(tokens: readonly Uint8Array[]): string {
  let out = '';
  for (let r = 0; r < tokens.length; r++) out += `${Buffer.from(tokens[r]).toString('base64')} ${r}\n`;
  return out;
}
