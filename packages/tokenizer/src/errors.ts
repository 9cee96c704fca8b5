/**
 * Typed errors of @kdtree/tokenizer. Each names where the bad value came from (a file, a field, an
 * argument) and what was expected, so that a CLI prints one line and a program branches on `code`.
 */

export type TokenizerErrorCode =
  /** A tokenizer file is missing, unreadable or malformed (tiktoken.model, tokenizer_config.json). */
  | 'KDTREE_TOKENIZER_FILE'
  /** A token id outside the vocabulary, or an argument of the wrong type or range. */
  | 'KDTREE_TOKENIZER_ARGUMENT'
  /** The chat template failed to parse or render, or a message is malformed. */
  | 'KDTREE_CHAT_TEMPLATE'
  /** A synthetic tokenizer cannot be made with the requested vocabulary. */
  | 'KDTREE_TOKENIZER_VOCAB';

export interface TokenizerErrorDetails {
  /** The file (or in-memory source) the value came from. */
  source?: string;
  /** The field, line or argument: `added_tokens_decoder.163586`, `line 17`, `messages[2].role`. */
  field?: string;
  expected?: string;
  actual?: string;
  cause?: unknown;
}

export class TokenizerError extends Error {
  readonly code: TokenizerErrorCode;
  readonly source?: string;
  readonly field?: string;
  readonly expected?: string;
  readonly actual?: string;

  constructor(code: TokenizerErrorCode, message: string, details: TokenizerErrorDetails = {}) {
    super(TokenizerError.compose(message, details), details.cause === undefined ? undefined : { cause: details.cause });
    this.name = 'TokenizerError';
    this.code = code;
    this.source = details.source;
    this.field = details.field;
    this.expected = details.expected;
    this.actual = details.actual;
  }

  private static compose(message: string, d: TokenizerErrorDetails): string {
    const where = [d.source, d.field === undefined ? undefined : `${d.field}`].filter((w) => w !== undefined);
    let text = where.length > 0 ? `${where.join(': ')}: ${message}` : message;
    if (d.expected !== undefined) text += `; expected ${d.expected}`;
    if (d.actual !== undefined) text += `, found ${truncate(d.actual, 120)}`;
    return text;
  }
}

/** Quotes at most `max` characters of `text`, marking the cut. */
export function truncate(text: string, max: number): string {
  return text.length <= max ? text : `${text.slice(0, max)}... (${text.length} characters)`;
}
