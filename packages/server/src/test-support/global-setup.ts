/**
 * Writes the model the server's tests serve, once per run: a synthetic k2-mini (Kimi K2's ratios,
 * shrunk; INT4 routed experts; a vocabulary of 8192) carrying its tokenizer, as `kdtree gen-model
 * --preset k2-mini --quant kimi-k2` writes it.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeSyntheticModel } from '@kdtree/reference';
import { syntheticTokenizerFiles, TOKENIZER_METADATA_KEY, tokenizerMetadata } from '@kdtree/tokenizer';
import type { TestProject } from 'vitest/node';

declare module 'vitest' {
  export interface ProvidedContext {
    modelPath: string;
  }
}

export default async function setup(project: TestProject): Promise<() => void> {
  const dir = mkdtempSync(join(tmpdir(), 'kdtree-server-'));
  const modelPath = join(dir, 'k2-mini.kdtr');
  const tokenizer = tokenizerMetadata(syntheticTokenizerFiles({ vocabSize: 8192 }));
  await writeSyntheticModel(modelPath, { preset: 'k2-mini', seed: 1, quant: 'kimi-k2', extraMetadata: { [TOKENIZER_METADATA_KEY]: tokenizer } }, 'server tests');
  project.provide('modelPath', modelPath);
  return () => rmSync(dir, { recursive: true, force: true });
}
