/**
 * A request's life beyond the happy path: the client goes away (generating or waiting in the
 * queue) and its generation is cancelled so the engine serves the next one; the server shuts
 * down gracefully (what is in flight finishes) or, past the grace period, cancels what is left.
 */
import OpenAI from 'openai';
import { beforeAll, describe, expect, it } from 'vitest';
import { completionStopTokens } from './index.js';
import { MODEL, serve, testModel, type Served } from './test-support/serve.js';

let s: Served;
beforeAll(async () => {
  s = await serve();
});

async function metric(url: string, name: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = new RegExp(`^${name.replace(/[{}"]/g, (c) => `\\${c}`)} (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : 0;
}

/** Starts a long streaming completion with fetch and reads `events` server-sent events of it. */
async function startStream(url: string, maxTokens: number, events: number, signal: AbortSignal, prompt = 'Tell me a long story.'): Promise<string[]> {
  const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt, max_tokens: maxTokens, stream: true }), signal });
  expect(res.status).toBe(200);
  const reader = res.body!.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  const seen: string[] = [];
  while (seen.length < events) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const parts = buffer.split('\n\n');
    buffer = parts.pop()!;
    seen.push(...parts);
  }
  return seen;
}

const health = async (url: string) => ((await (await fetch(`${url}/health`)).json()) as { queue: { running: number; waiting: number } }).queue;

async function until(condition: () => Promise<boolean>, what: string, ms = 20_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await condition())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

describe('a client that disconnects', () => {
  it('cancels its streaming generation; the engine serves the next request at once, exactly', async () => {
    const before = await metric(s.url, 'kdtree_generation_tokens_total');
    const controller = new AbortController();
    const events = await startStream(s.url, 400, 3, controller.signal);
    expect(events).toHaveLength(3);
    controller.abort();
    await until(async () => (await metric(s.url, 'kdtree_generations_cancelled_total{reason="client_disconnect"}')) === 1, 'the cancellation');
    // 400 tokens would take seconds on the cpu twin: the generation stopped a step or two after the disconnect
    const generated = (await metric(s.url, 'kdtree_generation_tokens_total')) - before;
    expect(generated).toBeGreaterThanOrEqual(3);
    expect(generated).toBeLessThan(40);
    expect(await health(s.url)).toMatchObject({ running: 0, waiting: 0 });
    const ids = s.tokenizer.encode('After the cancel:');
    const expected = (await s.engine.complete(ids, { maxNew: 6, eos: completionStopTokens(s.engine.config, s.tokenizer) })).tokens;
    const next = await s.client.completions.create({ model: MODEL, prompt: 'After the cancel:', max_tokens: 6, return_token_ids: true } as OpenAI.CompletionCreateParamsNonStreaming);
    expect((next.choices[0] as unknown as { token_ids: number[] }).token_ids).toEqual(expected);
  });

  it('cancels a non-streaming generation too, and leaves the queue when it was waiting', async () => {
    const cancelled = await metric(s.url, 'kdtree_generations_cancelled_total{reason="client_disconnect"}');
    // a long stream holds the engine; a second request waits behind it, then its client leaves
    const holder = new AbortController();
    await startStream(s.url, 400, 2, holder.signal);
    const waiter = new AbortController();
    const waiting = fetch(`${s.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt: 'x', max_tokens: 400 }), signal: waiter.signal }).catch((e: Error) => e);
    await until(async () => (await health(s.url)).waiting === 1, 'the second request to queue');
    waiter.abort();
    expect(await waiting).toBeInstanceOf(Error);
    await until(async () => (await health(s.url)).waiting === 0, 'the waiting request to leave');
    expect((await health(s.url)).running).toBe(1);
    holder.abort();
    await until(async () => (await health(s.url)).running === 0, 'the engine to be free');
    expect(await metric(s.url, 'kdtree_generations_cancelled_total{reason="client_disconnect"}')).toBe(cancelled + 2);
    // a non-streaming request whose client gives up while it generates
    const before = await metric(s.url, 'kdtree_generation_tokens_total');
    const r = await fetch(`${s.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt: 'y', max_tokens: 400 }), signal: AbortSignal.timeout(400) }).catch((e: Error) => e);
    expect(r).toBeInstanceOf(Error);
    await until(async () => (await metric(s.url, 'kdtree_generations_cancelled_total{reason="client_disconnect"}')) === cancelled + 3, 'the cancellation');
    expect((await metric(s.url, 'kdtree_generation_tokens_total')) - before).toBeLessThan(100);
  });
});

describe('shutdown', () => {
  it('finishes the requests in flight and refuses new ones', async () => {
    const { engine, tokenizer } = await testModel();
    const own = await serve({ warmup: false });
    const stream = await own.client.completions.create({ model: MODEL, prompt: 'Finish me.', max_tokens: 12, stream: true, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming);
    const tokens: number[] = [];
    const iterator = stream[Symbol.asyncIterator]();
    const first = await iterator.next();
    tokens.push(...((first.value?.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
    const closed = own.server.close({ graceMs: 30_000 });
    // the listening socket is closed: a new connection is refused (or, on a kept-alive one, a 503)
    const late = await fetch(`${own.url}/v1/models`).then((r) => r.status, () => 'refused');
    expect([503, 'refused']).toContain(late);
    for (let r = await iterator.next(); !r.done; r = await iterator.next()) tokens.push(...((r.value.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []));
    await closed;
    const ids = tokenizer.encode('Finish me.');
    expect(tokens).toEqual((await engine.complete(ids, { maxNew: 12, eos: completionStopTokens(engine.config, tokenizer) })).tokens);
  });

  it('past the grace period cancels what is left: the stream ends with an error event; the engine stays usable', async () => {
    const { engine } = await testModel();
    const own = await serve({ warmup: false });
    const stream = await own.client.completions.create({ model: MODEL, prompt: 'Never mind.', max_tokens: 400, stream: true });
    const iterator = stream[Symbol.asyncIterator]();
    await iterator.next();
    const t0 = performance.now();
    const closed = own.server.close({ graceMs: 200 });
    let error: unknown;
    try {
      for (let r = await iterator.next(); !r.done; r = await iterator.next());
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(OpenAI.APIError);
    expect((error as Error).message).toMatch(/the server is shutting down; the request was cancelled/);
    await closed;
    expect(performance.now() - t0).toBeLessThan(5000);
    expect(await metric(s.url, 'kdtree_queue_depth')).toBe(0);
    expect((await engine.complete([1, 2, 3], { maxNew: 2, eos: [] })).tokens).toHaveLength(2);
  });
});
