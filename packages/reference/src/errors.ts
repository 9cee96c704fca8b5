/**
 * Typed errors of @kdtree/reference, each naming the config field or tensor at fault. Base class:
 * `instanceof GoldenReferenceError` catches every failure this package reports (named so that it
 * does not shadow the JavaScript global `ReferenceError`).
 */
export class GoldenReferenceError extends Error {
  readonly code: string = 'KDTREE_REFERENCE';
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** A model config field is missing, of the wrong type, or inconsistent with another. */
export class ConfigError extends GoldenReferenceError {
  override readonly code = 'KDTREE_CONFIG';
  constructor(
    message: string,
    readonly field: string,
    readonly source: string,
  ) {
    super(`${source}: ${field}: ${message}`);
  }
}

/** A weight is missing or has a shape the config does not allow. */
export class WeightError extends GoldenReferenceError {
  override readonly code = 'KDTREE_WEIGHT';
  constructor(
    message: string,
    readonly tensor: string,
    readonly source: string,
  ) {
    super(`${source}: tensor '${tensor}': ${message}`);
  }
}

/** Bad arguments to a reference function (tokens out of range, cache overflow, bad budgets). */
export class ReferenceUsageError extends GoldenReferenceError {
  override readonly code = 'KDTREE_REFERENCE_USAGE';
}

/** A drafter does not fit the target it is paired with; `problems` lists every mismatch. */
export class PairingError extends GoldenReferenceError {
  override readonly code = 'KDTREE_PAIRING';
  constructor(
    readonly problems: readonly string[],
    readonly drafter: string,
    readonly target: string,
  ) {
    super(`${drafter} does not fit ${target}: ${problems.join('; ')}`);
  }
}
