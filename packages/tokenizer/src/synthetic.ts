import { readFileSync, readdirSync } from 'node:fs';
import { trainBpe } from './bpe-train.js';
import { SPECIAL_SLOTS } from './config.js';
import { TokenizerError } from './errors.js';
import { formatTiktokenRanks } from './ranks.js';

const CORPUS_DIR = new URL('../corpus/', import.meta.url);
const TEMPLATE_URL = new URL('../templates/kimi-k2.jinja', import.meta.url);

/**
 * Kimi's named special tokens at their offsets from the first special id (163584 in the real
 * model: [BOS] 163584, <|im_end|> 163586, <think> 163606, [PAD] 163839). `special: false` marks
 * the tokens that survive decoding with skip_special_tokens, as Kimi marks its tool-call markers.
 */
export const KIMI_SPECIAL_OFFSETS: readonly { offset: number; content: string; special: boolean }[] = [
  { offset: 0, content: '[BOS]', special: true },
  { offset: 1, content: '[EOS]', special: true },
  { offset: 2, content: '<|im_end|>', special: true },
  { offset: 3, content: '<|im_user|>', special: true },
  { offset: 4, content: '<|im_assistant|>', special: true },
  { offset: 6, content: '<|start_header_id|>', special: true },
  { offset: 7, content: '<|end_header_id|>', special: true },
  { offset: 9, content: '[EOT]', special: true },
  { offset: 10, content: '<|im_system|>', special: true },
  { offset: 11, content: '<|tool_calls_section_begin|>', special: false },
  { offset: 12, content: '<|tool_calls_section_end|>', special: false },
  { offset: 13, content: '<|tool_call_begin|>', special: false },
  { offset: 14, content: '<|tool_call_argument_begin|>', special: false },
  { offset: 15, content: '<|tool_call_end|>', special: false },
  { offset: 17, content: '<|im_middle|>', special: true },
  { offset: 22, content: '<think>', special: false },
  { offset: 23, content: '</think>', special: false },
  { offset: 254, content: '[UNK]', special: true },
  { offset: 255, content: '[PAD]', special: true },
];

/** The smallest vocabulary a synthetic tokenizer fits in: the 256 single bytes and Kimi's 256 special slots. */
export const MIN_SYNTHETIC_VOCAB = 256 + SPECIAL_SLOTS;

/** The training corpus: every corpus/*.txt of this package, in name order, joined by a blank line. */
export function syntheticCorpus(): string {
  const names = readdirSync(CORPUS_DIR)
    .filter((n) => n.endsWith('.txt'))
    .sort();
  return names.map((n) => readFileSync(new URL(n, CORPUS_DIR), 'utf8')).join('\n\n');
}

/** Kimi K2's chat format as a Jinja template (templates/kimi-k2.jinja; see docs/tokenizer.md). */
export function kimiChatTemplate(): string {
  return readFileSync(TEMPLATE_URL, 'utf8');
}

export interface SyntheticTokenizerFiles {
  'tiktoken.model': string;
  'tokenizer_config.json': string;
  'chat_template.jinja': string;
}

/**
 * The files of a tokenizer for a synthetic model of `vocabSize` tokens, laid out as Kimi's: BPE
 * ranks 0..vocabSize-257 trained (deterministically) on this package's corpus, then 256 special
 * slots at the top of the vocabulary with Kimi's named tokens at Kimi's offsets, and Kimi's chat
 * format. Kimi's own tokenization_kimi.py loads the result unchanged. A vocabulary under 512 has
 * no room for the 256 byte tokens and the 256 special slots: that is an error (the `tiny` preset's
 * 128 gets no tokenizer). 512 exactly gives byte tokens only, no merges.
 */
export function syntheticTokenizerFiles(options: { vocabSize: number }): SyntheticTokenizerFiles {
  const { vocabSize } = options;
  if (!Number.isInteger(vocabSize) || vocabSize < MIN_SYNTHETIC_VOCAB) {
    throw new TokenizerError('KDTREE_TOKENIZER_VOCAB', `a vocabulary of ${vocabSize} cannot hold a Kimi-style tokenizer`, {
      field: 'vocabSize',
      expected: `an integer >= ${MIN_SYNTHETIC_VOCAB} (256 byte tokens + ${SPECIAL_SLOTS} special slots)`,
    });
  }
  const numBase = vocabSize - SPECIAL_SLOTS;
  const ranks = trainBpe(syntheticCorpus(), numBase);
  const added: Record<string, object> = {};
  for (const t of KIMI_SPECIAL_OFFSETS) {
    // HuggingFace's AddedToken fields, as Kimi's tokenizer_config.json writes them
    added[String(numBase + t.offset)] = { content: t.content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: t.special };
  }
  const config = {
    added_tokens_decoder: added,
    additional_special_tokens: ['<|im_end|>', '<|im_user|>', '<|im_assistant|>', '<|start_header_id|>', '<|end_header_id|>', '[EOT]', '<|im_system|>', '<|im_middle|>'],
    bos_token: '[BOS]',
    clean_up_tokenization_spaces: false,
    eos_token: '[EOS]',
    extra_special_tokens: {},
    model_max_length: 1048576,
    pad_token: '[PAD]',
    tokenizer_class: 'TikTokenTokenizer',
    unk_token: '[UNK]',
  };
  return { 'tiktoken.model': formatTiktokenRanks(ranks), 'tokenizer_config.json': `${JSON.stringify(config, null, 2)}\n`, 'chat_template.jinja': kimiChatTemplate() };
}
