import type { FastifySchemaValidationError } from 'fastify';
import { ApiError, invalidRequest, unsupported } from './errors.js';

/** `/messages/0/role` -> `messages[0].role` (the OpenAI API's way of naming a field). */
export function paramPath(instancePath: string): string {
  return instancePath
    .split('/')
    .slice(1)
    .map((part) => part.replace(/~1/g, '/').replace(/~0/g, '~'))
    .reduce((path, part) => (/^\d+$/.test(part) ? `${path}[${part}]` : path === '' ? part : `${path}.${part}`), '');
}

/**
 * The 400 for a body that fails its schema. Ajv reports an `anyOf` after the errors of each of
 * its branches, so the last error is the most general one, and the schema it failed (Ajv's
 * `verbose`) says in its `description` what was expected.
 */
export function schemaError(errors: readonly FastifySchemaValidationError[]): ApiError {
  const e = errors[errors.length - 1] as FastifySchemaValidationError & { parentSchema?: { description?: string } };
  if (e === undefined) return invalidRequest('the request body is not valid', null);
  const at = paramPath(e.instancePath);
  if (e.keyword === 'required') {
    const missing = (e.params as { missingProperty?: string }).missingProperty ?? '?';
    const param = at === '' ? missing : `${at}.${missing}`;
    return invalidRequest(`Missing required parameter: '${param}'.`, param, 'missing_required_parameter');
  }
  if (at === '') return invalidRequest('The request body must be a JSON object.', null, 'invalid_type');
  const expected = e.parentSchema?.description;
  return invalidRequest(`Invalid value for '${at}': ${expected ? `expected ${expected}` : e.message}.`, at);
}

/** Parameters of both endpoints that greedy decoding cannot honour, refused with what to send instead. */
export interface SamplingParams {
  temperature?: number | null;
  n?: number | null;
  presence_penalty?: number | null;
  frequency_penalty?: number | null;
  logit_bias?: Record<string, unknown> | null;
}

/**
 * The engine decodes greedily (the argmax at every step; speculative decoding emits exactly those
 * tokens), so a request for sampling is refused rather than silently answered greedily.
 * `temperature` left out means 0 here, not the OpenAI API's 1. `top_p` and `seed` change nothing
 * under greedy decoding and are accepted.
 */
export function checkGreedy(body: SamplingParams): void {
  if (body.temperature !== undefined && body.temperature !== null && body.temperature !== 0) {
    throw unsupported('temperature', `temperature ${body.temperature} is not supported: this server decodes greedily (temperature 0) and sampling is not implemented yet. Send temperature 0 or leave it out.`);
  }
  if (body.n !== undefined && body.n !== null && body.n !== 1) {
    throw unsupported('n', `n ${body.n} is not supported: greedy decoding gives one answer per prompt (n 1).`);
  }
  for (const key of ['presence_penalty', 'frequency_penalty'] as const) {
    const v = body[key];
    if (v !== undefined && v !== null && v !== 0) throw unsupported(key, `${key} ${v} is not supported: penalties are not implemented yet (send 0 or leave it out).`);
  }
  if (body.logit_bias && Object.keys(body.logit_bias).length > 0) throw unsupported('logit_bias', 'logit_bias is not supported: it is not implemented yet (send {} or leave it out).');
}

/** `stop` as a list: a string, an array of strings, or nothing. */
export function stopList(stop: string | readonly string[] | null | undefined): string[] {
  if (stop === undefined || stop === null) return [];
  return typeof stop === 'string' ? [stop] : [...stop];
}
