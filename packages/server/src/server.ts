/**
 * The OpenAI-compatible HTTP server: fastify routes over one engine and its tokenizer.
 *
 *   const server = await createServer({ engine, tokenizer, modelName: 'k2' });
 *   const url = await server.listen({ host: '127.0.0.1', port: 8000 });
 *   // ... POST url/v1/chat/completions with any OpenAI client ...
 *   await server.close(); // finishes what is in flight (or cancels it after the grace period)
 */
import { createHash, timingSafeEqual } from 'node:crypto';
import type { AddressInfo } from 'node:net';
import { EngineError, SPECS, type Engine } from '@kdtree/engine';
import type { Tokenizer } from '@kdtree/tokenizer';
import Fastify, { type FastifyError, type FastifyInstance } from 'fastify';
import { chatRequest, type ChatCompletionBody } from './chat.js';
import { completionRequest, type CompletionBody } from './completions.js';
import { ApiError, ServerError, type ApiErrorBody } from './errors.js';
import { Cancelled, respond, type DecodingOptions, type InFlight, type ServerContext } from './generation.js';
import { ServerMetrics, type Endpoint } from './metrics.js';
import { RequestQueue } from './request-queue.js';
import { chatCompletionSchema, completionSchema } from './schemas.js';
import { schemaError } from './validation.js';

export interface ServerOptions {
  engine: Engine;
  /** The model's tokenizer (its vocabulary must fit in the model's). */
  tokenizer: Tokenizer;
  /** The model id clients send and GET /v1/models lists. */
  modelName: string;
  /** Require `Authorization: Bearer KEY` on /v1/ (health and metrics stay open, for probes and scrapers). */
  apiKey?: string;
  /** Requests held at once, the one generating included; one more gets a 429 (default 16). */
  maxConcurrency?: number;
  /** Speculative decoding for every request, as `kdtree run` (default greedy): the tokens are greedy's either way. */
  decoding?: DecodingOptions;
  /** Run one short generation before serving: loads the drafter, captures the step graphs, measures the budget curve for `budget: 'auto'` (default true). */
  warmup?: boolean;
  /** Largest request body in bytes (default 16 MiB). */
  bodyLimit?: number;
  /** One line per request and per shutdown step (default: nothing). */
  log?: (line: string) => void;
}

export interface ListenOptions {
  /** Default 127.0.0.1 (loopback only); 0.0.0.0 for every interface. */
  host?: string;
  /** Default 8000; 0 picks a free port (see `url`). */
  port?: number;
}

const ENDPOINTS: Record<string, Endpoint> = {
  '/v1/chat/completions': 'chat',
  '/v1/completions': 'completions',
  '/v1/models': 'models',
  '/v1/models/:model': 'models',
  '/health': 'health',
  '/metrics': 'metrics',
};

function sha256(text: string): Buffer {
  return createHash('sha256').update(text).digest();
}

/** Any error a route or hook throws, as the OpenAI error it is answered with. */
function apiErrorOf(error: unknown, contentType: string | undefined): ApiError {
  if (error instanceof ApiError) return error;
  const e = error as FastifyError;
  if (Array.isArray(e?.validation)) return schemaError(e.validation);
  switch (e?.code) {
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return new ApiError(400, 'invalid_request_error', 'The request body is empty: expected a JSON object.', null, 'invalid_json');
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return new ApiError(400, 'invalid_request_error', 'We could not parse the JSON body of your request: it is not valid JSON.', null, 'invalid_json');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new ApiError(415, 'invalid_request_error', `Content-Type '${contentType ?? ''}' is not supported: send the body as JSON with Content-Type: application/json.`, null, 'unsupported_media_type');
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new ApiError(413, 'invalid_request_error', 'The request body is larger than this server accepts.', null, 'request_too_large');
  }
  // the JSON parser's own errors (a SyntaxError, a forbidden __proto__ key) carry a 4xx status
  if (typeof e?.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
    return new ApiError(e.statusCode, 'invalid_request_error', e instanceof SyntaxError ? `We could not parse the JSON body of your request: ${e.message}` : e.message, null, e instanceof SyntaxError ? 'invalid_json' : null);
  }
  if (error instanceof EngineError && (error.code === 'KDTREE_ENGINE_ARGUMENT' || error.code === 'KDTREE_ENGINE_CAPACITY')) {
    return new ApiError(400, 'invalid_request_error', error.message, null, 'invalid_value');
  }
  return new ApiError(500, 'server_error', `internal error: ${(error as Error)?.message ?? String(error)}`, null, 'internal_error', { cause: error });
}

export class KdtreeServer {
  readonly app: FastifyInstance;
  readonly metrics: ServerMetrics;
  readonly queue: RequestQueue;
  private readonly ctx: ServerContext;
  private draining = false;
  private closing?: Promise<void>;

  /** @internal createServer builds servers: it checks the options and warms the engine first. */
  constructor(options: Required<Pick<ServerOptions, 'engine' | 'tokenizer' | 'modelName' | 'maxConcurrency' | 'decoding' | 'bodyLimit' | 'log'>> & { apiKey?: string }) {
    this.queue = new RequestQueue(options.maxConcurrency);
    this.metrics = new ServerMetrics(this.queue);
    const ctx: ServerContext = {
      engine: options.engine,
      tokenizer: options.tokenizer,
      modelName: options.modelName,
      decoding: options.decoding,
      metrics: this.metrics,
      queue: this.queue,
      created: Math.floor(Date.now() / 1000),
      inFlight: new Set<InFlight>(),
      log: options.log,
    };
    this.ctx = ctx;
    const app = Fastify({
      logger: false,
      bodyLimit: options.bodyLimit,
      // shutdown answers new requests itself, in the OpenAI shape (see the onRequest hook)
      return503OnClosing: false,
      // no type coercion: "max_tokens": "5" is an error, as in the OpenAI API; `verbose` gives the
      // failing schema, whose description says what was expected
      ajv: { customOptions: { coerceTypes: false, removeAdditional: false, useDefaults: false, allErrors: false, verbose: true, allowUnionTypes: true } },
    });
    this.app = app;
    // the API takes JSON only: a form or plain-text body gets a 415 that says so
    app.removeContentTypeParser('text/plain');
    const key = options.apiKey === undefined ? undefined : sha256(options.apiKey);

    app.addHook('onRequest', async (request) => {
      const path = request.url.split('?')[0];
      if (this.draining && path !== '/health' && path !== '/metrics') throw new ApiError(503, 'server_error', 'the server is shutting down', null, 'server_shutting_down');
      if (key !== undefined && path.startsWith('/v1/')) {
        const m = /^Bearer\s+(\S+)\s*$/i.exec(request.headers.authorization ?? '');
        if (m === null) throw new ApiError(401, 'invalid_request_error', "You didn't provide an API key. Send it in an Authorization header using Bearer auth (Authorization: Bearer YOUR_KEY).", null, 'missing_api_key');
        // compared as digests: the same length whatever was sent, in constant time
        if (!timingSafeEqual(sha256(m[1]), key)) throw new ApiError(401, 'invalid_request_error', 'Incorrect API key provided.', null, 'invalid_api_key');
      }
    });
    app.addHook('onResponse', async (request, reply) => {
      this.metrics.requests.inc({ endpoint: ENDPOINTS[request.routeOptions.url ?? ''] ?? 'other', status: String(reply.statusCode) });
    });
    app.setErrorHandler((error, request, reply) => {
      const api = apiErrorOf(error, request.headers['content-type']);
      if (api.code === 'internal_error') ctx.log(`${request.method} ${request.url} 500: ${(error as Error)?.stack ?? String(error)}`);
      return reply.code(api.status).send(api.toBody());
    });
    app.setNotFoundHandler((request, reply) => {
      const body: ApiErrorBody = { error: { message: `Invalid URL (${request.method} ${request.url})`, type: 'invalid_request_error', param: null, code: 'unknown_url' } };
      return reply.code(404).send(body);
    });

    const checkModel = (model: string) => {
      if (model !== ctx.modelName) throw new ApiError(404, 'invalid_request_error', `The model '${model}' does not exist: this server serves '${ctx.modelName}' (GET /v1/models).`, 'model', 'model_not_found');
    };
    app.post<{ Body: ChatCompletionBody }>('/v1/chat/completions', { schema: { body: chatCompletionSchema } }, async (request, reply) => {
      checkModel(request.body.model);
      return respond(ctx, request, reply, chatRequest(ctx, request.body));
    });
    app.post<{ Body: CompletionBody }>('/v1/completions', { schema: { body: completionSchema } }, async (request, reply) => {
      checkModel(request.body.model);
      return respond(ctx, request, reply, completionRequest(ctx, request.body));
    });
    const model = () => ({ id: ctx.modelName, object: 'model', created: ctx.created, owned_by: 'kdtree', max_model_len: ctx.engine.options.cacheTokens });
    app.get('/v1/models', async () => ({ object: 'list', data: [model()] }));
    app.get<{ Params: { model: string } }>('/v1/models/:model', async (request) => {
      checkModel(request.params.model);
      return model();
    });
    app.get('/health', async (_request, reply) => {
      const e = ctx.engine;
      return reply.code(this.draining ? 503 : 200).send({
        status: this.draining ? 'shutting_down' : 'ok',
        model: ctx.modelName,
        backend: e.backend.kind,
        device: e.device,
        spec: ctx.decoding.spec ?? 'greedy',
        queue: { running: this.queue.running ? 1 : 0, waiting: this.queue.waiting, capacity: this.queue.capacity },
      });
    });
    app.get('/metrics', async (_request, reply) => reply.type(this.metrics.registry.contentType).send(await this.metrics.registry.metrics()));
  }

  /** Starts listening; returns the base URL (`http://127.0.0.1:8000`). */
  async listen(options: ListenOptions = {}): Promise<string> {
    const host = options.host ?? '127.0.0.1';
    await this.app.listen({ host, port: options.port ?? 8000 });
    return this.url;
  }

  /** The base URL the server listens on. */
  get url(): string {
    const address = this.app.server.address() as AddressInfo | null;
    if (address === null || typeof address === 'string') throw new ServerError('KDTREE_SERVER_STATE', 'the server is not listening', 'url');
    const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
    return `http://${host}:${address.port}`;
  }

  /** Requests being answered now (generating or waiting). */
  get inFlight(): number {
    return this.ctx.inFlight.size;
  }

  /** Cancels every request in flight (their streams end with an error event, the others get a 503). */
  cancelAll(): void {
    for (const r of this.ctx.inFlight) r.controller.abort(new Cancelled('shutdown'));
  }

  /**
   * Graceful shutdown: stops accepting connections, answers new requests with a 503, lets the
   * requests in flight finish for up to `graceMs` (default 10 s), cancels what is left, then
   * closes. The engine is the caller's to dispose.
   */
  close(options: { graceMs?: number } = {}): Promise<void> {
    this.closing ??= (async () => {
      const graceMs = options.graceMs ?? 10_000;
      this.draining = true;
      this.queue.close('the server is shutting down');
      const stopped = this.app.close();
      const pending = () => Promise.all([...this.ctx.inFlight].map((r) => r.done));
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), graceMs)));
      if ((await Promise.race([pending(), late])) === 'late') {
        this.ctx.log(`shutdown: cancelling ${this.ctx.inFlight.size} request(s) still in flight after ${graceMs} ms`);
        this.cancelAll();
        await pending();
      }
      clearTimeout(timer);
      // the answered connections that clients keep alive would hold close() open until they time out
      const reaper = setInterval(() => this.app.server.closeIdleConnections(), 50);
      this.app.server.closeIdleConnections();
      try {
        await stopped;
      } finally {
        clearInterval(reaper);
      }
    })();
    return this.closing;
  }
}

/** Checks the options, warms the engine up (unless `warmup: false`) and builds the server; `listen()` starts it. */
export async function createServer(options: ServerOptions): Promise<KdtreeServer> {
  const { engine, tokenizer } = options ?? {};
  if (engine === undefined || typeof engine.generate !== 'function') throw new ServerError('KDTREE_SERVER_ARGUMENT', 'expected an Engine (createEngine from @kdtree/engine)', 'engine');
  if (tokenizer === undefined || typeof tokenizer.encode !== 'function') throw new ServerError('KDTREE_SERVER_ARGUMENT', 'expected a Tokenizer (@kdtree/tokenizer)', 'tokenizer');
  if (tokenizer.vocabSize > engine.config.vocabSize) {
    throw new ServerError('KDTREE_SERVER_ARGUMENT', `the tokenizer (${tokenizer.source}) has ${tokenizer.vocabSize} tokens, more than the model's vocabulary of ${engine.config.vocabSize}: it is not this model's tokenizer`, 'tokenizer');
  }
  if (typeof options.modelName !== 'string' || options.modelName === '') throw new ServerError('KDTREE_SERVER_ARGUMENT', 'expected a non-empty model name', 'modelName');
  const maxConcurrency = options.maxConcurrency ?? 16;
  if (!Number.isSafeInteger(maxConcurrency) || maxConcurrency < 1) throw new ServerError('KDTREE_SERVER_ARGUMENT', `expected an integer >= 1, got ${String(maxConcurrency)}`, 'maxConcurrency');
  if (options.apiKey !== undefined && (typeof options.apiKey !== 'string' || !/^\S+$/.test(options.apiKey))) throw new ServerError('KDTREE_SERVER_ARGUMENT', 'expected a non-empty key without spaces', 'apiKey');
  const decoding = { ...(options.decoding ?? {}) };
  if (decoding.spec !== undefined && !SPECS.includes(decoding.spec)) throw new ServerError('KDTREE_SERVER_ARGUMENT', `expected one of ${SPECS.join(', ')}, got '${String(decoding.spec)}'`, 'decoding.spec');
  if (options.warmup ?? true) {
    // a prompt of one token and two new ones: a prefill and one step, so the step's graph is captured
    // and every decoding option is checked (an EngineError names the one at fault)
    await engine.complete([tokenizer.bosId ?? 0], { maxNew: 2, eos: [], ...decoding });
  }
  return new KdtreeServer({ engine, tokenizer, modelName: options.modelName, apiKey: options.apiKey, maxConcurrency, decoding, bodyLimit: options.bodyLimit ?? 16 << 20, log: options.log ?? (() => {}) });
}
