/**
 * Synthetic model pairs for the engine's tests, written once per test file: a target (INT4 routed
 * experts, as Kimi K2 ships them) and a draft it is correlated with (target = draft + noise), each
 * a KDTR bundle with golden greedy tokens from @kdtree/reference.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll } from 'vitest';
import { openBundle } from '@kdtree/format';
import type { BackendKind } from '@kdtree/cuda';
import { parseModelConfig, perturbWeights, presetConfigJson, randomWeights, writeSyntheticModel, type GoldenRecord, type ModelPreset } from '@kdtree/reference';
import type { PresetName } from '@kdtree/quant';

export const TEST_BACKEND = (process.env.KDTREE_TEST_BACKEND as BackendKind | undefined) ?? 'cpu';

export function tempDir(prefix = 'kdtree-engine-'): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  return dir;
}

export interface ModelPair {
  target: string;
  draft: string;
  golden: GoldenRecord;
}

export async function syntheticPair(dir: string, preset: ModelPreset, seed: number, quant: PresetName | undefined = 'kimi-k2', noise = 0.05): Promise<ModelPair> {
  const config = parseModelConfig(presetConfigJson(preset), preset);
  const base = randomWeights(config, seed);
  const draft = join(dir, `${preset}-${seed}-draft.kdtr`);
  const target = join(dir, `${preset}-${seed}.kdtr`);
  await writeSyntheticModel(draft, { preset, seed, weights: base, quant }, 'engine tests');
  const golden = await writeSyntheticModel(target, { preset, seed, weights: perturbWeights(base, noise, seed + 1), quant }, 'engine tests');
  return { target, draft, golden };
}

export async function goldenOf(path: string): Promise<GoldenRecord> {
  const b = await openBundle(path);
  try {
    return b.metadata.golden as GoldenRecord;
  } finally {
    await b.close();
  }
}
