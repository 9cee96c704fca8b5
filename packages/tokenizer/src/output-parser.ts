import { TokenizerError } from './errors.js';
import type { Tokenizer } from './tokenizer.js';

/** Kimi's markers in a model's answer; each is one special token. */
export const KIMI_OUTPUT_MARKERS = {
  thinkBegin: '<think>',
  thinkEnd: '</think>',
  sectionBegin: '<|tool_calls_section_begin|>',
  sectionEnd: '<|tool_calls_section_end|>',
  callBegin: '<|tool_call_begin|>',
  argumentBegin: '<|tool_call_argument_begin|>',
  callEnd: '<|tool_call_end|>',
} as const;

export interface ChatOutputParserOptions {
  /** The prompt ended inside `<think>` (a template that opens the thinking block itself). */
  startInReasoning?: boolean;
  /** Token ids that end the turn; default: the tokenizer's `<|im_end|>` and eos. */
  endOfTurnIds?: readonly number[];
}

export type ChatOutputEvent =
  | { type: 'content'; text: string }
  | { type: 'reasoning'; text: string }
  /** A tool call's header is complete: its id as the model wrote it and the function name in it. */
  | { type: 'tool_call'; index: number; id: string; name: string }
  | { type: 'tool_call_arguments'; index: number; text: string }
  | { type: 'tool_call_end'; index: number }
  /** An end-of-turn token; the parser ignores whatever follows. */
  | { type: 'end'; tokenId: number };

export interface ParsedToolCall {
  id: string;
  name: string;
  /** The arguments as the model wrote them (normally a JSON object's text). */
  arguments: string;
  /** false when the answer stopped before `<|tool_call_end|>`. */
  complete: boolean;
}

export interface ParsedChatOutput {
  content: string;
  /** null when the answer had no thinking block. */
  reasoning: string | null;
  toolCalls: ParsedToolCall[];
  /** An end-of-turn token was seen (false: the answer was cut off, e.g. by max_tokens). */
  finished: boolean;
}

type State = 'content' | 'reasoning' | 'section' | 'call-id' | 'call-arguments' | 'done';

/**
 * The function name in a Kimi tool-call id: `functions.get_weather:0` -> `get_weather`. The
 * template writes ids as `functions.NAME:INDEX`; an id without the prefix or the index keeps the rest.
 */
export function toolNameFromId(id: string): string {
  return id.replace(/^functions\./, '').replace(/:\d+$/, '');
}

/**
 * Splits a model's answer into content, reasoning (`<think>...</think>`) and tool calls
 * (`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
 * {json}<|tool_call_end|><|tool_calls_section_end|>`) as token ids arrive. It works on ids, so a
 * marker is recognised only as the special token, never as the same characters written as text;
 * text between markers goes through a UTF-8 stream decoder, so no event splits a character.
 * Events from `push` concatenate to the final `result()`.
 */
export class ChatOutputParser {
  private state: State;
  private decoder = new TextDecoder('utf-8');
  private readonly marker: Map<number, keyof typeof KIMI_OUTPUT_MARKERS>;
  private readonly endIds: Set<number>;
  private readonly out: ParsedChatOutput = { content: '', reasoning: null, toolCalls: [], finished: false };
  private callId = '';

  constructor(
    private readonly tokenizer: Tokenizer,
    options: ChatOutputParserOptions = {},
  ) {
    this.marker = new Map();
    for (const [key, content] of Object.entries(KIMI_OUTPUT_MARKERS) as [keyof typeof KIMI_OUTPUT_MARKERS, string][]) {
      const id = tokenizer.specialId(content);
      if (id !== undefined) this.marker.set(id, key);
    }
    this.endIds = new Set(options.endOfTurnIds ?? tokenizer.endOfTurnIds);
    this.state = options.startInReasoning ? 'reasoning' : 'content';
    if (options.startInReasoning) this.out.reasoning = '';
  }

  /** Feeds ids; returns what they completed. */
  push(ids: number | ArrayLike<number>): ChatOutputEvent[] {
    const list = typeof ids === 'number' ? [ids] : ids;
    const events: ChatOutputEvent[] = [];
    for (let i = 0; i < list.length; i++) this.step(list[i], events);
    return events;
  }

  /** Ends the stream: flushes a character left incomplete and returns the last events. */
  finish(): ChatOutputEvent[] {
    const events: ChatOutputEvent[] = [];
    this.flushText(events);
    if (this.state === 'call-id') this.openCall(events);
    return events;
  }

  /** Everything parsed so far. */
  result(): ParsedChatOutput {
    return { ...this.out, toolCalls: this.out.toolCalls.map((c) => ({ ...c })) };
  }

  private step(id: number, events: ChatOutputEvent[]): void {
    if (this.state === 'done') return;
    if (this.endIds.has(id)) {
      this.flushText(events);
      if (this.state === 'call-id') this.openCall(events);
      this.out.finished = true;
      this.state = 'done';
      events.push({ type: 'end', tokenId: id });
      return;
    }
    const marker = this.marker.get(id);
    if (marker !== undefined) return this.onMarker(marker, events);
    const special = this.tokenizer.special(id);
    // any other special token (a header marker, a reserved slot) is not part of the answer's text
    if (special !== undefined) return;
    let bytes: Uint8Array;
    try {
      bytes = this.tokenizer.tokenBytes(id);
    } catch (error) {
      throw new TokenizerError('KDTREE_TOKENIZER_ARGUMENT', `ChatOutputParser: token id ${String(id)} is outside the vocabulary`, { expected: `integers in [0, ${this.tokenizer.vocabSize})`, cause: error });
    }
    this.emitText(this.decoder.decode(bytes, { stream: true }), events);
  }

  private onMarker(marker: keyof typeof KIMI_OUTPUT_MARKERS, events: ChatOutputEvent[]): void {
    this.flushText(events);
    switch (marker) {
      case 'thinkBegin':
        if (this.state === 'content') {
          this.state = 'reasoning';
          this.out.reasoning ??= '';
        }
        return;
      case 'thinkEnd':
        if (this.state === 'reasoning') this.state = 'content';
        return;
      case 'sectionBegin':
        if (this.state === 'content' || this.state === 'reasoning') this.state = 'section';
        return;
      case 'callBegin':
        // a call outside a section is taken as one: the markers say what it is
        if (this.state === 'call-id') this.openCall(events);
        if (this.state === 'call-arguments') this.closeCall(events, false);
        this.state = 'call-id';
        this.callId = '';
        return;
      case 'argumentBegin':
        if (this.state === 'call-id') {
          this.openCall(events);
          this.state = 'call-arguments';
        }
        return;
      case 'callEnd':
        if (this.state === 'call-id') this.openCall(events);
        if (this.state === 'call-arguments' || this.state === 'section') this.closeCall(events, true);
        return;
      case 'sectionEnd':
        if (this.state === 'call-id') this.openCall(events);
        if (this.state === 'call-arguments') this.closeCall(events, false);
        this.state = 'content';
        return;
    }
  }

  private openCall(events: ChatOutputEvent[]): void {
    const id = this.callId.trim();
    const index = this.out.toolCalls.length;
    this.out.toolCalls.push({ id, name: toolNameFromId(id), arguments: '', complete: false });
    events.push({ type: 'tool_call', index, id, name: toolNameFromId(id) });
    this.state = 'call-arguments';
  }

  private closeCall(events: ChatOutputEvent[], complete: boolean): void {
    const index = this.out.toolCalls.length - 1;
    if (this.state === 'call-arguments' && index >= 0 && !this.out.toolCalls[index].complete) {
      this.out.toolCalls[index].complete = complete;
      if (complete) events.push({ type: 'tool_call_end', index });
    }
    this.state = 'section';
  }

  private flushText(events: ChatOutputEvent[]): void {
    this.emitText(this.decoder.decode(), events);
    this.decoder = new TextDecoder('utf-8');
  }

  private emitText(text: string, events: ChatOutputEvent[]): void {
    if (text === '') return;
    switch (this.state) {
      case 'content':
        this.out.content += text;
        events.push({ type: 'content', text });
        return;
      case 'reasoning':
        this.out.reasoning = (this.out.reasoning ?? '') + text;
        events.push({ type: 'reasoning', text });
        return;
      case 'call-id':
        this.callId += text;
        return;
      case 'call-arguments': {
        const index = this.out.toolCalls.length - 1;
        this.out.toolCalls[index].arguments += text;
        events.push({ type: 'tool_call_arguments', index, text });
        return;
      }
      default:
        // text between calls inside a section (whitespace) belongs to nothing
        return;
    }
  }
}

/** Parses a whole answer at once. */
export function parseChatOutput(tokenizer: Tokenizer, ids: ArrayLike<number>, options: ChatOutputParserOptions = {}): ParsedChatOutput {
  const parser = new ChatOutputParser(tokenizer, options);
  parser.push(ids);
  parser.finish();
  return parser.result();
}
