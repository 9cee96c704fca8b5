import { parseModelConfig } from '../config.js';
import type { ReferenceModel } from '../model.js';
import { modelFromWeights, presetConfigJson, randomWeights } from '../synthetic.js';

/** The tiny preset with seeded weights, built in memory once per test file. */
export async function tinyModel(seed = 1, overrides: Record<string, unknown> = {}): Promise<ReferenceModel> {
  const config = parseModelConfig({ ...presetConfigJson('tiny'), ...overrides }, 'tiny');
  return modelFromWeights(config, randomWeights(config, seed));
}
