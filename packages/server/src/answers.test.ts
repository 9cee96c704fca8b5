/**
 * How an answer's tokens become the response: reasoning, content and Kimi tool calls for chat,
 * text for completions, stop sequences across token boundaries, the finish reason. The tokens are
 * scripted (a random model writes none of these structures), fed a few at a time as speculative
 * steps deliver them.
 */
import { syntheticTokenizerFiles, Tokenizer } from '@kdtree/tokenizer';
import { beforeAll, describe, expect, it } from 'vitest';
import { chatRequest, type ChatCompletionBody, type ChatDelta } from './chat.js';
import { completionRequest, type TextDelta } from './completions.js';
import type { GenerationRequest, ServerContext } from './generation.js';
import { ServerMetrics } from './metrics.js';
import { RequestQueue } from './request-queue.js';
import { testModel } from './test-support/serve.js';

let ctx: ServerContext;
beforeAll(async () => {
  const { engine, tokenizer } = await testModel();
  const queue = new RequestQueue(4);
  ctx = { engine, tokenizer, modelName: 'm', decoding: {}, metrics: new ServerMetrics(queue), queue, created: 0, inFlight: new Set(), log: () => {} };
});

/** Feeds `ids` in steps of `step` tokens until the answer is done; every delta, then finish()'s. */
function feed<D>(r: GenerationRequest<D>, ids: number[], step = 3): D[] {
  const deltas = [...r.answer.start()];
  for (let i = 0; i < ids.length && !r.answer.done; i += step) deltas.push(...r.answer.push(ids.slice(i, i + step)));
  deltas.push(...r.answer.finish());
  return deltas;
}

const chat = (extra: Partial<ChatCompletionBody> = {}) => chatRequest(ctx, { model: 'm', messages: [{ role: 'user', content: 'Weather in Paris?' }], ...extra });
const joined = (deltas: ChatDelta[], key: 'content' | 'reasoning_content') => deltas.map((d) => d[key] ?? '').join('');

describe('chat answers', () => {
  const answer =
    '<think>The user wants weather. 用工具.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0' +
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>ignored after the end';

  it('split thinking into reasoning_content, the rest into content and tool_calls', () => {
    for (const step of [1, 3, 7]) {
      const r = chat();
      const deltas = feed(r, ctx.tokenizer.encode(answer), step);
      expect(deltas[0]).toEqual({ role: 'assistant', content: '' });
      expect(joined(deltas, 'reasoning_content')).toBe('The user wants weather. 用工具.');
      expect(joined(deltas, 'content')).toBe('Let me check.');
      const calls = deltas.flatMap((d) => d.tool_calls ?? []);
      expect(calls[0]).toEqual({ index: 0, id: 'functions.get_weather:0', type: 'function', function: { name: 'get_weather', arguments: '' } });
      expect(calls.map((c) => c.function.arguments).join('')).toBe('{"city": "Paris"}');
      expect(r.answer.done).toBe(true);
      expect(r.answer.finishReason(false)).toBe('tool_calls');
      const body = r.body('chatcmpl-x', 'tool_calls', { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 }, {}) as { choices: { message: unknown }[] };
      expect(body.choices[0].message).toEqual({
        role: 'assistant',
        content: 'Let me check.',
        reasoning_content: 'The user wants weather. 用工具.',
        tool_calls: [{ id: 'functions.get_weather:0', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }],
      });
    }
  });

  it('a stop sequence ends the content before it, even when tokens split it', () => {
    const r = chat({ stop: ['never', 'stop here'] });
    const deltas = feed(r, ctx.tokenizer.encode('Hello world, and stop here please<|im_end|>'), 1);
    expect(joined(deltas, 'content')).toBe('Hello world, and ');
    expect(r.answer.done).toBe(true);
    expect(r.answer.finishReason(false)).toBe('stop');
  });

  it('text held back for a stop sequence goes out before what follows it, and at the end', () => {
    const r = chat({ stop: 'ck.X' });
    const deltas = feed(r, ctx.tokenizer.encode('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>'), 1);
    const order = deltas.flatMap((d) => (d.content ? ['content'] : d.tool_calls ? ['tool'] : []));
    expect(joined(deltas, 'content')).toBe('Let me check.');
    expect(order.lastIndexOf('content')).toBeLessThan(order.indexOf('tool'));
    const cut = chat({ stop: 'ck.X' });
    expect(joined(feed(cut, ctx.tokenizer.encode('Let me check.')), 'content')).toBe('Let me check.');
    expect(cut.answer.finishReason(true)).toBe('length');
  });

  it('a template whose generation prompt opens <think> leaves the answer in reasoning until </think>', () => {
    const files = syntheticTokenizerFiles({ vocabSize: 8192 });
    files['chat_template.jinja'] = files['chat_template.jinja'].replace(/<\|im_assistant\|>assistant<\|im_middle\|>\n?(\s*\{%-? endif)/, '<|im_assistant|>assistant<|im_middle|><think>$1');
    const thinking = new Tokenizer(files);
    try {
      const r = chatRequest({ ...ctx, tokenizer: thinking }, { model: 'm', messages: [{ role: 'user', content: 'Hi' }] });
      expect(r.prompt[r.prompt.length - 1]).toBe(thinking.specialId('<think>'));
      const deltas = feed(r, thinking.encode('weighing it</think>Hello.<|im_end|>'));
      expect(joined(deltas, 'reasoning_content')).toBe('weighing it');
      expect(joined(deltas, 'content')).toBe('Hello.');
    } finally {
      thinking.free();
    }
  });
});

describe('completion answers', () => {
  const text = (deltas: TextDelta[]) => deltas.map((d) => d.text).join('');

  it('end at the eos token (not in the text); special tokens left out unless skip_special_tokens is false', () => {
    const eos = ctx.tokenizer.eosId!;
    const ids = [...ctx.tokenizer.encode('Hi <|im_end|>there 世界'), eos, ...ctx.tokenizer.encode('after')];
    const r = completionRequest(ctx, { model: 'm', prompt: 'x' });
    expect(text(feed(r, ids, 2))).toBe('Hi there 世界');
    expect(r.answer.finishReason(false)).toBe('stop');
    const raw = completionRequest(ctx, { model: 'm', prompt: 'x', skip_special_tokens: false });
    expect(text(feed(raw, ids, 2))).toBe('Hi <|im_end|>there 世界');
  });

  it('a stop sequence split across tokens and characters ends the text before it', () => {
    const r = completionRequest(ctx, { model: 'm', prompt: 'x', stop: ['界!'] });
    expect(text(feed(r, ctx.tokenizer.encode('Hello 世界! and more'), 1))).toBe('Hello 世');
    expect(r.answer.finishReason(false)).toBe('stop');
    const cut = completionRequest(ctx, { model: 'm', prompt: 'x', stop: ['界!'] });
    expect(text(feed(cut, ctx.tokenizer.encode('Hello 世界'), 1))).toBe('Hello 世界');
    expect(cut.answer.finishReason(true)).toBe('length');
  });
});
