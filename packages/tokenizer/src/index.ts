export { TokenizerError, type TokenizerErrorCode, type TokenizerErrorDetails } from './errors.js';
export { KIMI_PAT_STR, KIMI_PATTERN_PARTS, MAX_ENCODE_CHARS, MAX_RUN_CHARS, isPythonSpace, kimiEncodeChunks } from './pattern.js';
export { formatTiktokenRanks, parseTiktokenRanks } from './ranks.js';
export { SPECIAL_SLOTS, kimiSpecialTokens, parseTokenizerConfig, type SpecialToken, type TokenizerConfig } from './config.js';
export { Tokenizer, TOKENIZER_FILE_NAMES, type DecodeOptions, type EncodeOptions, type TokenizerFiles } from './tokenizer.js';
export { StreamDecoder } from './stream-decoder.js';
export { ChatTemplate, deepSortKeys, validateMessages, type ChatContentPart, type ChatMessage, type ChatTool, type ChatToolCall, type RenderChatOptions } from './chat-template.js';
export {
  ChatOutputParser,
  KIMI_OUTPUT_MARKERS,
  parseChatOutput,
  toolNameFromId,
  type ChatOutputEvent,
  type ChatOutputParserOptions,
  type ParsedChatOutput,
  type ParsedToolCall,
} from './output-parser.js';
export { TOKENIZER_METADATA_KEY, TOKENIZER_METADATA_SCHEMA, loadTokenizer, tokenizerFromMetadata, tokenizerMetadata, type TokenizerMetadata } from './load.js';
export { trainBpe } from './bpe-train.js';
export { KIMI_SPECIAL_OFFSETS, MIN_SYNTHETIC_VOCAB, kimiChatTemplate, syntheticCorpus, syntheticTokenizerFiles, type SyntheticTokenizerFiles } from './synthetic.js';
