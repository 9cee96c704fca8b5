/**
 * Concurrent clients on loopback: the engine decodes one sequence at a time, so requests queue;
 * none is lost, no token is lost or mixed between streams, /health answers throughout, and past
 * the queue's bound a request is refused with a 429 at once.
 */
import OpenAI from 'openai';
import { beforeAll, describe, expect, it } from 'vitest';
import { completionStopTokens } from './index.js';
import { MODEL, serve, type Served } from './test-support/serve.js';

const CLIENTS = 8;
const MAX_TOKENS = 8;

let s: Served;
beforeAll(async () => {
  s = await serve({ maxConcurrency: CLIENTS });
});

interface Streamed {
  text: string;
  tokens: number[];
  usage?: OpenAI.CompletionUsage | null;
  finish: string | null;
}

async function stream(client: OpenAI, prompt: string): Promise<Streamed> {
  const r = await client.completions.create({ model: MODEL, prompt, max_tokens: MAX_TOKENS, stream: true, stream_options: { include_usage: true }, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming);
  const out: Streamed = { text: '', tokens: [], finish: null };
  for await (const chunk of r) {
    const c = chunk.choices[0] as (OpenAI.CompletionChoice & { token_ids?: number[] }) | undefined;
    if (c) {
      out.text += c.text;
      out.tokens.push(...(c.token_ids ?? []));
      out.finish = c.finish_reason ?? out.finish;
    }
    if (chunk.usage) out.usage = chunk.usage;
  }
  return out;
}

describe('under load', () => {
  it(`${CLIENTS} concurrent streaming clients: every request answered, every token its own, /health answering`, async () => {
    const prompts = Array.from({ length: CLIENTS }, (_, i) => `Client ${i} asks: what comes after ${i * 7}?`);
    const eos = completionStopTokens(s.engine.config, s.tokenizer);
    const expected: number[][] = [];
    for (const p of prompts) expected.push((await s.engine.complete(s.tokenizer.encode(p), { maxNew: MAX_TOKENS, eos })).tokens);
    // the prompts differ, and so do the answers: a token in the wrong stream would show
    expect(new Set(expected.map((e) => e.join())).size).toBeGreaterThan(1);

    const health: { status: number; ms: number; waiting: number }[] = [];
    let polling = true;
    const poller = (async () => {
      while (polling) {
        const t0 = performance.now();
        const r = await fetch(`${s.url}/health`);
        const body = (await r.json()) as { queue: { waiting: number } };
        health.push({ status: r.status, ms: performance.now() - t0, waiting: body.queue.waiting });
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    })();
    const results = await Promise.all(prompts.map((p) => stream(s.client, p)));
    polling = false;
    await poller;

    results.forEach((r, i) => {
      expect(r.tokens, `client ${i}`).toEqual(expected[i]);
      expect(r.text, `client ${i}`).toBe(s.tokenizer.decode(expected[i].filter((t) => !eos.includes(t)), { skipSpecial: true }));
      expect(r.usage, `client ${i}`).toEqual({ prompt_tokens: s.tokenizer.encode(prompts[i]).length, completion_tokens: expected[i].length, total_tokens: s.tokenizer.encode(prompts[i]).length + expected[i].length });
      expect(r.finish).toMatch(/^(stop|length)$/);
    });
    // requests did wait for one another, and health was answered between the steps
    expect(Math.max(...health.map((h) => h.waiting))).toBeGreaterThan(0);
    expect(health.length).toBeGreaterThanOrEqual(5);
    expect(health.every((h) => h.status === 200)).toBe(true);
    expect(Math.max(...health.map((h) => h.ms))).toBeLessThan(2000);

    const metrics = await (await fetch(`${s.url}/metrics`)).text();
    const total = expected.reduce((n, e) => n + e.length, 0);
    expect(metrics).toContain(`kdtree_generation_tokens_total ${total}`);
    expect(metrics).toContain(`kdtree_time_to_first_token_seconds_count ${CLIENTS}`);
    expect(metrics).toContain(`kdtree_requests_total{endpoint="completions",status="200"} ${CLIENTS}`);
    expect(metrics).toContain('kdtree_queue_depth 0');
    expect(metrics).toMatch(/kdtree_accepted_tokens_per_step_bucket\{le="1"\} \d+/);
  });

  it('past --max-concurrency, requests are refused at once with a 429; those admitted finish', async () => {
    const small = await serve({ maxConcurrency: 2, warmup: false });
    const prompts = Array.from({ length: 4 }, (_, i) => `request ${i}`);
    const eos = completionStopTokens(s.engine.config, s.tokenizer);
    const expected = await Promise.all(prompts.map(async (p) => (await s.engine.complete(s.tokenizer.encode(p), { maxNew: MAX_TOKENS, eos })).tokens));
    const results = await Promise.allSettled(prompts.map((p) => stream(small.client, p)));
    expect(results.filter((r) => r.status === 'fulfilled')).toHaveLength(2);
    results.forEach((r, i) => {
      if (r.status === 'fulfilled') {
        expect(r.value.tokens).toEqual(expected[i]);
        return;
      }
      expect(r.reason).toBeInstanceOf(OpenAI.RateLimitError);
      expect(r.reason).toMatchObject({ status: 429, code: 'server_busy' });
      expect(r.reason.message).toMatch(/the server is busy: 2 requests are generating or waiting, the most it holds \(--max-concurrency 2\)/);
    });
    expect(((await (await fetch(`${small.url}/health`)).json()) as { queue: unknown }).queue).toEqual({ running: 0, waiting: 0, capacity: 2 });
  });
});
