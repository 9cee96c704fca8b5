/**
 * One generation request from arrival to its last byte: admission to the queue, the wait for the
 * engine, decoding, the answer as one JSON body or as server-sent events, and what ends it early
 * (a stop sequence, the client going away, the server shutting down).
 */
import { randomBytes } from 'node:crypto';
import type { ServerResponse } from 'node:http';
import { setImmediate as nextTurn } from 'node:timers/promises';
import type { DrafterSpec, Engine, GenerationStats, Spec } from '@kdtree/engine';
import type { Tokenizer } from '@kdtree/tokenizer';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { ApiError, invalidRequest } from './errors.js';
import type { Endpoint, ServerMetrics } from './metrics.js';
import type { RequestQueue } from './request-queue.js';

/** Speculative decoding for every request (as `kdtree run`): the tokens are greedy's either way. */
export interface DecodingOptions {
  spec?: Spec;
  drafter?: DrafterSpec;
  budget?: number | 'auto';
  depth?: number;
}

export interface ServerContext {
  engine: Engine;
  tokenizer: Tokenizer;
  modelName: string;
  decoding: DecodingOptions;
  metrics: ServerMetrics;
  queue: RequestQueue;
  /** Unix seconds the server started (the model's `created`). */
  created: number;
  /** Requests being answered, so that shutdown can wait for them or cancel them. */
  inFlight: Set<InFlight>;
  log: (line: string) => void;
}

export interface InFlight {
  controller: AbortController;
  done: Promise<void>;
}

/** Why a generation was aborted: the signal's reason. */
export class Cancelled extends Error {
  constructor(readonly reason: 'client_disconnect' | 'shutdown') {
    super(reason === 'shutdown' ? 'the server is shutting down; the request was cancelled' : 'the client disconnected');
    this.name = 'Cancelled';
  }
}

/** What a finished answer reports, in the OpenAI API's terms. */
export type FinishReason = 'stop' | 'length' | 'tool_calls';

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** Turns the tokens of each step into the deltas a response streams (chat: content, reasoning, tool calls; completions: text). */
export interface Answer<D> {
  /** Deltas before the first generated token (a tool call the request forced). */
  start(): D[];
  push(tokens: readonly number[]): D[];
  /** An end-of-turn token or a stop sequence ended the answer: the rest is not generated. */
  readonly done: boolean;
  /** What the stream still holds (text held back for a stop sequence, an incomplete character). */
  finish(): D[];
  finishReason(cutOff: boolean): FinishReason;
}

/** vLLM's `return_token_ids` fields: the prompt's ids (the first chunk) and the ids a chunk or answer holds. */
export interface TokenIds {
  prompt_token_ids?: number[];
  token_ids?: number[];
}

export interface GenerationRequest<D> {
  endpoint: Endpoint;
  prompt: number[];
  maxNew: number;
  eos: readonly number[];
  stream: boolean;
  includeUsage: boolean;
  returnTokenIds: boolean;
  answer: Answer<D>;
  /** A delta with nothing in it (a chunk that only carries token ids). */
  emptyDelta: D;
  /** A streamed chunk's body (`delta` null: the last chunk, with the finish reason). */
  chunk(id: string, delta: D | null, finishReason: FinishReason | null, ids: TokenIds): Record<string, unknown>;
  /** The non-streaming body. */
  body(id: string, finishReason: FinishReason, usage: Usage, ids: TokenIds): Record<string, unknown>;
  /** The id's prefix: chatcmpl, cmpl. */
  idPrefix: string;
}

/** What both endpoints read the same way: streaming, the usage chunk, vLLM's token ids. */
export function responseOptions(body: { stream?: boolean | null; stream_options?: { include_usage?: boolean } | null; return_token_ids?: boolean | null }): Pick<GenerationRequest<unknown>, 'stream' | 'includeUsage' | 'returnTokenIds'> {
  return { stream: body.stream === true, includeUsage: body.stream_options?.include_usage === true, returnTokenIds: body.return_token_ids === true };
}

/**
 * The room a prompt leaves in the context, checked before the request takes a place in the queue:
 * a prompt over the context, or max_tokens past what is left, is a 400 naming both numbers.
 */
export function checkContext(ctx: ServerContext, promptTokens: number, requested: number | null | undefined, param: string, promptParam: string): number {
  const cap = ctx.engine.options.cacheTokens;
  const scratch = ctx.engine.scratchSlots(ctx.decoding);
  const room = cap - promptTokens - scratch;
  const scratchNote = scratch > 1 ? ` (${scratch - 1} of them kept free for speculative decoding's draft tree)` : '';
  if (room < 1) {
    throw invalidRequest(`This model's maximum context length is ${cap} tokens${scratchNote}. However, your prompt has ${promptTokens} tokens, which leaves no room for an answer. Please shorten the prompt.`, promptParam, 'context_length_exceeded');
  }
  if (requested !== undefined && requested !== null && requested > room) {
    throw invalidRequest(`This model's maximum context length is ${cap} tokens${scratchNote}. However, you requested ${promptTokens + requested} tokens (${promptTokens} in the prompt, ${requested} for the answer): at most ${room} are left for the answer. Please reduce the length of the prompt or of ${param}.`, param, 'context_length_exceeded');
  }
  return requested ?? room;
}

/** The engine's tokens, one step at a time, with the metrics of the generation; yields to the event loop after every step. */
async function* decode(ctx: ServerContext, r: GenerationRequest<unknown>, arrived: number, signal: AbortSignal): AsyncGenerator<number[], GenerationStats | undefined> {
  const m = ctx.metrics;
  m.promptTokens.inc(r.prompt.length);
  let first = true;
  let stats: GenerationStats | undefined;
  for await (const chunk of ctx.engine.generate(r.prompt, { maxNew: r.maxNew, eos: [...r.eos], ...ctx.decoding, signal })) {
    if (chunk.tokens.length > 0) {
      if (first) m.timeToFirstToken.observe((performance.now() - arrived) / 1000);
      else m.acceptedPerStep.observe(chunk.tokens.length);
      first = false;
      m.generationTokens.inc(chunk.tokens.length);
    }
    stats = chunk.stats ?? stats;
    yield chunk.tokens;
    // A step runs synchronously on the host (the cpu twin computes in it; cuda waits for the
    // device): the turn of the event loop between steps is when a health check is answered, a
    // new request queued, or a closed connection noticed and its generation aborted.
    await nextTurn();
  }
  if (stats && stats.tokensPerSecond > 0) m.tokensPerSecond.observe(stats.tokensPerSecond);
  return stats;
}

/** Writes one server-sent event; waits while the client's socket buffer is full. */
async function sendEvent(res: ServerResponse, data: unknown): Promise<void> {
  if (res.destroyed || res.writableEnded) return;
  if (!res.write(`data: ${typeof data === 'string' ? data : JSON.stringify(data)}\n\n`)) {
    await new Promise<void>((resolve) => {
      const done = () => {
        res.off('drain', done);
        res.off('close', done);
        resolve();
      };
      res.on('drain', done);
      res.on('close', done);
    });
  }
}

/** Answers a generation request: admits it (429 when the queue is full), waits its turn, decodes, replies. */
export async function respond<D>(ctx: ServerContext, request: FastifyRequest, reply: FastifyReply, r: GenerationRequest<D>): Promise<unknown> {
  const arrived = performance.now();
  const ticket = ctx.queue.admit();
  const controller = new AbortController();
  const res = reply.raw;
  const onClose = () => {
    if (!res.writableEnded) controller.abort(new Cancelled('client_disconnect'));
  };
  res.on('close', onClose);
  let finished!: () => void;
  const entry: InFlight = { controller, done: new Promise((resolve) => (finished = resolve)) };
  ctx.inFlight.add(entry);
  const id = `${r.idPrefix}-${randomBytes(12).toString('hex')}`;
  const tokens: number[] = [];
  try {
    if (r.stream) {
      reply.hijack();
      res.writeHead(200, { 'content-type': 'text/event-stream; charset=utf-8', 'cache-control': 'no-cache', connection: 'keep-alive', 'x-accel-buffering': 'no' });
      res.flushHeaders();
    }
    // with include_usage, every chunk but the usage chunk says `usage: null`, as OpenAI's do
    const withUsage = (chunk: Record<string, unknown>) => (r.includeUsage ? { ...chunk, usage: null } : chunk);
    let first = true;
    const idsFor = (ids: number[]): TokenIds => {
      if (!r.returnTokenIds) return {};
      const out: TokenIds = first ? { prompt_token_ids: r.prompt, token_ids: ids } : { token_ids: ids };
      first = false;
      return out;
    };
    const send = async (deltas: D[], stepTokens: number[]) => {
      if (!r.stream) return;
      if (deltas.length === 0 && stepTokens.length > 0 && r.returnTokenIds) deltas = [r.emptyDelta];
      for (let i = 0; i < deltas.length; i++) await sendEvent(res, withUsage(r.chunk(id, deltas[i], null, idsFor(i === 0 ? stepTokens : []))));
    };
    await send(r.answer.start(), []);
    await ticket.turn(controller.signal);
    const generation = decode(ctx, r as GenerationRequest<unknown>, arrived, controller.signal);
    for await (const step of generation) {
      tokens.push(...step);
      await send(r.answer.push(step), step);
      if (r.answer.done) break;
    }
    await send(r.answer.finish(), []);
    // the engine stops at maxNew; an answer that ran out of room without its end was cut off
    const finishReason = r.answer.finishReason(!r.answer.done && tokens.length >= r.maxNew);
    const usage: Usage = { prompt_tokens: r.prompt.length, completion_tokens: tokens.length, total_tokens: r.prompt.length + tokens.length };
    const seconds = (performance.now() - arrived) / 1000;
    ctx.log(`${request.method} ${request.url} 200 ${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens in ${seconds.toFixed(2)} s (${finishReason})`);
    if (!r.stream) return reply.send(r.body(id, finishReason, usage, r.returnTokenIds ? { prompt_token_ids: r.prompt, token_ids: tokens } : {}));
    await sendEvent(res, withUsage(r.chunk(id, null, finishReason, {})));
    if (r.includeUsage) await sendEvent(res, { ...r.chunk(id, null, null, {}), choices: [], usage });
    await sendEvent(res, '[DONE]');
    res.end();
    return reply;
  } catch (error) {
    const reason = controller.signal.aborted ? (controller.signal.reason as Cancelled) : undefined;
    if (reason instanceof Cancelled) {
      ctx.metrics.cancelled.inc({ reason: reason.reason });
      ctx.log(`${request.method} ${request.url} cancelled after ${tokens.length} generated tokens: ${reason.message}`);
    }
    const failure = reason instanceof Cancelled
      ? new ApiError(503, 'server_error', reason.message, null, reason.reason === 'shutdown' ? 'server_shutting_down' : 'client_disconnected')
      : error instanceof ApiError
        ? error
        : new ApiError(500, 'server_error', `the generation failed: ${(error as Error)?.message ?? String(error)}`, null, 'generation_failed', { cause: error });
    if (failure.code === 'generation_failed') ctx.log(`${request.method} ${request.url} 500: ${(error as Error)?.stack ?? String(error)}`);
    if (!r.stream) throw failure;
    // the status line went out with the first event: the error travels as an event, as OpenAI's does
    await sendEvent(res, failure.toBody());
    res.end();
    return reply;
  } finally {
    res.off('close', onClose);
    ticket.release();
    ctx.inFlight.delete(entry);
    finished();
    ctx.metrics.requestDuration.observe({ endpoint: r.endpoint }, (performance.now() - arrived) / 1000);
  }
}
