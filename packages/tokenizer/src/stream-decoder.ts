import { TokenizerError } from './errors.js';
import type { DecodeOptions, Tokenizer } from './tokenizer.js';

/**
 * Turns token ids into text as they arrive. A token can end in the middle of a UTF-8 character
 * (byte-level BPE splits a Chinese character or an emoji across tokens); those bytes are held
 * back until the character completes, so each returned string is whole characters and the
 * concatenation of every `push` and the final `flush` equals `decode(all ids)`.
 */
export class StreamDecoder {
  private readonly decoder = new TextDecoder('utf-8');
  private ended = false;

  constructor(
    private readonly tokenizer: Tokenizer,
    private readonly options: DecodeOptions = {},
  ) {}

  /** The text the new ids complete (possibly ''). */
  push(ids: number | ArrayLike<number>): string {
    if (this.ended) throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', 'StreamDecoder: push after flush');
    const list = typeof ids === 'number' ? [ids] : ids;
    return this.decoder.decode(this.tokenizer.decodeBytes(list, this.options), { stream: true });
  }

  /** What is left: an incomplete character at the end of the stream becomes U+FFFD. */
  flush(): string {
    this.ended = true;
    return this.decoder.decode();
  }
}
