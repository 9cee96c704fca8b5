/**
 * A server on the test model, on loopback, and an official `openai` client pointed at it. One
 * engine per test file (loading it is the slow part); servers come and go around it.
 */
import { createEngine, type Engine } from '@kdtree/engine';
import { openBundle } from '@kdtree/format';
import { tokenizerFromMetadata, type Tokenizer } from '@kdtree/tokenizer';
import OpenAI from 'openai';
import { afterAll, inject } from 'vitest';
import { createServer, type KdtreeServer, type ServerOptions } from '../index.js';

export const MODEL = 'k2-mini';

/** The cpu twin (CI), or KDTREE_TEST_BACKEND=cuda on a GPU machine. */
export const TEST_BACKEND = (process.env.KDTREE_TEST_BACKEND as 'cpu' | 'cuda' | undefined) ?? 'cpu';

export interface Served {
  server: KdtreeServer;
  url: string;
  engine: Engine;
  tokenizer: Tokenizer;
  /** The official client, no retries (a 429 must reach the test, not be retried away). */
  client: OpenAI;
}

let shared: Promise<{ engine: Engine; tokenizer: Tokenizer }> | undefined;

/** The file's engine (TEST_BACKEND, a cache of 512 tokens) and the tokenizer the bundle carries. */
export function testModel(): Promise<{ engine: Engine; tokenizer: Tokenizer }> {
  shared ??= (async () => {
    const path = inject('modelPath');
    const bundle = await openBundle(path);
    const tokenizer = tokenizerFromMetadata(bundle.metadata as Record<string, unknown>, path);
    await bundle.close();
    if (tokenizer === undefined) throw new Error(`${path} carries no tokenizer`);
    const engine = await createEngine({ model: path, backend: TEST_BACKEND, cacheTokens: 512 });
    afterAll(async () => {
      await engine.dispose();
      tokenizer.free();
    });
    return { engine, tokenizer };
  })();
  return shared;
}

/** Starts a server on a free loopback port; closed after the file's tests. */
export async function serve(options: Partial<ServerOptions> = {}): Promise<Served> {
  const { engine, tokenizer } = await testModel();
  const server = await createServer({ engine, tokenizer, modelName: MODEL, ...options });
  const url = await server.listen({ host: '127.0.0.1', port: 0 });
  afterAll(() => server.close({ graceMs: 0 }));
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: options.apiKey ?? 'unused', maxRetries: 0, timeout: 60_000 });
  return { server, url, engine, tokenizer, client };
}

/** A JSON POST with fetch, for requests no client would send. */
export async function post(url: string, body: unknown, headers: Record<string, string> = {}): Promise<{ status: number; json: any; text: string }> {
  const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: typeof body === 'string' ? body : JSON.stringify(body) });
  const text = await res.text();
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return { status: res.status, json, text };
}
