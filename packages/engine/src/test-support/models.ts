/**
 * Synthetic model pairs for the engine's tests, written once per test file: a target (INT4 routed
 * experts, as Kimi K2 ships them) and a draft it is correlated with (target = draft + noise), each
 * a KDTR bundle with golden greedy tokens from @kdtree/reference.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, expect } from 'vitest';
import { openBundle } from '@kdtree/format';
import type { BackendKind } from '@kdtree/cuda';
import { parseModelConfig, perturbWeights, presetConfigJson, randomWeights, writeSyntheticModel, type GoldenRecord, type ModelPreset } from '@kdtree/reference';
import type { PresetName } from '@kdtree/quant';
import type { Drafter } from '../drafters.js';
import type { Engine, GenerateOptions } from '../engine.js';

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

/**
 * A drafter that half knows the answer, for tests of tree verification: at each depth seeded noise
 * in [0, 2), with the token greedy decoding gives there (`expected` after `prompt`) lifted above
 * the mass of V equal tokens while the context follows them, so trees run several levels deep and
 * accept several nodes. Every third request lifts a decoy above it at depth 1 (the accepted path
 * leaves the tree's first child), and every fourth proposes nothing (draft() returns false: a
 * plain step between tree steps).
 */
export function halfKnowingDrafter(engine: Engine, prompt: readonly number[], expected: readonly number[], seed = 1): Drafter {
  const V = engine.config.vocabSize;
  const lift = Math.log(V) + 1;
  let state = seed >>> 0;
  const noise = () => {
    state = (Math.imul(state, 1664525) + 1013904223) >>> 0;
    return (state / 2 ** 32) * 2;
  };
  let requests = 0;
  return {
    name: 'half-knowing',
    vocabSize: V,
    maxDepth: 16,
    begin() {},
    draft({ tokens, depth, out }) {
      requests++;
      if (requests % 4 === 0) return false;
      const logits = Float32Array.from({ length: depth * V }, noise);
      const emitted = tokens.length - prompt.length;
      const follows = emitted >= 1 && tokens.slice(prompt.length).every((t, i) => t === expected[i]);
      for (let d = 0; follows && d < depth && emitted + d < expected.length; d++) logits[d * V + expected[emitted + d]] += lift;
      if (follows && requests % 3 === 0 && emitted < expected.length) logits[(expected[emitted] + 1) % V] += lift + 1;
      engine.backend.native.upload(out.buffer, logits, out.offset ?? 0);
      return true;
    },
    dispose() {},
  };
}

/**
 * `options`' tokens from the golden prompt on `engine`. A speculative generation drafts with
 * halfKnowingDrafter (trees several levels deep, silent on some steps: tensor-parallel ranks verify
 * trees, commit accepted paths and step plainly) and must have verified a tree that accepted 2 or
 * more nodes, and run a plain step.
 */
export async function goldenTokens(engine: Engine, golden: GoldenRecord, options: GenerateOptions): Promise<number[]> {
  if (options.spec === undefined || options.spec === 'greedy') return (await engine.complete(golden.prompt, options)).tokens;
  const drafter = halfKnowingDrafter(engine, golden.prompt, golden.tokens);
  const r = await engine.complete(golden.prompt, { ...options, drafter, trace: true });
  expect(r.steps.some((s) => s.treeSize > 1 && s.accepted >= 2), 'a tree step accepted 2 or more nodes').toBe(true);
  expect(r.steps.some((s) => s.treeSize === 1), 'a plain step').toBe(true);
  return r.tokens;
}
