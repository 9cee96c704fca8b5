import { stat } from 'node:fs/promises';
import { join } from 'node:path';
import {
  findModelConfig,
  KdtrWriter,
  openTensors,
  readJsonFile as readFormatJsonFile,
  ShardedKdtrWriter,
  typedView,
  type AnyTensorStore,
  type TensorInfo,
} from '@kdtree/format';
import { findCompressedTensorsConfig, planCompressedTensorsImport, validateQuantizedStore, type QuantizationMetadata } from '@kdtree/quant';
import { loadTokenizer, TOKENIZER_METADATA_KEY, tokenizerFromMetadata, tokenizerMetadata, type TokenizerMetadata } from '@kdtree/tokenizer';
import { checkDflashTensors, configFor, isDflashConfig, parseDflashConfig, type DflashConfig } from '@kdtree/reference';
import { parseByteSize, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { checkDrafterTarget, DRAFTER_METADATA_KEY, drafterMetadata } from '../drafter.js';
import { CLI_VERSION, jsonReport, type CommandIO } from '../io.js';
import { checkOutputName, refuseOverwritingInputs, storeFiles } from '../output-paths.js';
import { formatBytes, formatDuration } from '../output.js';

export const importSpec: CommandSpec = {
  name: 'import',
  summary: "Import safetensors files, a sharded checkpoint (model.safetensors.index.json) or a HuggingFace model directory into a KDTR bundle. Tensors keep their names, dtypes and bytes; config.json goes into the metadata, and so does a directory's Kimi tokenizer (tiktoken.model, tokenizer_config.json, chat_template.jinja), checked by loading it, so that run --text, chat and serve need nothing else. A compressed-tensors pack-quantized checkpoint (Kimi K2.x) keeps its packed codes and scales, renamed to <weight>.qw / <weight>.sc. A DFlash drafter directory (architectures DFlashDraftModel) is checked (config and tensor shapes) and recorded as a drafter (metadata.drafter); --target checks that it fits a target model.",
  usage: 'kdtree import SRC... -o OUT.kdtr [--config config.json] [--target MODEL] [--shard-size 5GB] [--json] [--quiet]',
  help: [
    '-o, --output FILE     the bundle to write (with --shard-size: the index, e.g. model.kdtr.json)',
    '--config FILE         model config.json to store (default: config.json of a model directory)',
    '--target MODEL        a DFlash drafter only: the target it will draft for (bundle, directory or config.json); refuse a drafter whose hidden size, vocabulary or target layers do not fit it',
    '--shard-size SIZE     write a multi-file bundle (-o NAME.kdtr.json: the index), shards of at most SIZE (e.g. 5GB; at least 4096)',
    '--json                print a JSON summary on stdout',
    '-q, --quiet           no progress bar',
  ],
  options: {
    output: { type: 'string', short: 'o' },
    config: { type: 'string' },
    target: { type: 'string' },
    'shard-size': { type: 'string' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [1, Infinity],
};

/** A JSON object file (a model config, a rules file), read strictly (see @kdtree/format readJsonFile). */
export async function readJsonObject(path: string, what: string): Promise<Record<string, unknown>> {
  const value = await readFormatJsonFile(path, what);
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw new CliError(`${path}: ${what} must be a JSON object, found ${Array.isArray(value) ? 'an array' : JSON.stringify(value)?.slice(0, 40)}`);
  return value as Record<string, unknown>;
}

/** Opens every source; on any failure closes what was opened. */
export async function openSources(paths: string[]): Promise<AnyTensorStore[]> {
  const stores: AnyTensorStore[] = [];
  try {
    for (const p of paths) {
      await stat(p).catch(() => {
        throw new CliError(`${p}: no such file or directory`);
      });
      stores.push(await openTensors(p));
    }
  } catch (error) {
    await Promise.all(stores.map((s) => s.close()));
    throw error;
  }
  return stores;
}

/** The smallest --shard-size: one page of tensor data (a shard holds at least one tensor anyway). */
export const MIN_SHARD_BYTES = 4096;

/**
 * The INT4 descriptors the sources carry (a KDTR bundle's metadata.quantization, a safetensors
 * file's __metadata__["kdtree.quantization"]), each checked against its store; merged.
 */
function sourceQuantization(stores: readonly AnyTensorStore[]): QuantizationMetadata | undefined {
  let merged: QuantizationMetadata | undefined;
  for (const store of stores) {
    const q = validateQuantizedStore(store);
    if (q === undefined) continue;
    merged = merged === undefined ? { ...q, tensors: { ...q.tensors } } : { ...merged, tensors: { ...merged.tensors, ...q.tensors } };
  }
  return merged;
}

/**
 * The tokenizer the sources bring: a model directory's Kimi tokenizer files (where it has a
 * tiktoken.model; a directory without one has no tokenizer this package reads), else a KDTR
 * source's `metadata.tokenizer`. Loaded, so that broken files stop the import naming the file.
 */
async function sourceTokenizer(paths: readonly string[], stores: readonly AnyTensorStore[]): Promise<{ metadata: TokenizerMetadata; from: string } | undefined> {
  for (const path of paths) {
    if (!(await stat(path)).isDirectory() || (await stat(join(path, 'tiktoken.model')).catch(() => undefined)) === undefined) continue;
    const tokenizer = await loadTokenizer(path);
    const metadata = tokenizerMetadata(tokenizer.toFiles());
    tokenizer.free();
    return { metadata, from: path };
  }
  for (const store of stores) {
    if (!store.format.startsWith('kdtr')) continue;
    const tokenizer = tokenizerFromMetadata(store.metadata as Record<string, unknown>, store.path);
    if (tokenizer === undefined) continue;
    const metadata = tokenizerMetadata(tokenizer.toFiles());
    tokenizer.free();
    return { metadata, from: store.path };
  }
  return undefined;
}

/** Every file the stores at `paths` read (opened for their headers only, then closed). */
export async function inputFiles(paths: readonly string[]): Promise<string[]> {
  const stores = await openSources([...paths]);
  try {
    return storeFiles(stores);
  } finally {
    await Promise.all(stores.map((s) => s.close()));
  }
}

export async function runImport(p: Parsed, io: CommandIO): Promise<number> {
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('import: -o OUT.kdtr is required', 'import');
  const shardSize = p.values['shard-size'] === undefined ? undefined : parseByteSize(p.values['shard-size'] as string, '--shard-size', MIN_SHARD_BYTES);
  checkOutputName('import', '-o', output, shardSize === undefined ? 'kdtr' : 'kdtr-index');
  const stores = await openSources(p.positionals);
  try {
    let configPath = p.values.config as string | undefined;
    if (configPath === undefined) {
      // The config beside a safetensors source (a directory's config.json, NAME.config.json beside
      // NAME.safetensors); a KDTR source brings its own in its metadata.
      for (const store of stores) {
        if (store.format.startsWith('kdtr')) continue;
        configPath = await findModelConfig(store.path);
        if (configPath) break;
      }
    }
    await refuseOverwritingInputs('import', [{ flag: '-o', path: output, sharded: shardSize !== undefined }], [...storeFiles(stores), ...(configPath ? [configPath] : [])]);
    const kdtrConfig = stores.map((s) => (s.format.startsWith('kdtr') ? (s.metadata as Record<string, unknown>).config : undefined)).find((c) => c !== undefined);
    const config = configPath === undefined ? (kdtrConfig as Record<string, unknown> | undefined) : await readJsonObject(configPath, 'model config');
    const drafter = await importedDrafter(config, configPath ?? `${stores[0].path} (metadata.config)`, stores, p.values.target as string | undefined);
    const owner = new Map<string, AnyTensorStore>();
    for (const store of stores) {
      for (const t of store.tensors) {
        const first = owner.get(t.name);
        if (first !== undefined) throw new CliError(`tensor '${t.name}' is in both ${first.path} and ${store.path}`);
        owner.set(t.name, store);
      }
    }
    const all: TensorInfo[] = stores.flatMap((s) => [...s.tensors]);
    // compressed-tensors checkpoints: rename packed parts, keep every byte (no dequantize/requantize).
    const found = findCompressedTensorsConfig(config, configPath);
    const plan = found
      ? await planCompressedTensorsImport(all, found, async (name) => Array.from(typedView(owner.get(name)!.get(name).dtype, await owner.get(name)!.read(name)) as ArrayLike<number | bigint>, Number))
      : { tensors: all.map((t) => ({ source: t.name, target: t.name })), quantization: sourceQuantization(stores) };
    const tokenizer = await sourceTokenizer(p.positionals, stores);
    const first = stores[0];
    const metadata: Record<string, unknown> = {
      provenance: {
        tool: `kdtree import (@kdtree/cli ${CLI_VERSION})`,
        created: new Date().toISOString(),
        sources: stores.map((s) => ({ path: s.path, format: s.format, tensors: s.tensors.length, bytes: s.totalBytes })),
      },
    };
    if (config !== undefined) metadata.config = config;
    if (drafter !== undefined) metadata[DRAFTER_METADATA_KEY] = drafterMetadata(drafter);
    if (first.format === 'safetensors' || first.format === 'safetensors-index') metadata['safetensors.metadata'] = first.metadata;
    if (plan.quantization !== undefined) metadata.quantization = plan.quantization;
    if (tokenizer !== undefined) metadata[TOKENIZER_METADATA_KEY] = tokenizer.metadata;
    const writer = shardSize === undefined ? await KdtrWriter.create(output, { metadata }) : await ShardedKdtrWriter.create(output, { metadata, maxShardBytes: shardSize });
    const total = plan.tensors.reduce((sum, e) => sum + owner.get(e.source)!.get(e.source).size, 0);
    const bar = io.progress('import', total, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    let done = 0;
    let count = 0;
    try {
      for (const entry of plan.tensors) {
        const store = owner.get(entry.source)!;
        const t = store.get(entry.source);
        await writer.add({ name: entry.target, dtype: t.dtype, shape: t.shape }, counted(store.chunks(t.name), (n) => bar.update((done += n), t.name)));
        count++;
      }
      await writer.close();
    } catch (error) {
      await writer.abort();
      throw error;
    }
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    const quantized = plan.quantization ? Object.keys(plan.quantization.tensors).length : 0;
    const configSource = configPath ?? (config !== undefined ? 'the source bundle' : null);
    if (p.values.json) io.out(jsonReport('kdtree.import/1', { output, tensors: count, bytes: total, sources: stores.length, config: configPath ?? null, int4_weights: quantized, tokenizer: tokenizer?.from ?? null, seconds: Number(seconds.toFixed(3)), drafter: drafter === undefined ? null : drafterMetadata(drafter) }));
    else io.out(`imported ${count} tensors (${formatBytes(total)}) from ${stores.length} source(s) into ${output} in ${formatDuration(seconds)}${configSource ? `, config from ${configSource}` : ''}${tokenizer ? `, tokenizer from ${tokenizer.from}` : ''}${quantized ? `; ${quantized} INT4 weights kept packed` : ''}${drafter ? `; a DFlash drafter (block_size ${drafter.blockSize}, target layers [${drafter.targetLayerIds.join(', ')}], mask token ${drafter.maskTokenId})` : ''}`);
    return 0;
  } finally {
    await Promise.all(stores.map((s) => s.close()));
  }
}

/**
 * A DFlash drafter's config, checked with its tensor table (and against --target's config), or
 * undefined for any other model (where --target is refused: it only means something for a drafter).
 */
async function importedDrafter(config: Record<string, unknown> | undefined, source: string, stores: readonly AnyTensorStore[], target: string | undefined): Promise<DflashConfig | undefined> {
  if (config === undefined || !isDflashConfig(config)) {
    if (target !== undefined) throw new CliUsageError('--target is for DFlash drafters (config.json with architectures ["DFlashDraftModel"]); this import is not one', 'import');
    return undefined;
  }
  const drafter = parseDflashConfig(config, source);
  checkDflashTensors(drafter, stores.flatMap((s) => [...s.tensors]), stores.map((s) => s.path).join(', '));
  if (target !== undefined) {
    const { json, source: targetSource } = await targetConfig(target);
    checkDrafterTarget(drafter, json, targetSource, source);
  }
  return drafter;
}

/** A target's config.json: the file itself, or the config of a bundle / checkpoint / directory. */
async function targetConfig(path: string): Promise<{ json: unknown; source: string }> {
  if (path.endsWith('.json') && !path.endsWith('.kdtr.json') && !path.endsWith('.index.json')) return { json: await readJsonObject(path, 'target config'), source: path };
  const [store] = await openSources([path]);
  try {
    return await configFor(store, path);
  } finally {
    await store.close();
  }
}

/** Passes chunks through, reporting each chunk's size. */
export async function* counted(chunks: AsyncIterable<Uint8Array>, onBytes: (n: number) => void): AsyncGenerator<Uint8Array> {
  for await (const chunk of chunks) {
    yield chunk;
    onBytes(chunk.byteLength);
  }
}
