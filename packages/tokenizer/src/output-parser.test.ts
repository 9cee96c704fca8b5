import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { loadTokenizer } from './load.js';
import { parseChatOutput, toolNameFromId, type ChatOutputEvent } from './output-parser.js';
import { SYNTHETIC_8192_DIR } from './test-support/fixtures.js';

const tokenizer = await loadTokenizer(SYNTHETIC_8192_DIR);
const ids = (text: string) => tokenizer.encode(text);

const answer =
  '<think>The user wants the weather; 需要调用工具。</think>Let me check 天气.' +
  '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|>' +
  '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"query": "news"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>';

/** Folds events back into the parsed shape, as a streaming client would. */
function fold(events: ChatOutputEvent[]) {
  const out = { content: '', reasoning: '', calls: [] as { id: string; name: string; arguments: string; ended: boolean }[], ended: false };
  for (const e of events) {
    if (e.type === 'content') out.content += e.text;
    else if (e.type === 'reasoning') out.reasoning += e.text;
    else if (e.type === 'tool_call') out.calls[e.index] = { id: e.id, name: e.name, arguments: '', ended: false };
    else if (e.type === 'tool_call_arguments') out.calls[e.index].arguments += e.text;
    else if (e.type === 'tool_call_end') out.calls[e.index].ended = true;
    else out.ended = true;
  }
  return out;
}

describe('ChatOutputParser', () => {
  it('splits an answer into reasoning, content and tool calls', () => {
    expect(parseChatOutput(tokenizer, ids(answer))).toEqual({
      content: 'Let me check 天气.',
      reasoning: 'The user wants the weather; 需要调用工具。',
      toolCalls: [
        { id: 'functions.get_weather:0', name: 'get_weather', arguments: '{"city": "北京"}', complete: true },
        { id: 'functions.search:1', name: 'search', arguments: '{"query": "news"}', complete: true },
      ],
      finished: true,
    });
  });

  it('gives the same result streamed one id at a time, in events that never split a character', () => {
    const all = ids(answer);
    const parser = tokenizer.outputParser();
    const events = all.flatMap((id) => parser.push(id)).concat(parser.finish());
    const folded = fold(events);
    const whole = parseChatOutput(tokenizer, all);
    expect(folded.content).toBe(whole.content);
    expect(folded.reasoning).toBe(whole.reasoning);
    expect(folded.calls.map((c) => [c.id, c.name, c.arguments, c.ended])).toEqual(whole.toolCalls.map((c) => [c.id, c.name, c.arguments, c.complete]));
    expect(folded.ended).toBe(true);
    for (const e of events) if ('text' in e) expect(e.text).not.toContain('\ufffd');
    // the header of a call comes before its arguments, and its end after them
    const kinds = events.filter((e) => e.type.startsWith('tool_call') && 'index' in e && e.index === 0).map((e) => e.type);
    expect(kinds[0]).toBe('tool_call');
    expect(kinds.at(-1)).toBe('tool_call_end');
  });

  it('streams the same under any chunking (property)', () => {
    const all = ids(answer);
    const whole = parseChatOutput(tokenizer, all);
    fc.assert(
      fc.property(fc.array(fc.integer({ min: 1, max: 7 }), { minLength: 1, maxLength: 8 }), (sizes) => {
        const parser = tokenizer.outputParser();
        const events: ChatOutputEvent[] = [];
        for (let i = 0, k = 0; i < all.length; k++) {
          events.push(...parser.push(all.slice(i, i + sizes[k % sizes.length])));
          i += sizes[k % sizes.length];
        }
        events.push(...parser.finish());
        const f = fold(events);
        expect([f.content, f.reasoning, f.calls.map((c) => c.arguments)]).toEqual([whole.content, whole.reasoning, whole.toolCalls.map((c) => c.arguments)]);
        expect(parser.result()).toEqual(whole);
      }),
      { numRuns: 100 },
    );
  });

  it('takes marker text written as ordinary tokens as text, not as a marker', () => {
    const text = ids('Use <think> tags and <|tool_call_begin|> literally.', );
    const ordinary = tokenizer.encode('Use <think> tags and <|tool_call_begin|> literally.', { allowSpecial: false });
    expect(parseChatOutput(tokenizer, ordinary)).toEqual({ content: 'Use <think> tags and <|tool_call_begin|> literally.', reasoning: null, toolCalls: [], finished: false });
    expect(parseChatOutput(tokenizer, text).reasoning).not.toBeNull();
  });

  it('reports a cut-off answer: unfinished, an open tool call incomplete', () => {
    const cut = ids('<think>hmm</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": ');
    expect(parseChatOutput(tokenizer, cut)).toEqual({ content: '', reasoning: 'hmm', toolCalls: [{ id: 'functions.f:0', name: 'f', arguments: '{"a": ', complete: false }], finished: false });
    const header = ids('<|tool_call_begin|>functions.g:3');
    expect(parseChatOutput(tokenizer, header).toolCalls).toEqual([{ id: 'functions.g:3', name: 'g', arguments: '', complete: false }]);
  });

  it('starts inside the thinking block when the prompt opened it, and stops at the end of the turn', () => {
    const out = parseChatOutput(tokenizer, ids('still thinking</think>Answer.<|im_end|>ignored'), { startInReasoning: true });
    expect(out).toEqual({ content: 'Answer.', reasoning: 'still thinking', toolCalls: [], finished: true });
    expect(parseChatOutput(tokenizer, ids('A[EOS]B')).content).toBe('A');
    expect(parseChatOutput(tokenizer, ids('A<|im_end|>B'), { endOfTurnIds: [] }).content).toBe('AB');
  });

  it('drops other special tokens from the text and rejects ids outside the vocabulary', () => {
    expect(parseChatOutput(tokenizer, ids('a<|im_user|>b<|reserved_token_7941|>c')).content).toBe('abc');
    expect(() => tokenizer.outputParser().push([1, 9000])).toThrow(/token id 9000 is outside the vocabulary/);
  });
});

describe('toolNameFromId', () => {
  it("reads the function name out of Kimi's call ids", () => {
    expect(toolNameFromId('functions.get_weather:0')).toBe('get_weather');
    expect(toolNameFromId('functions.ns.tool-x:12')).toBe('ns.tool-x');
    expect(toolNameFromId('lookup')).toBe('lookup');
  });
});
