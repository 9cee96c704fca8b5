import { mkdtempSync, readFileSync, rmSync, writeFileSync, cpSync, unlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { TokenizerError } from './errors.js';
import { loadTokenizer, tokenizerFromMetadata, tokenizerMetadata } from './load.js';
import { SYNTHETIC_8192_DIR } from './test-support/fixtures.js';
import { Tokenizer } from './tokenizer.js';

const dir = mkdtempSync(join(tmpdir(), 'kdtree-tokenizer-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const tokenizer = await loadTokenizer(SYNTHETIC_8192_DIR);

describe('Tokenizer', () => {
  it("lays the special tokens out as Kimi's: 256 slots from the count of ranks", () => {
    expect(tokenizer.numBaseTokens).toBe(7936);
    expect(tokenizer.vocabSize).toBe(8192);
    expect(tokenizer.specialTokens).toHaveLength(256);
    expect(tokenizer.specialId('[BOS]')).toBe(7936);
    expect(tokenizer.bosId).toBe(7936);
    expect(tokenizer.eosId).toBe(7937);
    expect(tokenizer.specialId('<|im_end|>')).toBe(7938);
    expect(tokenizer.specialId('<think>')).toBe(7936 + 22);
    expect(tokenizer.unkId).toBe(8190);
    expect(tokenizer.padId).toBe(8191);
    expect(tokenizer.special(7941)).toEqual({ id: 7941, content: '<|reserved_token_7941|>', special: true, named: false });
    expect(tokenizer.endOfTurnIds).toEqual([7938, 7937]);
  });

  it('decodes special tokens as their text, or drops the ones marked special with skipSpecial', () => {
    const ids = tokenizer.encode('<|im_user|>hi<|tool_call_begin|><|im_end|>');
    expect(tokenizer.decode(ids)).toBe('<|im_user|>hi<|tool_call_begin|><|im_end|>');
    // Kimi marks the tool-call markers special: false, so they survive, as in HuggingFace
    expect(tokenizer.decode(ids, { skipSpecial: true })).toBe('hi<|tool_call_begin|>');
  });

  it('rejects ids outside the vocabulary and non-string text with errors naming them', () => {
    expect(() => tokenizer.decode([1, 8192])).toThrow(/token id 8192 at index 1 is outside the vocabulary; expected integers in \[0, 8192\)/);
    expect(() => tokenizer.decode([-1])).toThrow(TokenizerError);
    expect(() => tokenizer.decode([1.5])).toThrow(/token id 1.5 at index 0/);
    expect(() => tokenizer.tokenBytes(Number.NaN)).toThrow(/outside the vocabulary/);
    expect(() => tokenizer.encode(42 as unknown as string)).toThrow(/encode: the text is not a string/);
  });

  it('loads from in-memory files (strings or bytes) and gives them back verbatim', () => {
    const files = tokenizer.toFiles();
    expect(files['tiktoken.model']).toBe(readFileSync(join(SYNTHETIC_8192_DIR, 'tiktoken.model'), 'utf8'));
    const fromBytes = new Tokenizer({ 'tiktoken.model': Buffer.from(files['tiktoken.model']), 'tokenizer_config.json': files['tokenizer_config.json'] }, { source: 'memory' });
    expect(fromBytes.encode('Hello 世界')).toEqual(tokenizer.encode('Hello 世界'));
    expect(fromBytes.chatTemplateSource).toBeUndefined();
    expect(() => fromBytes.renderChat([{ role: 'user', content: 'x' }])).toThrow(/^memory: the tokenizer has no chat template/);
    fromBytes.free();
    expect(() => new Tokenizer({ 'tiktoken.model': Uint8Array.of(0xff), 'tokenizer_config.json': '{}' }, { source: 'mem' })).toThrow(/^mem\/tiktoken\.model: not valid UTF-8/);
  });

  it("uses tokenizer_config.json's chat_template when there is no chat_template.jinja", () => {
    const files = tokenizer.toFiles();
    const config = { ...JSON.parse(files['tokenizer_config.json']), chat_template: '{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}' };
    const t = new Tokenizer({ 'tiktoken.model': files['tiktoken.model'], 'tokenizer_config.json': JSON.stringify(config) });
    expect(t.renderChat([{ role: 'user', content: 'a' }, { role: 'user', content: 'b' }])).toBe('[BOS]ab');
    t.free();
  });

  it('names a bos/eos token that is not a special token', () => {
    const files = tokenizer.toFiles();
    const config = { ...JSON.parse(files['tokenizer_config.json']), eos_token: '<|nope|>' };
    expect(() => new Tokenizer({ 'tiktoken.model': files['tiktoken.model'], 'tokenizer_config.json': JSON.stringify(config) }, { source: 'm' })).toThrow(/^m\/tokenizer_config\.json: eos_token: '<\|nope\|>' is not one of the special tokens/);
  });
});

describe('loadTokenizer', () => {
  it('reads a model directory, the chat template being optional', async () => {
    const d = join(dir, 'model');
    cpSync(SYNTHETIC_8192_DIR, d, { recursive: true });
    unlinkSync(join(d, 'chat_template.jinja'));
    const t = await loadTokenizer(d);
    expect(t.source).toBe(d);
    expect(t.chatTemplateSource).toBeUndefined();
    expect(t.encode('x')).toEqual(tokenizer.encode('x'));
  });

  it('says which file is missing, or that the path is not a directory', async () => {
    await expect(loadTokenizer(join(dir, 'absent'))).rejects.toThrow(/absent: no such directory/);
    const file = join(dir, 'file.txt');
    writeFileSync(file, 'x');
    await expect(loadTokenizer(file)).rejects.toThrow(/file\.txt: not a directory; expected a model directory with tiktoken\.model and tokenizer_config\.json/);
    const d = join(dir, 'partial');
    cpSync(SYNTHETIC_8192_DIR, d, { recursive: true });
    unlinkSync(join(d, 'tokenizer_config.json'));
    await expect(loadTokenizer(d)).rejects.toThrow(/partial: tokenizer_config\.json is missing/);
  });
});

describe('bundle metadata', () => {
  it('carries the files verbatim and gives back the same tokenizer', () => {
    const meta = tokenizerMetadata(tokenizer.toFiles());
    expect(meta.schema).toBe('kdtree.tokenizer/1');
    expect(Object.keys(meta.files)).toEqual(['tiktoken.model', 'tokenizer_config.json', 'chat_template.jinja']);
    const back = tokenizerFromMetadata(JSON.parse(JSON.stringify({ config: {}, tokenizer: meta })), 'm.kdtr')!;
    expect(back.source).toBe('m.kdtr: metadata.tokenizer');
    expect(back.encode('Hello, 世界 <|im_end|>')).toEqual(tokenizer.encode('Hello, 世界 <|im_end|>'));
    expect(back.renderChat([{ role: 'user', content: 'hi' }])).toBe(tokenizer.renderChat([{ role: 'user', content: 'hi' }]));
  });

  it('is absent from a bundle without one, and a malformed entry is an error naming the field', () => {
    expect(tokenizerFromMetadata({ config: {} })).toBeUndefined();
    expect(() => tokenizerFromMetadata({ tokenizer: { files: {} } }, 'b.kdtr')).toThrow(/^b\.kdtr: metadata\.tokenizer: not a tokenizer entry; expected \{"schema": "kdtree\.tokenizer\/1"/);
    expect(() => tokenizerFromMetadata({ tokenizer: { schema: 'kdtree.tokenizer/1', files: { 'tiktoken.model': 'x' } } }, 'b.kdtr')).toThrow(/metadata\.tokenizer\.files\.tokenizer_config\.json: tokenizer_config\.json is not a string/);
    expect(() => tokenizerMetadata({ 'tiktoken.model': 'bad', 'tokenizer_config.json': '{}' })).toThrow(/tiktoken\.model: line 1: not a tiktoken rank line/);
  });
});
