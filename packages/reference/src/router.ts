/**
 * The DeepSeek-V3 / Kimi K2 router ("noaux_tc"): sigmoid scores; experts are *chosen* on
 * score + e_score_correction_bias (limited to the best `topk_group` groups when n_group > 1, a
 * group scoring the sum of its top-2 biased scores), but *weighted* by their unbiased scores,
 * normalized to sum 1 when norm_topk_prob, times routed_scaling_factor.
 */
import type { ModelConfig } from './config.js';
import { sigmoid } from './tensor-ops.js';

export interface Routing {
  /** Chosen experts, ascending (the order their outputs are summed in). */
  experts: number[];
  weights: number[];
}

/** Indices of the k largest values; ties go to the lower index. Only `allowed` entries compete. */
function topK(values: Float64Array, k: number, allowed?: Uint8Array): number[] {
  const idx = Array.from({ length: values.length }, (_, i) => i).filter((i) => !allowed || allowed[i]);
  idx.sort((a, b) => values[b] - values[a] || a - b);
  return idx.slice(0, k);
}

/** Routes one token from its router logits [n_routed_experts]. */
export function route(config: ModelConfig, logits: Float32Array | Float64Array, bias: Float32Array): Routing {
  const E = config.nRoutedExperts;
  const scores = new Float64Array(E);
  const choice = new Float64Array(E);
  for (let e = 0; e < E; e++) {
    scores[e] = sigmoid(logits[e]);
    choice[e] = scores[e] + bias[e];
  }
  let allowed: Uint8Array | undefined;
  if (config.nGroup > 1) {
    const per = E / config.nGroup;
    const groupScore = new Float64Array(config.nGroup);
    for (let g = 0; g < config.nGroup; g++) {
      const [a, b] = topK(choice.subarray(g * per, (g + 1) * per), 2);
      groupScore[g] = choice[g * per + a] + choice[g * per + b];
    }
    allowed = new Uint8Array(E);
    for (const g of topK(groupScore, config.topkGroup)) allowed.fill(1, g * per, (g + 1) * per);
  }
  const experts = topK(choice, config.numExpertsPerTok, allowed).sort((a, b) => a - b);
  let weights = experts.map((e) => scores[e]);
  if (config.normTopkProb) {
    const sum = weights.reduce((s, w) => s + w, 0) + 1e-20;
    weights = weights.map((w) => w / sum);
  }
  return { experts, weights: weights.map((w) => w * config.routedScalingFactor) };
}
