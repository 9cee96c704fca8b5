/**
 * The JSON schemas fastify validates request bodies against (with Ajv: no type coercion, so
 * `"max_tokens": "5"` is an error as in the OpenAI API). They check shapes and ranges; what
 * depends on the model or on what the server implements (the context, `temperature`, `n`) is
 * checked by the handlers with messages of their own. Fields the server does not know are
 * ignored, as vLLM and SGLang do, so clients that send newer fields keep working.
 *
 * A `description` on a schema is what the error message says was expected.
 */

/**
 * `schema` or null. A schema of one type becomes a union type rather than an `anyOf`, so that an
 * error inside it (tools[0].function.name) is reported where it is, not as the anyOf failing.
 */
function nullable(schema: Record<string, unknown>, description?: string): Record<string, unknown> {
  const described = description ? { description } : {};
  if (typeof schema.type === 'string') return { ...schema, type: [schema.type, 'null'], ...described };
  return { anyOf: [schema, { type: 'null' }], ...described };
}

const stop = nullable({ anyOf: [{ type: 'string', minLength: 1 }, { type: 'array', items: { type: 'string', minLength: 1 }, maxItems: 4 }] }, 'a non-empty string, an array of up to 4 non-empty strings, or null');
const streamOptions = nullable({ type: 'object', properties: { include_usage: { type: 'boolean' } } }, 'an object {include_usage: boolean} or null');
const positiveInt = (description: string) => nullable({ type: 'integer', minimum: 1 }, description);

/** The parameters both endpoints share: output length, stopping, sampling (checked: greedy only), streaming. */
const common = {
  model: { type: 'string', description: 'the model id (GET /v1/models)' },
  stream: nullable({ type: 'boolean' }, 'true or false'),
  stream_options: streamOptions,
  max_tokens: positiveInt('an integer >= 1 or null'),
  stop,
  temperature: nullable({ type: 'number', minimum: 0, maximum: 2 }, 'a number in [0, 2]'),
  top_p: nullable({ type: 'number', minimum: 0, maximum: 1 }, 'a number in [0, 1]'),
  n: positiveInt('an integer >= 1'),
  presence_penalty: nullable({ type: 'number', minimum: -2, maximum: 2 }, 'a number in [-2, 2]'),
  frequency_penalty: nullable({ type: 'number', minimum: -2, maximum: 2 }, 'a number in [-2, 2]'),
  logit_bias: nullable({ type: 'object' }, 'an object of token id -> bias, or null'),
  seed: nullable({ type: 'integer' }, 'an integer'),
  user: { type: 'string' },
  /** vLLM's extension: the prompt's and the answer's token ids in the response. */
  return_token_ids: nullable({ type: 'boolean' }, 'true or false'),
};

const contentPart = { type: 'object', required: ['type'], properties: { type: { type: 'string' }, text: { type: 'string' } } };
const toolCall = {
  type: 'object',
  required: ['function'],
  properties: {
    id: { type: 'string' },
    type: { const: 'function' },
    function: { type: 'object', required: ['name', 'arguments'], properties: { name: { type: 'string', minLength: 1 }, arguments: { anyOf: [{ type: 'string' }, { type: 'object' }], description: 'a JSON text' } } },
  },
};

export const CHAT_ROLES = ['system', 'developer', 'user', 'assistant', 'tool'] as const;

const message = {
  type: 'object',
  required: ['role'],
  properties: {
    role: { type: 'string', enum: CHAT_ROLES },
    content: nullable({ anyOf: [{ type: 'string' }, { type: 'array', items: contentPart }] }, 'a string, an array of content parts ({type: "text", text}), or null'),
    name: { type: 'string' },
    tool_calls: nullable({ type: 'array', items: toolCall }, 'an array of {id, type: "function", function: {name, arguments}}'),
    tool_call_id: { type: 'string' },
    reasoning_content: nullable({ type: 'string' }, 'a string or null'),
  },
};

const tool = {
  type: 'object',
  required: ['type', 'function'],
  properties: {
    type: { const: 'function' },
    function: {
      type: 'object',
      required: ['name'],
      properties: {
        name: { type: 'string', pattern: '^[A-Za-z0-9_.-]{1,64}$', description: 'a function name: letters, digits, _ . -, at most 64' },
        description: { type: 'string' },
        parameters: { type: 'object' },
        strict: nullable({ type: 'boolean' }),
      },
    },
  },
};

export const chatCompletionSchema = {
  type: 'object',
  required: ['model', 'messages'],
  properties: {
    ...common,
    messages: { type: 'array', minItems: 1, items: message, description: 'a non-empty array of messages' },
    max_completion_tokens: positiveInt('an integer >= 1 or null'),
    tools: nullable({ type: 'array', items: tool }, 'an array of {type: "function", function: {name, description, parameters}}'),
    tool_choice: nullable(
      { anyOf: [{ type: 'string', enum: ['none', 'auto', 'required'] }, { type: 'object', required: ['type', 'function'], properties: { type: { const: 'function' }, function: { type: 'object', required: ['name'], properties: { name: { type: 'string' } } } } }] },
      "'none', 'auto', 'required' or {type: 'function', function: {name}}",
    ),
    parallel_tool_calls: nullable({ type: 'boolean' }),
    logprobs: nullable({ type: 'boolean' }, 'true or false'),
    top_logprobs: nullable({ type: 'integer', minimum: 0, maximum: 20 }, 'an integer in [0, 20]'),
    response_format: nullable({ type: 'object', required: ['type'], properties: { type: { type: 'string' } } }, "{type: 'text'}"),
  },
};

export const completionSchema = {
  type: 'object',
  required: ['model', 'prompt'],
  properties: {
    ...common,
    prompt: {
      anyOf: [
        { type: 'string' },
        { type: 'array', items: { type: 'string' }, minItems: 1 },
        { type: 'array', items: { type: 'integer', minimum: 0 }, minItems: 1 },
        { type: 'array', items: { type: 'array', items: { type: 'integer', minimum: 0 }, minItems: 1 }, minItems: 1 },
      ],
      description: 'a string, an array of token ids, or an array of one of those',
    },
    echo: nullable({ type: 'boolean' }, 'true or false'),
    suffix: nullable({ type: 'string' }, 'a string or null'),
    best_of: positiveInt('an integer >= 1'),
    logprobs: nullable({ type: 'integer', minimum: 0, maximum: 5 }, 'an integer in [0, 5] or null'),
    /** vLLM's extension: leave special tokens out of the text (default true). */
    skip_special_tokens: nullable({ type: 'boolean' }, 'true or false'),
  },
};
