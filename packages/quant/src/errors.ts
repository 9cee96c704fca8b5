/**
 * Typed errors of @kdtree/quant. Each names the tensor and the numbers involved, so the CLI can
 * print one line such as "model.layers.3.mlp.experts.7.down_proj.weight: K = 2050 is not a
 * multiple of the group size 32".
 */
export interface QuantErrorDetails {
  tensor?: string;
  file?: string;
  cause?: unknown;
}

export class QuantError extends Error {
  readonly code: string = 'KDTREE_QUANT';
  readonly tensor?: string;
  readonly file?: string;

  constructor(message: string, details: QuantErrorDetails = {}) {
    const where = [details.file, details.tensor === undefined ? undefined : `tensor '${details.tensor}'`].filter(Boolean).join(': ');
    super(where ? `${where}: ${message}` : message, details.cause === undefined ? undefined : { cause: details.cause });
    this.name = new.target.name;
    this.tensor = details.tensor;
    this.file = details.file;
  }
}

/** K is not a multiple of 8 (packing) or of the group size, or the group size is not supported. */
export class GroupShapeError extends QuantError {
  override readonly code = 'KDTREE_QUANT_GROUP_SHAPE';
}
/** A weight is NaN or +-Inf: its group has no finite scale. */
export class NonFiniteWeightError extends QuantError {
  override readonly code = 'KDTREE_QUANT_NON_FINITE';
}
/** A selection rule (target or ignore) that matched no tensor: almost always a typo. */
export class RuleMatchError extends QuantError {
  override readonly code = 'KDTREE_QUANT_RULE_MATCH';
}
/** A rules file or quantization_config that cannot be used. */
export class QuantConfigError extends QuantError {
  override readonly code = 'KDTREE_QUANT_CONFIG';
}
/** A packed weight without its scales (or the reverse), or without a descriptor. */
export class MissingPartError extends QuantError {
  override readonly code = 'KDTREE_QUANT_MISSING_PART';
}
/** Packed codes, scales and the declared shape disagree. */
export class QuantShapeMismatchError extends QuantError {
  override readonly code = 'KDTREE_QUANT_SHAPE_MISMATCH';
}
