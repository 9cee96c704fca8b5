import { Tiktoken } from 'tiktoken/lite';
import { ChatTemplate, type ChatMessage, type RenderChatOptions } from './chat-template.js';
import { kimiSpecialTokens, parseTokenizerConfig, type SpecialToken, type TokenizerConfig } from './config.js';
import { TokenizerError } from './errors.js';
import { ChatOutputParser, type ChatOutputParserOptions } from './output-parser.js';
import { KIMI_PAT_STR, kimiEncodeChunks } from './pattern.js';
import { formatTiktokenRanks, parseTiktokenRanks } from './ranks.js';
import { StreamDecoder } from './stream-decoder.js';

/**
 * The files a Kimi model ships its tokenizer in, by their names in the model directory. Contents
 * are UTF-8 text, as a string or as the file's bytes.
 */
export interface TokenizerFiles {
  'tiktoken.model': string | Uint8Array;
  'tokenizer_config.json': string | Uint8Array;
  /** Takes precedence over tokenizer_config.json's `chat_template`, as in HuggingFace. */
  'chat_template.jinja'?: string | Uint8Array;
}

export const TOKENIZER_FILE_NAMES = ['tiktoken.model', 'tokenizer_config.json', 'chat_template.jinja'] as const;

export interface EncodeOptions {
  /**
   * true (the default, as Kimi's `encode`): the text of a special token (`<|im_end|>`) becomes
   * that token. false: it is encoded as ordinary text, byte by byte through the BPE.
   */
  allowSpecial?: boolean;
}

export interface DecodeOptions {
  /** Drop special tokens marked `special` (HuggingFace's `skip_special_tokens`). Default false. */
  skipSpecial?: boolean;
}

const utf8 = new TextDecoder('utf-8', { fatal: true });
const encoder = new TextEncoder();

function fileText(files: TokenizerFiles, name: keyof TokenizerFiles, source: string): string | undefined {
  const content = files[name];
  if (content === undefined || typeof content === 'string') return content;
  try {
    return utf8.decode(content);
  } catch (error) {
    throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'not valid UTF-8', { source: `${source}/${name}`, cause: error });
  }
}

/**
 * A Kimi tokenizer: tiktoken BPE over `tiktoken.model` with Kimi's pre-tokenizer pattern, its 256
 * special tokens, and the model's chat template. Encoding is byte-identical to Python `tiktoken`
 * (the same Rust core, compiled to WebAssembly); see docs/tokenizer.md.
 */
export class Tokenizer {
  /** Where the files came from (a directory, a bundle), for messages. */
  readonly source: string;
  /** The count of BPE ranks; special tokens are numbered from here. */
  readonly numBaseTokens: number;
  /** numBaseTokens + 256: every id this tokenizer produces is below it. */
  readonly vocabSize: number;
  readonly specialTokens: readonly SpecialToken[];
  readonly config: TokenizerConfig;
  readonly bosId?: number;
  readonly eosId?: number;
  readonly padId?: number;
  readonly unkId?: number;
  /** The chat template's source (chat_template.jinja, else the config's `chat_template`). */
  readonly chatTemplateSource?: string;

  private readonly tokens: Uint8Array[];
  private readonly specialById: Map<number, SpecialToken>;
  private readonly specialByContent: Map<string, SpecialToken>;
  private readonly engine: Tiktoken;
  private readonly files: { model: string; config: string; template?: string };
  private template?: ChatTemplate;

  constructor(files: TokenizerFiles, options: { source?: string } = {}) {
    const source = options.source ?? 'tokenizer files';
    const model = fileText(files, 'tiktoken.model', source);
    const configText = fileText(files, 'tokenizer_config.json', source);
    if (model === undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'tiktoken.model is missing', { source });
    if (configText === undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', 'tokenizer_config.json is missing', { source });
    const templateFile = fileText(files, 'chat_template.jinja', source);
    this.source = source;
    this.tokens = parseTiktokenRanks(model, `${source}/tiktoken.model`);
    this.numBaseTokens = this.tokens.length;
    this.config = parseTokenizerConfig(configText, `${source}/tokenizer_config.json`);
    this.specialTokens = kimiSpecialTokens(this.config, this.numBaseTokens, `${source}/tokenizer_config.json`);
    this.vocabSize = this.numBaseTokens + this.specialTokens.length;
    this.specialById = new Map(this.specialTokens.map((t) => [t.id, t]));
    this.specialByContent = new Map(this.specialTokens.map((t) => [t.content, t]));
    const idOf = (field: string, content: string | undefined) => {
      if (content === undefined) return undefined;
      const token = this.specialByContent.get(content);
      if (token === undefined) throw new TokenizerError('KDTREE_TOKENIZER_FILE', `'${content}' is not one of the special tokens`, { source: `${source}/tokenizer_config.json`, field });
      return token.id;
    };
    this.bosId = idOf('bos_token', this.config.bosToken);
    this.eosId = idOf('eos_token', this.config.eosToken);
    this.padId = idOf('pad_token', this.config.padToken);
    this.unkId = idOf('unk_token', this.config.unkToken);
    this.chatTemplateSource = templateFile ?? this.config.chatTemplate;
    this.files = { model, config: configText, template: templateFile };
    const specials: Record<string, number> = {};
    for (const t of this.specialTokens) specials[t.content] = t.id;
    this.engine = new Tiktoken(formatTiktokenRanks(this.tokens), specials, KIMI_PAT_STR);
  }

  /** The files this tokenizer was made from, verbatim (to store it in a bundle or a directory). */
  toFiles(): { 'tiktoken.model': string; 'tokenizer_config.json': string; 'chat_template.jinja'?: string } {
    const out: { 'tiktoken.model': string; 'tokenizer_config.json': string; 'chat_template.jinja'?: string } = { 'tiktoken.model': this.files.model, 'tokenizer_config.json': this.files.config };
    if (this.files.template !== undefined) out['chat_template.jinja'] = this.files.template;
    return out;
  }

  /** Kimi's `encode(text, allow_special_tokens)`: the 400,000 / 25,000 splits, then tiktoken on each piece. */
  encode(text: string, options: EncodeOptions = {}): number[] {
    if (typeof text !== 'string') throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', 'encode: the text is not a string', { actual: typeof text });
    const allowSpecial = options.allowSpecial ?? true;
    const ids: number[] = [];
    for (const piece of kimiEncodeChunks(text)) {
      if (piece === '') continue;
      const part = allowSpecial ? this.engine.encode(piece, 'all') : this.engine.encode_ordinary(piece);
      for (let i = 0; i < part.length; i++) ids.push(part[i]);
    }
    return ids;
  }

  /** tiktoken on the whole text, without Kimi's splits: only to show that a test exercises them. */
  encodeUnsplit(text: string, options: EncodeOptions = {}): number[] {
    return Array.from((options.allowSpecial ?? true) ? this.engine.encode(text, 'all') : this.engine.encode_ordinary(text));
  }

  /** The bytes of one token (a special token's are its UTF-8 text). */
  tokenBytes(id: number): Uint8Array {
    if (id >= 0 && id < this.numBaseTokens && Number.isInteger(id)) return this.tokens[id];
    const special = this.specialById.get(id);
    if (special !== undefined) return encoder.encode(special.content);
    throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', `token id ${id} is outside the vocabulary`, { source: this.source, expected: `an integer in [0, ${this.vocabSize})` });
  }

  /** The special token with this id, or undefined for an ordinary token. */
  special(id: number): SpecialToken | undefined {
    return this.specialById.get(id);
  }

  /** The id of a special token by its text (`<|im_end|>`), or undefined. */
  specialId(content: string): number | undefined {
    return this.specialByContent.get(content)?.id;
  }

  /** The ids that end an assistant turn: `<|im_end|>` and the eos token, where the tokenizer has them. */
  get endOfTurnIds(): number[] {
    const ids = [this.specialId('<|im_end|>'), this.eosId].filter((id): id is number => id !== undefined);
    return [...new Set(ids)];
  }

  decodeBytes(ids: ArrayLike<number>, options: DecodeOptions = {}): Uint8Array {
    const parts: Uint8Array[] = [];
    let length = 0;
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i];
      if (options.skipSpecial && this.specialById.get(id)?.special) continue;
      let bytes: Uint8Array;
      try {
        bytes = this.tokenBytes(id);
      } catch (error) {
        throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', `token id ${String(id)} at index ${i} is outside the vocabulary`, { source: this.source, expected: `integers in [0, ${this.vocabSize})`, cause: error });
      }
      parts.push(bytes);
      length += bytes.length;
    }
    const out = new Uint8Array(length);
    let offset = 0;
    for (const p of parts) {
      out.set(p, offset);
      offset += p.length;
    }
    return out;
  }

  /** ids -> bytes -> text; bytes that are not valid UTF-8 become U+FFFD, as Python's decode(errors="replace"). */
  decode(ids: ArrayLike<number>, options: DecodeOptions = {}): string {
    return new TextDecoder('utf-8').decode(this.decodeBytes(ids, options));
  }

  /** An incremental decoder that never splits a UTF-8 character across the strings it returns. */
  streamDecoder(options: DecodeOptions = {}): StreamDecoder {
    return new StreamDecoder(this, options);
  }

  /** The model's chat template; throws when the tokenizer has none. */
  chatTemplate(): ChatTemplate {
    if (this.template === undefined) {
      if (this.chatTemplateSource === undefined) throw new TokenizerError('KDTREE_CHAT_TEMPLATE', 'the tokenizer has no chat template (no chat_template.jinja and no chat_template in tokenizer_config.json)', { source: this.source });
      // HuggingFace passes the special-token names to every template
      const globals: Record<string, string> = {};
      for (const [key, value] of [['bos_token', this.config.bosToken], ['eos_token', this.config.eosToken], ['unk_token', this.config.unkToken], ['pad_token', this.config.padToken]] as const) {
        if (value !== undefined) globals[key] = value;
      }
      const origin = `${this.source}/${this.files.template !== undefined ? 'chat_template.jinja' : 'tokenizer_config.json: chat_template'}`;
      this.template = new ChatTemplate(this.chatTemplateSource, origin, globals);
    }
    return this.template;
  }

  /** The prompt text of a conversation, rendered by the model's own template. */
  renderChat(messages: readonly ChatMessage[], options: RenderChatOptions = {}): string {
    return this.chatTemplate().render(messages, options);
  }

  /**
   * The prompt ids of a conversation. The rendered text is encoded with special tokens parsed, as
   * Kimi's `apply_chat_template(tokenize=True)` does — so special-token text inside a message's
   * content also becomes a special token.
   */
  encodeChat(messages: readonly ChatMessage[], options: RenderChatOptions = {}): number[] {
    return this.encode(this.renderChat(messages, options));
  }

  /** A streaming parser of the model's answer into content, reasoning and tool calls. */
  outputParser(options: ChatOutputParserOptions = {}): ChatOutputParser {
    return new ChatOutputParser(this, options);
  }

  /** Frees the WebAssembly memory now rather than when the tokenizer is garbage-collected. */
  free(): void {
    this.engine.free();
  }
}
