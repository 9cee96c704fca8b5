/**
 * Opening a model for the reference: a KDTR bundle (config in its metadata), a HuggingFace
 * directory (config.json + safetensors), or a safetensors file / index with a config.json beside it.
 */
import { stat } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { findModelConfig, modelConfigNameFor, openTensors, readJsonFile, typedView, type AnyTensorStore } from '@kdtree/format';
import { describeCompressedTensors, findCompressedTensorsConfig, readQuantizationMetadata } from '@kdtree/quant';
import { parseModelConfig, type ModelConfig } from './config.js';
import { checkDflashPairing, parseDflashConfig, type DflashConfig } from './dflash-config.js';
import { DflashModel, dflashStoreSource, loadDflashWeights } from './dflash.js';
import { ConfigError } from './errors.js';
import { ReferenceModel } from './model.js';
import { loadWeights, storeWeightSource } from './weights.js';

export interface LoadedModel {
  model: ReferenceModel;
  config: ModelConfig;
  /** The bundle's metadata (KDTR) or {} (safetensors). */
  metadata: Record<string, unknown>;
  path: string;
}

/** The config.json of a store: a KDTR bundle's metadata.config, else the file beside the checkpoint. */
export async function configFor(store: AnyTensorStore, path: string, configPath?: string): Promise<{ json: unknown; source: string }> {
  if (configPath !== undefined) return { json: await readJsonFile(configPath, 'model config'), source: configPath };
  const meta = store.metadata as Record<string, unknown>;
  if (store.format.startsWith('kdtr')) {
    if (meta.config === undefined) throw new ConfigError('the bundle has no model config in its metadata (import it with --config config.json)', 'metadata.config', path);
    return { json: meta.config, source: `${path} (metadata.config)` };
  }
  // NAME.config.json beside NAME.safetensors (what `kdtree export` writes), else config.json.
  const candidate = await findModelConfig(path);
  if (candidate === undefined) {
    const isDir = (await stat(path)).isDirectory();
    const dir = isDir ? path : dirname(path);
    const looked = [...new Set([...(isDir ? [] : [modelConfigNameFor(path)]), 'config.json'])].map((name) => join(dir, name));
    throw new ConfigError(`no model config beside the checkpoint (looked for ${looked.join(' and ')}; pass one explicitly, e.g. --config FILE)`, 'config.json', path);
  }
  return { json: await readJsonFile(candidate, 'model config'), source: candidate };
}

/** Loads a whole model into memory (f32; INT4 weights dequantized). */
export async function loadModel(path: string, options: { config?: string } = {}): Promise<LoadedModel> {
  const store = await openTensors(path);
  try {
    const { json, source } = await configFor(store, path, options.config);
    const config = parseModelConfig(json, source);
    // A compressed-tensors checkpoint read in place: its INT4 weights are dequantized on load.
    const found = readQuantizationMetadata(store) === undefined ? findCompressedTensorsConfig(json as Record<string, unknown>, source) : undefined;
    const quantization = found
      ? await describeCompressedTensors(store.tensors, found, async (name) => Array.from(typedView(store.get(name).dtype, await store.read(name)) as ArrayLike<number | bigint>, Number))
      : undefined;
    const weights = await loadWeights(config, storeWeightSource(store, config, quantization));
    return { model: new ReferenceModel(config, weights), config, metadata: store.metadata as Record<string, unknown>, path };
  } finally {
    await store.close();
  }
}

export interface LoadedDflash {
  model: DflashModel;
  config: DflashConfig;
  path: string;
}

/**
 * Loads a DFlash drafter (a KDTR bundle from `kdtree import`, or a HuggingFace directory with
 * config.json + safetensors) for `target`, after checking that it fits it.
 */
export async function loadDflashModel(path: string, target: ReferenceModel, options: { config?: string } = {}): Promise<LoadedDflash> {
  const store = await openTensors(path);
  try {
    const { json, source } = await configFor(store, path, options.config);
    const config = parseDflashConfig(json, source);
    checkDflashPairing(config, target.config, { drafter: path });
    const weights = await loadDflashWeights(config, dflashStoreSource(store));
    return { model: new DflashModel(config, weights, { embed: target.weights.embed, lmHead: target.weights.lmHead }), config, path };
  } finally {
    await store.close();
  }
}
