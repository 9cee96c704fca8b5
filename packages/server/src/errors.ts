/**
 * Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}` with a 4xx or
 * 5xx status, the body every OpenAI client parses into its own error class (the `openai` package's
 * BadRequestError, AuthenticationError, NotFoundError, RateLimitError, InternalServerError).
 */

export type ApiErrorType = 'invalid_request_error' | 'authentication_error' | 'not_found_error' | 'rate_limit_error' | 'server_error';

export interface ApiErrorBody {
  error: { message: string; type: ApiErrorType; param: string | null; code: string | null };
}

/** A request the server answers with an error: the status, and the OpenAI error body's fields. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly type: ApiErrorType,
    message: string,
    /** The request field at fault (`messages[2].role`, `temperature`), or null. */
    readonly param: string | null = null,
    /** A machine-readable reason (`context_length_exceeded`, `invalid_api_key`, ...), or null. */
    readonly code: string | null = null,
    options?: ErrorOptions,
  ) {
    super(message, options);
    this.name = 'ApiError';
  }

  toBody(): ApiErrorBody {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

/** 400: a field's value is wrong (`code` says how: invalid_value, unsupported_value, ...). */
export function invalidRequest(message: string, param: string | null = null, code: string | null = 'invalid_value'): ApiError {
  return new ApiError(400, 'invalid_request_error', message, param, code);
}

/** 400: a parameter this server understands but does not implement (yet). */
export function unsupported(param: string, message: string): ApiError {
  return new ApiError(400, 'invalid_request_error', message, param, 'unsupported_value');
}

export type ServerErrorCode = 'KDTREE_SERVER_ARGUMENT' | 'KDTREE_SERVER_STATE';

/** A programming error in the server's own API (a bad option to createServer, listen twice, ...). */
export class ServerError extends Error {
  constructor(
    readonly code: ServerErrorCode,
    message: string,
    /** The option at fault. */
    readonly field?: string,
  ) {
    super(field === undefined ? message : `${field}: ${message}`);
    this.name = 'ServerError';
  }
}
