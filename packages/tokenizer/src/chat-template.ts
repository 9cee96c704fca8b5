import { Template } from '@huggingface/jinja';
import { TokenizerError } from './errors.js';

/** A part of a message's content in the OpenAI list form; Kimi's templates render `text` parts. */
export interface ChatContentPart {
  type: string;
  text?: string;
  [key: string]: unknown;
}

export interface ChatToolCall {
  /** Kimi's ids are `functions.NAME:INDEX`; the template writes the id as given. */
  id?: string;
  type?: 'function';
  function: {
    name: string;
    /** A JSON text (as the OpenAI API sends it), or an object the template serializes with tojson. */
    arguments: string | Record<string, unknown>;
  };
}

/** One turn, in the OpenAI chat shape with HuggingFace's field names (what chat templates read). */
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool' | (string & {});
  content?: string | ChatContentPart[] | null;
  /** Replaces the role's name in the turn header (`<|im_user|>NAME<|im_middle|>`). */
  name?: string;
  /** An assistant turn's thinking; Kimi's template keeps it only after the last plain answer. */
  reasoning_content?: string | null;
  tool_calls?: ChatToolCall[];
  /** A tool turn: the id of the call it answers (`## Return of ID`). */
  tool_call_id?: string;
  [key: string]: unknown;
}

/** An OpenAI tool declaration. */
export interface ChatTool {
  type: 'function';
  function: { name: string; description?: string; parameters?: Record<string, unknown>; [key: string]: unknown };
  [key: string]: unknown;
}

export interface RenderChatOptions {
  tools?: readonly ChatTool[];
  /** End with the header of an assistant turn, so the model writes the answer. Default false, as HuggingFace. */
  addGenerationPrompt?: boolean;
  /**
   * Sort the keys of the tool declarations, recursively, before rendering (default true): Kimi's
   * `apply_chat_template` does (`deep_sort_dict`), so the model saw its tools that way.
   */
  sortToolKeys?: boolean;
  /** More variables for the template (`thinking`, `tools_ts_str`, ...), as HuggingFace's **kwargs. */
  templateArgs?: Record<string, unknown>;
}

/**
 * A model's Jinja chat template, rendered by @huggingface/jinja (the renderer made to match
 * HuggingFace's Python rendering: trim_blocks and lstrip_blocks, loop controls, namespace, tojson
 * with ensure_ascii false). Known differences from Python Jinja are in docs/tokenizer.md.
 */
export class ChatTemplate {
  private readonly template: Template;

  constructor(
    readonly source: string,
    /** Where the template came from, for messages. */
    readonly origin = 'chat template',
    /** Always-available variables (HuggingFace passes the special-token names: bos_token, ...). */
    private readonly globals: Record<string, unknown> = {},
  ) {
    try {
      this.template = new Template(source);
    } catch (error) {
      throw new TokenizerError('KDTREE_CHAT_TEMPLATE', `the template does not parse: ${(error as Error).message}`, { source: origin, cause: error });
    }
  }

  render(messages: readonly ChatMessage[], options: RenderChatOptions = {}): string {
    validateMessages(messages);
    const tools = options.tools === undefined ? undefined : validateTools(options.tools);
    const context: Record<string, unknown> = {
      ...this.globals,
      ...options.templateArgs,
      messages,
      add_generation_prompt: options.addGenerationPrompt ?? false,
    };
    if (tools !== undefined) context.tools = (options.sortToolKeys ?? true) ? deepSortKeys(tools) : tools;
    try {
      return this.template.render(context);
    } catch (error) {
      throw new TokenizerError('KDTREE_CHAT_TEMPLATE', `rendering failed: ${(error as Error).message}`, { source: this.origin, cause: error });
    }
  }
}

function fail(field: string, message: string, expected?: string, actual?: unknown): never {
  throw new TokenizerError('KDTREE_CHAT_TEMPLATE', message, { field, expected, actual: actual === undefined ? undefined : JSON.stringify(actual) ?? String(actual) });
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** Checks the shapes the template relies on, so a bad request fails here with a path, not inside Jinja. */
export function validateMessages(messages: readonly ChatMessage[]): void {
  if (!Array.isArray(messages)) fail('messages', 'not an array', 'an array of {role, content}', messages);
  messages.forEach((m, i) => {
    const at = `messages[${i}]`;
    if (!isObject(m)) fail(at, 'not an object', '{role, content, ...}', m);
    if (typeof m.role !== 'string' || m.role === '') fail(`${at}.role`, 'not a role', "a non-empty string ('system', 'user', 'assistant', 'tool')", m.role);
    const c = m.content;
    if (c !== undefined && c !== null && typeof c !== 'string') {
      if (!Array.isArray(c)) fail(`${at}.content`, 'not content', 'a string, an array of parts or null', c);
      c.forEach((part, j) => {
        if (!isObject(part) || typeof part.type !== 'string') fail(`${at}.content[${j}]`, 'not a content part', '{type, text}', part);
        if (part.type === 'text' && typeof part.text !== 'string') fail(`${at}.content[${j}].text`, 'not a string', 'the text of a text part', part.text);
      });
    }
    for (const key of ['name', 'tool_call_id'] as const) {
      if (m[key] !== undefined && typeof m[key] !== 'string') fail(`${at}.${key}`, 'not a string', undefined, m[key]);
    }
    if (m.reasoning_content !== undefined && m.reasoning_content !== null && typeof m.reasoning_content !== 'string') fail(`${at}.reasoning_content`, 'not a string', 'a string or null', m.reasoning_content);
    if (m.tool_calls !== undefined && m.tool_calls !== null) {
      if (!Array.isArray(m.tool_calls)) fail(`${at}.tool_calls`, 'not an array', '[{id, type, function: {name, arguments}}]', m.tool_calls);
      m.tool_calls.forEach((call, j) => {
        const cat = `${at}.tool_calls[${j}]`;
        if (!isObject(call) || !isObject(call.function)) fail(cat, 'not a tool call', '{id, type, function: {name, arguments}}', call);
        if (typeof call.function.name !== 'string' || call.function.name === '') fail(`${cat}.function.name`, 'not a function name', 'a non-empty string', call.function.name);
        const args = call.function.arguments;
        if (typeof args !== 'string' && !isObject(args)) fail(`${cat}.function.arguments`, 'not arguments', 'a JSON string or an object', args);
        if (call.id !== undefined && typeof call.id !== 'string') fail(`${cat}.id`, 'not a string', undefined, call.id);
      });
    }
  });
}

function validateTools(tools: readonly ChatTool[]): readonly ChatTool[] {
  if (!Array.isArray(tools)) fail('tools', 'not an array', '[{type: "function", function: {name, ...}}]', tools);
  tools.forEach((t, i) => {
    if (!isObject(t) || !isObject(t.function) || typeof t.function.name !== 'string' || t.function.name === '') fail(`tools[${i}]`, 'not a tool declaration', '{type: "function", function: {name, description, parameters}}', t);
  });
  return tools;
}

/** Python's sorted() on str keys orders by code point; JS's default sort orders by UTF-16 unit. */
function byCodePoint(a: string, b: string): number {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i].codePointAt(0)! - y[i].codePointAt(0)!;
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

/** Kimi's `deep_sort_dict`: every object's keys sorted, recursively; arrays keep their order. */
export function deepSortKeys<T>(value: T): T {
  if (Array.isArray(value)) return value.map((v) => deepSortKeys(v)) as T;
  if (isObject(value)) {
    const out: Record<string, unknown> = {};
    for (const key of Object.keys(value).sort(byCodePoint)) out[key] = deepSortKeys(value[key]);
    return out as T;
  }
  return value;
}
