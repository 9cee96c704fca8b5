/**
 * POST /v1/completions: text in (or token ids), text out, no chat template. The answer stops at
 * the model's end-of-sequence tokens, a stop sequence, or max_tokens (default: the room left in
 * the context).
 */
import type { StreamDecoder } from '@kdtree/tokenizer';
import { invalidRequest, unsupported } from './errors.js';
import { checkContext, responseOptions, type Answer, type FinishReason, type GenerationRequest, type ServerContext } from './generation.js';
import { StopMatcher } from './stop-matcher.js';
import { checkGreedy, stopList, type SamplingParams } from './validation.js';

export interface CompletionBody extends SamplingParams {
  model: string;
  prompt: string | string[] | number[] | number[][];
  stream?: boolean | null;
  stream_options?: { include_usage?: boolean } | null;
  max_tokens?: number | null;
  stop?: string | string[] | null;
  echo?: boolean | null;
  suffix?: string | null;
  best_of?: number | null;
  logprobs?: number | null;
  skip_special_tokens?: boolean | null;
  return_token_ids?: boolean | null;
}

export interface TextDelta {
  text: string;
}

class TextAnswer implements Answer<TextDelta> {
  done = false;
  private stopped = false;
  text = '';

  constructor(
    private readonly decoder: StreamDecoder,
    private readonly stops: StopMatcher,
    private readonly eos: ReadonlySet<number>,
  ) {}

  start(): TextDelta[] {
    return [];
  }

  push(tokens: readonly number[]): TextDelta[] {
    let text = '';
    for (const t of tokens) {
      if (this.done) break;
      // the end-of-sequence token ends the answer and is not part of its text
      if (this.eos.has(t)) {
        text += this.stops.flush();
        this.done = true;
        break;
      }
      const r = this.stops.push(this.decoder.push(t));
      text += r.text;
      if (r.stopped) this.stopped = this.done = true;
    }
    return this.emit(text);
  }

  finish(): TextDelta[] {
    if (this.stopped) return [];
    // an incomplete character at the end of the answer (U+FFFD), then what was held back
    const tail = this.stops.push(this.decoder.flush());
    if (tail.stopped) this.stopped = true;
    return this.emit(tail.text + (tail.stopped ? '' : this.stops.flush()));
  }

  finishReason(cutOff: boolean): FinishReason {
    return cutOff && !this.stopped ? 'length' : 'stop';
  }

  private emit(text: string): TextDelta[] {
    if (text === '') return [];
    this.text += text;
    return [{ text }];
  }
}

/** The prompt's token ids: a string encoded (special-token text parsed, as Kimi's encode), or ids as given. One prompt per request. */
function promptIds(ctx: ServerContext, prompt: CompletionBody['prompt']): number[] {
  let one: string | number[] = prompt as string | number[];
  if (Array.isArray(prompt) && (typeof prompt[0] === 'string' || Array.isArray(prompt[0]))) {
    if (prompt.length > 1) throw unsupported('prompt', `${prompt.length} prompts in one request are not supported: send one prompt per request (the engine decodes one sequence at a time).`);
    one = prompt[0] as string | number[];
  }
  const ids = typeof one === 'string' ? ctx.tokenizer.encode(one) : one;
  const V = ctx.engine.config.vocabSize;
  const bad = ids.findIndex((t) => t >= V);
  if (bad >= 0) throw invalidRequest(`Invalid value for 'prompt': token id ${ids[bad]} at index ${bad} is outside the vocabulary [0, ${V}).`, 'prompt');
  if (ids.length === 0) throw invalidRequest("Invalid value for 'prompt': the prompt is empty (it encodes to no tokens).", 'prompt');
  return ids;
}

/** The tokens a plain completion stops at: the model config's eos_token_id and the tokenizer's eos (as `kdtree run --text`). */
export function completionStopTokens(config: { eosTokenIds: readonly number[] }, tokenizer: { eosId?: number }): number[] {
  return [...new Set([...config.eosTokenIds, ...(tokenizer.eosId === undefined ? [] : [tokenizer.eosId])])];
}

export function completionRequest(ctx: ServerContext, body: CompletionBody): GenerationRequest<TextDelta> {
  checkGreedy(body);
  if (body.echo) throw unsupported('echo', 'echo is not supported yet.');
  if (body.suffix) throw unsupported('suffix', 'suffix (fill-in-the-middle) is not supported: Kimi K2 has no infilling format.');
  if (body.best_of !== undefined && body.best_of !== null && body.best_of !== 1) throw unsupported('best_of', `best_of ${body.best_of} is not supported: greedy decoding gives one answer per prompt.`);
  if (body.logprobs !== undefined && body.logprobs !== null) throw unsupported('logprobs', 'logprobs are not supported yet.');
  const prompt = promptIds(ctx, body.prompt);
  const maxNew = checkContext(ctx, prompt.length, body.max_tokens, 'max_tokens', 'prompt');
  const eos = completionStopTokens(ctx.engine.config, ctx.tokenizer);
  const answer = new TextAnswer(ctx.tokenizer.streamDecoder({ skipSpecial: body.skip_special_tokens ?? true }), new StopMatcher(stopList(body.stop)), new Set(eos));
  const base = (id: string) => ({ id, object: 'text_completion', created: Math.floor(Date.now() / 1000), model: ctx.modelName, system_fingerprint: null });
  // vLLM's layout: both lists of ids in the choice
  const choice = (text: string, finishReason: FinishReason | null, ids: Record<string, number[] | undefined>) => ({ index: 0, text, logprobs: null, finish_reason: finishReason, ...Object.fromEntries(Object.entries(ids).filter(([, v]) => v !== undefined)) });
  return {
    endpoint: 'completions',
    idPrefix: 'cmpl',
    prompt,
    maxNew,
    eos,
    ...responseOptions(body),
    answer,
    emptyDelta: { text: '' },
    chunk: (id, delta, finishReason, ids) => ({ ...base(id), choices: [choice(delta?.text ?? '', finishReason, { ...ids })] }),
    body: (id, finishReason, usage, ids) => ({ ...base(id), choices: [choice(answer.text, finishReason, { ...ids })], usage }),
  };
}
