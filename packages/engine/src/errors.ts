/** Typed errors of @kdtree/engine: each carries a code and the value or field at fault. */

export type EngineErrorCode =
  /** An argument of createEngine or generate is out of range or of the wrong type. */
  | 'KDTREE_ENGINE_ARGUMENT'
  /** The model's config or weights are something the engine cannot run (names the field or tensor). */
  | 'KDTREE_ENGINE_MODEL'
  /** The model, its cache and work space do not fit in the device's free memory. */
  | 'KDTREE_ENGINE_MEMORY'
  /** A request does not fit in the KV cache. */
  | 'KDTREE_ENGINE_CAPACITY'
  /** The drafter does not fit the target (vocabulary, hidden size, layers). */
  | 'KDTREE_ENGINE_DRAFTER'
  /** The generation was aborted through its AbortSignal. */
  | 'KDTREE_ENGINE_ABORTED'
  /** The engine was disposed. */
  | 'KDTREE_ENGINE_DISPOSED'
  /** A weight cannot be split over the tensor-parallel ranks (names the tensor and its shape). */
  | 'KDTREE_ENGINE_SHARD'
  /** A tensor-parallel rank failed to load, died, stalled or threw (names the rank and what happened). */
  | 'KDTREE_ENGINE_RANK';

export class EngineError extends Error {
  constructor(
    readonly code: EngineErrorCode,
    message: string,
    /** The offending field, tensor or option, where there is one. */
    readonly field?: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
    this.name = 'EngineError';
  }
}

/** Throws KDTREE_ENGINE_ABORTED for `what` (the generation, loading the model) once `signal` has aborted; its reason is the cause. */
export function throwIfAborted(signal: AbortSignal | undefined, what: string): void {
  if (signal?.aborted) throw new EngineError('KDTREE_ENGINE_ABORTED', `${what} was aborted`, 'signal', { cause: signal.reason });
}

export function argumentError(field: string, message: string): EngineError {
  return new EngineError('KDTREE_ENGINE_ARGUMENT', `${field}: ${message}`, field);
}

export function modelError(field: string, message: string, source: string): EngineError {
  return new EngineError('KDTREE_ENGINE_MODEL', `${source}: ${field}: ${message}`, field);
}

/** Throws an argument error unless `value` is an integer in [min, max]; `bound` says where max comes from. */
export function checkInt(field: string, value: unknown, min: number, max: number, bound?: string): number {
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < min || value > max) {
    throw argumentError(field, `expected an integer in [${min}, ${max}]${bound ? ` (${bound})` : ''}, got ${typeof value === 'number' ? value : JSON.stringify(value)}`);
  }
  return value;
}
