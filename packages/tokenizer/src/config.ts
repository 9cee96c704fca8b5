import { TokenizerError } from './errors.js';

/** Kimi's `num_reserved_special_tokens`: the ids from the count of ranks on that are special tokens. */
export const SPECIAL_SLOTS = 256;

export interface SpecialToken {
  id: number;
  /** The token's text: `<|im_end|>`, or `<|reserved_token_N|>` for a slot the config leaves unnamed. */
  content: string;
  /**
   * HuggingFace's `special` flag: decoding with `skipSpecial` drops the token. Kimi marks its
   * tool-call markers `special: false`, so they survive, as in HuggingFace. Unnamed slots are true.
   */
  special: boolean;
  /** Whether tokenizer_config.json names the token (false: a `<|reserved_token_N|>` slot). */
  named: boolean;
}

/** What this package reads from tokenizer_config.json. */
export interface TokenizerConfig {
  /** added_tokens_decoder, by id. */
  addedTokens: Map<number, { content: string; special: boolean }>;
  bosToken?: string;
  eosToken?: string;
  padToken?: string;
  unkToken?: string;
  /** The config's `chat_template`, when it has one. */
  chatTemplate?: string;
}

export function parseTokenizerConfig(text: string, source = 'tokenizer_config.json'): TokenizerConfig {
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (error) {
    throw new TokenizerError('KDTREE_TOKENIZER_FILE', `not valid JSON (${(error as Error).message})`, { source, cause: error });
  }
  if (!isObject(json)) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a JSON object', { source, actual: typeof json });
  const addedTokens = new Map<number, { content: string; special: boolean }>();
  const added = json.added_tokens_decoder ?? {};
  if (!isObject(added)) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not an object', { source, field: 'added_tokens_decoder', actual: JSON.stringify(added) });
  const contents = new Map<string, number>();
  for (const [key, entry] of Object.entries(added)) {
    const field = `added_tokens_decoder.${key}`;
    if (!/^(0|[1-9]\d{0,9})$/.test(key)) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'the key is not a token id', { source, field, expected: 'a non-negative integer' });
    if (!isObject(entry) || typeof entry.content !== 'string' || entry.content === '') throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'the entry has no content', { source, field, expected: '{"content": "<|...|>", ...}', actual: JSON.stringify(entry) });
    if (entry.special !== undefined && typeof entry.special !== 'boolean') throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'special is not a boolean', { source, field: `${field}.special`, actual: JSON.stringify(entry.special) });
    const id = Number(key);
    const other = contents.get(entry.content);
    if (other !== undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `'${entry.content}' names both ${other} and ${id}`, { source, field });
    contents.set(entry.content, id);
    addedTokens.set(id, { content: entry.content, special: entry.special ?? true });
  }
  const config: TokenizerConfig = { addedTokens };
  for (const [key, name] of [['bos_token', 'bosToken'], ['eos_token', 'eosToken'], ['pad_token', 'padToken'], ['unk_token', 'unkToken']] as const) {
    const value = json[key];
    if (value === undefined || value === null) continue;
    // a string, or HuggingFace's serialized AddedToken ({"__type": "AddedToken", "content": ...})
    const content = typeof value === 'string' ? value : isObject(value) && typeof value.content === 'string' ? value.content : undefined;
    if (content === undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a token', { source, field: key, expected: 'a string or {"content": ...}', actual: JSON.stringify(value) });
    config[name] = content;
  }
  const template = json.chat_template;
  if (typeof template === 'string') config.chatTemplate = template;
  else if (Array.isArray(template)) {
    // HuggingFace's list form: [{name, template}], of which "default" is the chat template
    const named = template.find((t) => isObject(t) && t.name === 'default');
    if (!isObject(named) || typeof named.template !== 'string') throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'a list of templates without one named "default"', { source, field: 'chat_template' });
    config.chatTemplate = named.template;
  } else if (template !== undefined && template !== null) {
    throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not a template', { source, field: 'chat_template', expected: 'a string or [{"name", "template"}]', actual: JSON.stringify(template) });
  }
  return config;
}

/**
 * Kimi's special tokens: the 256 ids from `numBase` (the count of ranks) on, named by
 * added_tokens_decoder where it names them and `<|reserved_token_N|>` elsewhere, exactly as
 * `tokenization_kimi.py` builds them for tiktoken.
 */
export function kimiSpecialTokens(config: TokenizerConfig, numBase: number, source = 'tokenizer_config.json'): SpecialToken[] {
  for (const id of config.addedTokens.keys()) {
    if (id < numBase || id >= numBase + SPECIAL_SLOTS) {
      throw new TokenizerError('KDTREE_TOKENIZER_FILE', `token id ${id} is outside Kimi's special slots`, { source, field: `added_tokens_decoder.${id}`, expected: `an id in [${numBase}, ${numBase + SPECIAL_SLOTS}) (tiktoken.model has ${numBase} ranks)` });
    }
  }
  const out: SpecialToken[] = [];
  const names = new Set<string>();
  for (let id = numBase; id < numBase + SPECIAL_SLOTS; id++) {
    const added = config.addedTokens.get(id);
    const content = added?.content ?? `<|reserved_token_${id}|>`;
    if (names.has(content)) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `'${content}' is the name of two special tokens`, { source, field: `added_tokens_decoder.${id}` });
    names.add(content);
    out.push({ id, content, special: added?.special ?? true, named: added !== undefined });
  }
  return out;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
