/**
 * POST /v1/chat/completions: the conversation rendered by the model's own chat template (tools
 * declared in Kimi's format), the answer parsed as it streams into content, `reasoning_content`
 * (Kimi's `<think>` block) and tool calls (Kimi's `<|tool_call_begin|>functions.NAME:IDX ...`
 * sections), and sent back in the OpenAI API's shapes.
 */
import type { ChatMessage, ChatOutputEvent, ChatOutputParser, ChatTool, Tokenizer } from '@kdtree/tokenizer';
import { TokenizerError } from '@kdtree/tokenizer';
import { invalidRequest, unsupported } from './errors.js';
import { checkContext, responseOptions, type Answer, type FinishReason, type GenerationRequest, type ServerContext } from './generation.js';
import { StopMatcher } from './stop-matcher.js';
import { checkGreedy, stopList, type SamplingParams } from './validation.js';

export interface ChatCompletionBody extends SamplingParams {
  model: string;
  messages: ChatMessage[];
  stream?: boolean | null;
  stream_options?: { include_usage?: boolean } | null;
  max_tokens?: number | null;
  max_completion_tokens?: number | null;
  stop?: string | string[] | null;
  tools?: ChatTool[] | null;
  tool_choice?: 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } } | null;
  logprobs?: boolean | null;
  top_logprobs?: number | null;
  response_format?: { type: string } | null;
  return_token_ids?: boolean | null;
}

export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: 'function';
  function: { name?: string; arguments: string };
}

export interface ChatDelta {
  role?: 'assistant';
  content?: string;
  reasoning_content?: string;
  tool_calls?: ToolCallDelta[];
}

interface ToolCall {
  id: string;
  name: string;
  arguments: string;
}

/** Kimi's markers, as the tokenizer spells them. */
const SECTION_BEGIN = '<|tool_calls_section_begin|>';
const CALL_BEGIN = '<|tool_call_begin|>';
const ARGUMENT_BEGIN = '<|tool_call_argument_begin|>';

/**
 * The answer of a chat turn, from the output parser's events: content through the stop
 * sequences, reasoning, tool calls; merged so that one step's tokens make as few deltas as they can.
 */
class ChatAnswer implements Answer<ChatDelta> {
  done = false;
  private stopped = false;
  content = '';
  reasoning: string | null = null;
  readonly toolCalls: ToolCall[] = [];

  constructor(
    private readonly parser: ChatOutputParser,
    private readonly stops: StopMatcher,
    /** Tokens the prompt ends with that are part of the answer (a tool call tool_choice forces). */
    private readonly prefix: readonly number[],
  ) {}

  start(): ChatDelta[] {
    return [{ role: 'assistant', content: '' }, ...this.convert(this.parser.push(this.prefix))];
  }

  push(tokens: readonly number[]): ChatDelta[] {
    return this.convert(this.parser.push(tokens));
  }

  finish(): ChatDelta[] {
    const deltas = this.convert(this.parser.finish());
    if (!this.stopped) this.addContent(deltas, this.stops.flush());
    return deltas;
  }

  finishReason(cutOff: boolean): FinishReason {
    if (this.stopped) return 'stop';
    if (cutOff) return 'length';
    return this.toolCalls.length > 0 ? 'tool_calls' : 'stop';
  }

  message(): Record<string, unknown> {
    const message: Record<string, unknown> = { role: 'assistant', content: this.content === '' && this.toolCalls.length > 0 ? null : this.content };
    if (this.reasoning !== null) message.reasoning_content = this.reasoning;
    if (this.toolCalls.length > 0) message.tool_calls = this.toolCalls.map((c) => ({ id: c.id, type: 'function', function: { name: c.name, arguments: c.arguments } }));
    return message;
  }

  private addContent(deltas: ChatDelta[], text: string): void {
    if (text === '') return;
    this.content += text;
    const last = deltas[deltas.length - 1];
    if (last !== undefined && last.content !== undefined && last.tool_calls === undefined && last.reasoning_content === undefined && last.role === undefined) last.content += text;
    else deltas.push({ content: text });
  }

  private convert(events: readonly ChatOutputEvent[]): ChatDelta[] {
    const deltas: ChatDelta[] = [];
    // content held back for a stop sequence goes out before anything that follows it
    const flushContent = () => {
      if (!this.stopped) this.addContent(deltas, this.stops.flush());
    };
    for (const event of events) {
      if (this.done) break;
      const last = deltas[deltas.length - 1];
      switch (event.type) {
        case 'content': {
          const r = this.stops.push(event.text);
          this.addContent(deltas, r.text);
          if (r.stopped) this.stopped = this.done = true;
          break;
        }
        case 'reasoning':
          flushContent();
          this.reasoning = (this.reasoning ?? '') + event.text;
          if (last?.reasoning_content !== undefined) last.reasoning_content += event.text;
          else deltas.push({ reasoning_content: event.text });
          break;
        case 'tool_call': {
          flushContent();
          const id = event.id !== '' ? event.id : `call_${event.index}`;
          this.toolCalls[event.index] = { id, name: event.name, arguments: '' };
          deltas.push({ tool_calls: [{ index: event.index, id, type: 'function', function: { name: event.name, arguments: '' } }] });
          break;
        }
        case 'tool_call_arguments': {
          this.toolCalls[event.index].arguments += event.text;
          const call = last?.tool_calls?.[0];
          // the header delta stays as OpenAI sends it (arguments ''); the arguments follow it
          if (call !== undefined && call.index === event.index && call.id === undefined) call.function.arguments += event.text;
          else deltas.push({ tool_calls: [{ index: event.index, function: { arguments: event.text } }] });
          break;
        }
        case 'tool_call_end':
          break;
        case 'end':
          flushContent();
          this.done = true;
          break;
      }
    }
    return deltas;
  }
}

/** The message list as the template reads it: `developer` is a system turn; only text content parts. */
function templateMessages(messages: readonly ChatMessage[]): ChatMessage[] {
  return messages.map((m, i) => {
    if (Array.isArray(m.content)) {
      m.content.forEach((part, j) => {
        if (part.type !== 'text') throw unsupported(`messages[${i}].content[${j}].type`, `content parts of type '${part.type}' are not supported: this model reads text only (type 'text').`);
      });
    }
    return m.role === 'developer' ? { ...m, role: 'system' } : m;
  });
}

/**
 * The tokens tool_choice puts at the start of the answer: Kimi's tool-call section and call
 * header, so that the model writes the call ('required': the function's name and arguments; a
 * named function: its arguments). The call's index continues the conversation's count, as the
 * template numbers calls.
 */
function forcedToolCall(tokenizer: Tokenizer, body: ChatCompletionBody, tools: readonly ChatTool[] | undefined): number[] {
  const choice = body.tool_choice ?? 'auto';
  if (choice === 'auto' || choice === 'none') return [];
  if (tools === undefined || tools.length === 0) throw invalidRequest(`tool_choice ${JSON.stringify(choice)} needs tools: the request declares none.`, 'tool_choice');
  const index = body.messages.reduce((n, m) => n + (Array.isArray(m.tool_calls) ? m.tool_calls.length : 0), 0);
  if (choice === 'required') return tokenizer.encode(`${SECTION_BEGIN}${CALL_BEGIN}functions.`);
  const name = choice.function.name;
  if (!tools.some((t) => t.function.name === name)) throw invalidRequest(`tool_choice names the function '${name}', which is not among the tools (${tools.map((t) => t.function.name).join(', ')}).`, 'tool_choice.function.name');
  return tokenizer.encode(`${SECTION_BEGIN}${CALL_BEGIN}functions.${name}:${index}${ARGUMENT_BEGIN}`);
}

/** Checks a chat request and turns it into a generation: the prompt, the stop rules, the answer's shape. */
export function chatRequest(ctx: ServerContext, body: ChatCompletionBody): GenerationRequest<ChatDelta> {
  checkGreedy(body);
  if (body.logprobs) throw unsupported('logprobs', 'logprobs are not supported yet.');
  if (body.top_logprobs) throw unsupported('top_logprobs', 'top_logprobs are not supported yet.');
  if (body.response_format && body.response_format.type !== 'text') {
    throw unsupported('response_format', `response_format '${body.response_format.type}' is not supported: it needs constrained decoding, which is not implemented yet (send {type: 'text'} or leave it out).`);
  }
  const { tokenizer } = ctx;
  const tools = body.tool_choice === 'none' || !body.tools || body.tools.length === 0 ? undefined : body.tools;
  let prompt: number[];
  try {
    prompt = tokenizer.encodeChat(templateMessages(body.messages), { tools, addGenerationPrompt: true });
  } catch (error) {
    if (error instanceof TokenizerError) throw invalidRequest(error.message, error.field ?? 'messages');
    throw error;
  }
  const prefix = forcedToolCall(tokenizer, body, tools);
  prompt.push(...prefix);
  const maxNew = checkContext(ctx, prompt.length, body.max_completion_tokens ?? body.max_tokens, body.max_completion_tokens != null ? 'max_completion_tokens' : 'max_tokens', 'messages');
  const eos = [...new Set([...tokenizer.endOfTurnIds, ...ctx.engine.config.eosTokenIds])];
  // a template whose generation prompt opens the thinking block leaves the model inside it
  const thinkBegin = tokenizer.specialId('<think>');
  const startInReasoning = prefix.length === 0 && thinkBegin !== undefined && prompt[prompt.length - 1] === thinkBegin;
  const answer = new ChatAnswer(tokenizer.outputParser({ endOfTurnIds: eos, startInReasoning }), new StopMatcher(stopList(body.stop)), prefix);
  const base = (id: string) => ({ id, created: Math.floor(Date.now() / 1000), model: ctx.modelName, system_fingerprint: null });
  return {
    endpoint: 'chat',
    idPrefix: 'chatcmpl',
    prompt,
    maxNew,
    eos,
    ...responseOptions(body),
    answer,
    emptyDelta: {},
    // vLLM's layout: the prompt's ids beside the choices, the answer's in the choice
    chunk: (id, delta, finishReason, { prompt_token_ids, token_ids }) => ({
      ...base(id),
      object: 'chat.completion.chunk',
      ...(prompt_token_ids ? { prompt_token_ids } : {}),
      choices: [{ index: 0, delta: delta ?? {}, logprobs: null, finish_reason: finishReason, ...(token_ids ? { token_ids } : {}) }],
    }),
    body: (id, finishReason, usage, { prompt_token_ids, token_ids }) => ({
      ...base(id),
      object: 'chat.completion',
      ...(prompt_token_ids ? { prompt_token_ids } : {}),
      choices: [{ index: 0, message: answer.message(), logprobs: null, finish_reason: finishReason, ...(token_ids ? { token_ids } : {}) }],
      usage,
    }),
  };
}
