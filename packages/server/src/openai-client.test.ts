/**
 * The official `openai` client against the server on the synthetic k2-mini model: chat and text
 * completions, streaming and not, models; every answer's tokens equal the engine's greedy decoding
 * of the same prompt, and the text equals the tokenizer's decoding of those tokens.
 */
import type OpenAI from 'openai';
import { beforeAll, describe, expect, it } from 'vitest';
import { completionStopTokens } from './index.js';
import { MODEL, serve, type Served } from './test-support/serve.js';

let s: Served;
beforeAll(async () => {
  s = await serve();
});

const messages = [
  { role: 'system' as const, content: 'You are terse.' },
  { role: 'user' as const, content: 'Name three colours, in English and 中文.' },
];

/** The engine's tokens for a prompt, alone: what every answer must equal. */
async function greedy(prompt: number[], maxNew: number, eos: number[]): Promise<number[]> {
  return (await s.engine.complete(prompt, { maxNew, eos })).tokens;
}

function chatEos(): number[] {
  return [...new Set([...s.tokenizer.endOfTurnIds, ...s.engine.config.eosTokenIds])];
}

/** The answer's content as the output parser makes it from the tokens. */
function parsed(tokens: number[]) {
  const parser = s.tokenizer.outputParser({ endOfTurnIds: chatEos() });
  parser.push(tokens);
  parser.finish();
  return parser.result();
}

describe('the openai client', () => {
  it('lists the model and retrieves it', async () => {
    const list = await s.client.models.list();
    expect(list.data).toEqual([{ id: MODEL, object: 'model', created: expect.any(Number), owned_by: 'kdtree', max_model_len: 512 }]);
    expect((await s.client.models.retrieve(MODEL)).id).toBe(MODEL);
  });

  it('chat: the answer is the engine greedy tokens through the chat template and the output parser', async () => {
    const r = await s.client.chat.completions.create({ model: MODEL, messages, max_tokens: 24, return_token_ids: true } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    const prompt = s.tokenizer.encodeChat(messages, { addGenerationPrompt: true });
    const expected = await greedy(prompt, 24, chatEos());
    const extra = r as unknown as { prompt_token_ids: number[]; choices: { token_ids: number[] }[] };
    expect(extra.prompt_token_ids).toEqual(prompt);
    expect(extra.choices[0].token_ids).toEqual(expected);
    expect(r.object).toBe('chat.completion');
    expect(r.model).toBe(MODEL);
    expect(r.id).toMatch(/^chatcmpl-[0-9a-f]{24}$/);
    expect(r.choices[0].message.role).toBe('assistant');
    expect(r.choices[0].message.content).toBe(parsed(expected).content);
    expect(r.choices[0].finish_reason).toBe(expected.length === 24 && !chatEos().includes(expected[23]) ? 'length' : 'stop');
    expect(r.usage).toEqual({ prompt_tokens: prompt.length, completion_tokens: expected.length, total_tokens: prompt.length + expected.length });
  });

  it('chat, streaming: the deltas concatenate to the non-streaming answer; the usage chunk comes last', async () => {
    const whole = await s.client.chat.completions.create({ model: MODEL, messages, max_completion_tokens: 20 });
    const stream = await s.client.chat.completions.create({ model: MODEL, messages, max_completion_tokens: 20, stream: true, stream_options: { include_usage: true } });
    const chunks: OpenAI.ChatCompletionChunk[] = [];
    for await (const chunk of stream) chunks.push(chunk);
    expect(chunks[0].choices[0].delta.role).toBe('assistant');
    const content = chunks.map((c) => c.choices[0]?.delta.content ?? '').join('');
    expect(content).toBe(whole.choices[0].message.content);
    const finals = chunks.filter((c) => c.choices[0]?.finish_reason);
    expect(finals.map((c) => c.choices[0].finish_reason)).toEqual([whole.choices[0].finish_reason]);
    const last = chunks[chunks.length - 1];
    expect(last.choices).toEqual([]);
    expect(last.usage).toEqual(whole.usage);
    // with include_usage every other chunk says usage: null, as OpenAI's do
    expect(chunks.slice(0, -1).every((c) => c.usage === null)).toBe(true);
    expect(new Set(chunks.map((c) => c.id)).size).toBe(1);
  });

  it('completions: text and tokens, streaming and not, equal the engine and the tokenizer', async () => {
    const prompt = 'The tokenizer reads 中文 and English:';
    const ids = s.tokenizer.encode(prompt);
    const expected = await greedy(ids, 16, completionStopTokens(s.engine.config, s.tokenizer));
    const r = await s.client.completions.create({ model: MODEL, prompt, max_tokens: 16, return_token_ids: true } as OpenAI.CompletionCreateParamsNonStreaming);
    const choice = r.choices[0] as OpenAI.CompletionChoice & { token_ids: number[]; prompt_token_ids: number[] };
    expect(choice.prompt_token_ids).toEqual(ids);
    expect(choice.token_ids).toEqual(expected);
    const eos = new Set(completionStopTokens(s.engine.config, s.tokenizer));
    const text = s.tokenizer.decode(expected.filter((t) => !eos.has(t)), { skipSpecial: true });
    expect(choice.text).toBe(text);
    expect(r.object).toBe('text_completion');
    expect(r.usage).toEqual({ prompt_tokens: ids.length, completion_tokens: expected.length, total_tokens: ids.length + expected.length });

    const stream = await s.client.completions.create({ model: MODEL, prompt, max_tokens: 16, stream: true, stream_options: { include_usage: true }, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming);
    const pieces: string[] = [];
    const streamed: number[] = [];
    let usage: OpenAI.CompletionUsage | null | undefined;
    let finish: string | null = null;
    for await (const chunk of stream) {
      const c = chunk.choices[0] as (OpenAI.CompletionChoice & { token_ids?: number[] }) | undefined;
      if (c) {
        pieces.push(c.text);
        streamed.push(...(c.token_ids ?? []));
        finish = c.finish_reason ?? finish;
      }
      usage = chunk.usage ?? usage;
    }
    expect(pieces.join('')).toBe(text);
    expect(streamed).toEqual(expected);
    expect(finish).toBe(r.choices[0].finish_reason);
    expect(usage).toEqual(r.usage);
  });

  it('completions of token ids; a stop sequence ends the text before it, streaming or not', async () => {
    const ids = [1, 7, 42, 3, 99, 5, 64, 11];
    const full = await s.client.completions.create({ model: MODEL, prompt: ids, max_tokens: 24 });
    const text = full.choices[0].text;
    // a stop sequence from the middle of the answer (past its first few characters)
    const at = Math.floor(text.length / 2);
    const stop = [...text.slice(at)].slice(0, 2).join('');
    expect(stop.length).toBeGreaterThan(0);
    const before = text.slice(0, text.indexOf(stop));
    const r = await s.client.completions.create({ model: MODEL, prompt: ids, max_tokens: 24, stop: ['\u0000never', stop] });
    expect(r.choices[0].text).toBe(before);
    expect(r.choices[0].finish_reason).toBe('stop');
    const stream = await s.client.completions.create({ model: MODEL, prompt: ids, max_tokens: 24, stop, stream: true });
    let streamed = '';
    let finish: string | null = null;
    for await (const chunk of stream) {
      streamed += chunk.choices[0]?.text ?? '';
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    expect(streamed).toBe(before);
    expect(finish).toBe('stop');
  });

  it('tool_choice naming a function: the answer is a tool call in Kimi format, parsed into tool_calls', async () => {
    const tools: OpenAI.ChatCompletionTool[] = [
      { type: 'function', function: { name: 'get_weather', description: 'the weather in a city', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } },
      { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } },
    ];
    const ask = [{ role: 'user' as const, content: 'Weather in Paris?' }];
    const r = await s.client.chat.completions.create({ model: MODEL, messages: ask, tools, tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 8, return_token_ids: true } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    const forced = s.tokenizer.encode('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>');
    const prompt = [...s.tokenizer.encodeChat(ask, { tools: tools as never, addGenerationPrompt: true }), ...forced];
    const extra = r as unknown as { prompt_token_ids: number[]; choices: { token_ids: number[] }[] };
    expect(extra.prompt_token_ids).toEqual(prompt);
    const expected = await greedy(prompt, 8, chatEos());
    expect(extra.choices[0].token_ids).toEqual(expected);
    // the arguments are what the parser makes of the answer inside the forced call
    const parser = s.tokenizer.outputParser({ endOfTurnIds: chatEos() });
    parser.push([...forced, ...expected]);
    parser.finish();
    const call = parser.result().toolCalls[0];
    const message = r.choices[0].message;
    expect(message.tool_calls).toEqual([{ id: 'functions.get_weather:0', type: 'function', function: { name: 'get_weather', arguments: call.arguments } }]);

    const stream = await s.client.chat.completions.create({ model: MODEL, messages: ask, tools, tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 8, stream: true });
    const deltas: OpenAI.ChatCompletionChunk.Choice.Delta.ToolCall[] = [];
    for await (const chunk of stream) deltas.push(...(chunk.choices[0]?.delta.tool_calls ?? []));
    expect(deltas[0]).toEqual({ index: 0, id: 'functions.get_weather:0', type: 'function', function: { name: 'get_weather', arguments: '' } });
    expect(deltas.map((d) => d.function?.arguments ?? '').join('')).toBe(call.arguments);
  });

  it('tool_choice none leaves the tools out of the prompt', async () => {
    const tools: OpenAI.ChatCompletionTool[] = [{ type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } }];
    const ask = [{ role: 'user' as const, content: 'Hi' }];
    const r = await s.client.chat.completions.create({ model: MODEL, messages: ask, tools, tool_choice: 'none', max_tokens: 2, return_token_ids: true } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    expect((r as unknown as { prompt_token_ids: number[] }).prompt_token_ids).toEqual(s.tokenizer.encodeChat(ask, { addGenerationPrompt: true }));
  });
});

describe('speculative decoding', () => {
  it('a server decoding with DDTree answers with exactly the greedy tokens', async () => {
    const spec = await serve({ decoding: { spec: 'ddtree', drafter: 'ngram', budget: 8, depth: 3 } });
    const health = (await (await fetch(`${spec.url}/health`)).json()) as { spec: string };
    expect(health.spec).toBe('ddtree');
    // a prompt that repeats itself, so the ngram drafter has continuations to propose
    const prompt = 'one two three four, one two three four, one two three four, one two';
    const ask = { model: MODEL, prompt, max_tokens: 16, return_token_ids: true } as OpenAI.CompletionCreateParamsNonStreaming;
    const [greedy, ddtree] = await Promise.all([s.client.completions.create(ask), spec.client.completions.create(ask)]);
    const ids = (r: OpenAI.Completion) => (r.choices[0] as unknown as { token_ids: number[] }).token_ids;
    expect(ids(ddtree)).toEqual(ids(greedy));
    expect(ddtree.choices[0].text).toBe(greedy.choices[0].text);
    const metrics = await (await fetch(`${spec.url}/metrics`)).text();
    expect(metrics).toMatch(/kdtree_accepted_tokens_per_step_count [1-9]/);
  });
});
