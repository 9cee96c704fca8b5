import { describe, expect, it } from 'vitest';
import { kimiSpecialTokens, parseTokenizerConfig } from './config.js';
import { TokenizerError } from './errors.js';
import { formatTiktokenRanks, parseTiktokenRanks } from './ranks.js';

const bytes = Array.from({ length: 256 }, (_, b) => Uint8Array.of(b));
const ranks256 = formatTiktokenRanks(bytes);
const withMerge = ranks256 + `${Buffer.from('ab').toString('base64')} 256\n`;

describe('parseTiktokenRanks', () => {
  it('reads base64 tokens and their ranks, CRLF and blank lines included', () => {
    const tokens = parseTiktokenRanks(withMerge.replace(/\n/g, '\r\n') + '\n\n');
    expect(tokens).toHaveLength(257);
    expect(Buffer.from(tokens[256]).toString()).toBe('ab');
    expect(formatTiktokenRanks(tokens)).toBe(withMerge);
  });

  it('rejects malformed lines, duplicates, gaps and missing single bytes, naming the line', () => {
    const bad = (text: string, message: RegExp) => {
      expect(() => parseTiktokenRanks(text, 'm/tiktoken.model')).toThrow(TokenizerError);
      expect(() => parseTiktokenRanks(text, 'm/tiktoken.model')).toThrow(message);
    };
    bad(ranks256 + 'YWI= x\n', /^m\/tiktoken\.model: line 257: not a tiktoken rank line; expected '<base64 token> <rank>', found "YWI= x"/);
    bad(ranks256 + 'YWI=256\n', /line 257: not a tiktoken rank line/);
    bad(ranks256 + 'YWI 256\n', /line 257: not a tiktoken rank line/);
    bad(ranks256 + 'YWI= 255\n', /line 257: rank 255 appears twice/);
    bad(ranks256 + 'AA== 256\n', /line 257: token AA== appears twice \(ranks 0 and 256\)/);
    bad(ranks256 + 'YWI= 300\n', /rank 256 is missing \(ranks run to 300\)/);
    bad(formatTiktokenRanks(bytes.slice(0, 255)), /no token for the single byte 0xff/);
    bad('', /no ranks/);
  });
});

describe('tokenizer_config.json', () => {
  const config = (added: Record<string, unknown>, extra: Record<string, unknown> = {}) => JSON.stringify({ added_tokens_decoder: added, ...extra });

  it("names Kimi's 256 slots from added_tokens_decoder, <|reserved_token_N|> elsewhere", () => {
    const c = parseTokenizerConfig(config({ '257': { content: '<|im_end|>', special: true }, '258': { content: '<|tool_call_begin|>', special: false } }, { eos_token: { __type: 'AddedToken', content: '<|im_end|>' } }));
    expect(c.eosToken).toBe('<|im_end|>');
    const specials = kimiSpecialTokens(c, 256);
    expect(specials).toHaveLength(256);
    expect(specials[0]).toEqual({ id: 256, content: '<|reserved_token_256|>', special: true, named: false });
    expect(specials[1]).toEqual({ id: 257, content: '<|im_end|>', special: true, named: true });
    expect(specials[2]).toEqual({ id: 258, content: '<|tool_call_begin|>', special: false, named: true });
    expect(specials[255].id).toBe(511);
  });

  it('takes the chat template from the string or the list form', () => {
    expect(parseTokenizerConfig(config({}, { chat_template: 'T' })).chatTemplate).toBe('T');
    expect(parseTokenizerConfig(config({}, { chat_template: [{ name: 'tool_use', template: 'U' }, { name: 'default', template: 'D' }] })).chatTemplate).toBe('D');
  });

  it('rejects what Kimi could not load, naming the field', () => {
    const bad = (text: string, message: RegExp, numBase = 256) => expect(() => kimiSpecialTokens(parseTokenizerConfig(text, 'cfg'), numBase, 'cfg')).toThrow(message);
    bad('{', /^cfg: not valid JSON/);
    bad('[]', /^cfg: not a JSON object/);
    bad(config({ x: { content: 'a' } }), /^cfg: added_tokens_decoder\.x: the key is not a token id/);
    bad(config({ '256': { content: '' } }), /added_tokens_decoder\.256: the entry has no content/);
    bad(config({ '256': { content: 'a', special: 'yes' } }), /added_tokens_decoder\.256\.special: special is not a boolean/);
    bad(config({ '256': { content: 'a' }, '257': { content: 'a' } }), /'a' names both 256 and 257/);
    bad(config({ '100': { content: '<|x|>' } }), /token id 100 is outside Kimi's special slots; expected an id in \[256, 512\) \(tiktoken\.model has 256 ranks\)/);
    bad(config({ '600': { content: '<|x|>' } }), /token id 600 is outside/);
    bad(config({ '300': { content: '<|reserved_token_256|>' } }), /'<\|reserved_token_256\|>' is the name of two special tokens/);
    bad(config({}, { bos_token: 3 }), /^cfg: bos_token: not a token/);
    bad(config({}, { chat_template: 5 }), /^cfg: chat_template: not a template/);
    bad(config({}, { chat_template: [{ name: 'x', template: 'y' }] }), /a list of templates without one named "default"/);
  });
});
