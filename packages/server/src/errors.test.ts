/**
 * Requests that are wrong get a 4xx with the OpenAI error body `{error: {message, type, param,
 * code}}` that names the field, and the server goes on serving; the API key is enforced.
 */
import OpenAI from 'openai';
import { beforeAll, describe, expect, it } from 'vitest';
import { MODEL, post, serve, type Served } from './test-support/serve.js';

let s: Served;
beforeAll(async () => {
  s = await serve();
});

const chat = (extra: Record<string, unknown>) => ({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2, ...extra });

function expectError(r: { status: number; json: any; text: string }, status: number, param: string | null, message: RegExp, code?: string): void {
  expect(r.status, r.text).toBe(status);
  expect(Object.keys(r.json)).toEqual(['error']);
  expect(Object.keys(r.json.error).sort()).toEqual(['code', 'message', 'param', 'type']);
  expect(r.json.error.param, r.text).toBe(param);
  expect(r.json.error.message).toMatch(message);
  expect(r.json.error.type).toBe(status >= 500 ? 'server_error' : status === 429 ? 'rate_limit_error' : 'invalid_request_error');
  if (code !== undefined) expect(r.json.error.code).toBe(code);
}

describe('malformed requests', () => {
  it('get a 4xx in the OpenAI shape naming the field, and the server keeps serving', async () => {
    const chatUrl = `${s.url}/v1/chat/completions`;
    const completions = `${s.url}/v1/completions`;
    const cases: [string, unknown, number, string | null, RegExp, string?][] = [
      [chatUrl, '{"model": "k2-mini", "messages": [', 400, null, /could not parse the JSON body/, 'invalid_json'],
      [chatUrl, '', 400, null, /body is empty/, 'invalid_json'],
      [chatUrl, '[1, 2]', 400, null, /must be a JSON object/],
      [chatUrl, { model: MODEL }, 400, 'messages', /Missing required parameter: 'messages'/, 'missing_required_parameter'],
      [chatUrl, chat({ messages: [] }), 400, 'messages', /expected a non-empty array of messages/],
      [chatUrl, chat({ messages: [{ role: 'robot', content: 'x' }] }), 400, 'messages[0].role', /Invalid value for 'messages\[0\]\.role'/],
      [chatUrl, chat({ messages: [{ role: 'user', content: 5 }] }), 400, 'messages[0].content', /expected a string, an array of content parts/],
      [chatUrl, chat({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }), 400, 'messages[0].content[0].type', /reads text only/],
      [chatUrl, chat({ max_tokens: '5' }), 400, 'max_tokens', /expected an integer >= 1/],
      [chatUrl, chat({ max_tokens: 0 }), 400, 'max_tokens', /expected an integer >= 1/],
      [chatUrl, chat({ stop: 5 }), 400, 'stop', /expected a non-empty string, an array of up to 4/],
      [chatUrl, chat({ temperature: 0.7 }), 400, 'temperature', /temperature 0\.7 is not supported: this server decodes greedily \(temperature 0\) and sampling is not implemented yet/, 'unsupported_value'],
      [chatUrl, chat({ temperature: 3 }), 400, 'temperature', /expected a number in \[0, 2\]/],
      [chatUrl, chat({ n: 2 }), 400, 'n', /n 2 is not supported/],
      [chatUrl, chat({ frequency_penalty: 0.5 }), 400, 'frequency_penalty', /not implemented yet/],
      [chatUrl, chat({ response_format: { type: 'json_object' } }), 400, 'response_format', /constrained decoding/],
      [chatUrl, chat({ logprobs: true }), 400, 'logprobs', /not supported yet/],
      [chatUrl, chat({ tool_choice: 'required' }), 400, 'tool_choice', /needs tools/],
      [chatUrl, chat({ tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: { type: 'function', function: { name: 'g' } } }), 400, 'tool_choice.function.name', /'g', which is not among the tools \(f\)/],
      [chatUrl, chat({ tools: [{ type: 'function', function: { name: 'bad name!' } }] }), 400, 'tools[0].function.name', /a function name/],
      [chatUrl, chat({ model: 'gpt-4o' }), 404, 'model', /The model 'gpt-4o' does not exist: this server serves 'k2-mini'/, 'model_not_found'],
      [chatUrl, chat({ messages: [{ role: 'user', content: 'word '.repeat(600) }] }), 400, 'messages', /maximum context length is 512 tokens\. However, your prompt has \d+ tokens/, 'context_length_exceeded'],
      [chatUrl, chat({ max_tokens: 500 }), 400, 'max_tokens', /you requested \d+ tokens \(\d+ in the prompt, 500 for the answer\): at most \d+ are left/, 'context_length_exceeded'],
      [chatUrl, chat({ max_completion_tokens: 100000 }), 400, 'max_completion_tokens', /context length/, 'context_length_exceeded'],
      [completions, { model: MODEL, prompt: [1, 2, 99999] }, 400, 'prompt', /token id 99999 at index 2 is outside the vocabulary \[0, 8192\)/],
      [completions, { model: MODEL, prompt: '' }, 400, 'prompt', /the prompt is empty/],
      [completions, { model: MODEL, prompt: ['a', 'b'] }, 400, 'prompt', /2 prompts in one request are not supported/],
      [completions, { model: MODEL, prompt: 'x', echo: true }, 400, 'echo', /not supported/],
      [completions, { model: MODEL, prompt: 'x', suffix: 'y' }, 400, 'suffix', /no infilling format/],
      [completions, { model: MODEL, prompt: { text: 'x' } }, 400, 'prompt', /expected a string, an array of token ids/],
    ];
    for (const [url, body, status, param, message, code] of cases) {
      const r = await post(url, body);
      expectError(r, status, param, message, code);
    }
    // not JSON at all, and a URL that is not there
    const form = await fetch(chatUrl, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: 'hello' });
    expectError({ status: form.status, json: await form.json(), text: '' }, 415, null, /Content-Type 'text\/plain' is not supported: send the body as JSON/, 'unsupported_media_type');
    const missing = await fetch(`${s.url}/v1/embeddings`, { method: 'POST' });
    expectError({ status: missing.status, json: await missing.json(), text: '' }, 404, null, /Invalid URL \(POST \/v1\/embeddings\)/);
    // and the server still answers
    const ok = await s.client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 });
    expect(ok.choices[0].finish_reason).toMatch(/stop|length/);
  });

  it('the openai client raises its own error classes from those bodies', async () => {
    const bad = s.client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], temperature: 0.5 });
    await expect(bad).rejects.toBeInstanceOf(OpenAI.BadRequestError);
    await expect(bad).rejects.toMatchObject({ status: 400, param: 'temperature', code: 'unsupported_value' });
    await expect(s.client.completions.create({ model: 'nope', prompt: 'x' })).rejects.toBeInstanceOf(OpenAI.NotFoundError);
    // a streaming request is refused the same way, before the stream starts
    await expect(s.client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], temperature: 1, stream: true })).rejects.toBeInstanceOf(OpenAI.BadRequestError);
  });

  it('count in the metrics by endpoint and status', async () => {
    const metrics = await (await fetch(`${s.url}/metrics`)).text();
    expect(metrics).toMatch(/kdtree_requests_total\{endpoint="chat",status="400"\} \d+/);
    expect(metrics).toMatch(/kdtree_requests_total\{endpoint="chat",status="404"\} \d+/);
    expect(metrics).toMatch(/kdtree_requests_total\{endpoint="chat",status="200"\} \d+/);
  });
});

describe('the api key', () => {
  it('is required on /v1/ when set; /health and /metrics stay open', async () => {
    const keyed = await serve({ apiKey: 'sk-test-123', warmup: false });
    const models = `${keyed.url}/v1/models`;
    const none = await fetch(models);
    expectError({ status: none.status, json: await none.json(), text: '' }, 401, null, /didn't provide an API key/, 'missing_api_key');
    const wrong = await fetch(models, { headers: { authorization: 'Bearer sk-test-124' } });
    expectError({ status: wrong.status, json: await wrong.json(), text: '' }, 401, null, /Incorrect API key/, 'invalid_api_key');
    // a body is not even parsed without the key
    const body = await post(`${keyed.url}/v1/chat/completions`, '{not json');
    expect(body.status).toBe(401);
    expect((await fetch(models, { headers: { authorization: 'Bearer sk-test-123' } })).status).toBe(200);
    expect((await fetch(`${keyed.url}/health`)).status).toBe(200);
    expect((await fetch(`${keyed.url}/metrics`)).status).toBe(200);
    await expect(new OpenAI({ baseURL: `${keyed.url}/v1`, apiKey: 'wrong', maxRetries: 0 }).models.list()).rejects.toBeInstanceOf(OpenAI.AuthenticationError);
    expect((await keyed.client.models.list()).data[0].id).toBe(MODEL);
  });
});
