import { stat, unlink } from 'node:fs/promises';
import { dirname, join, sep } from 'node:path';
import { makeDirectories, modelConfigNameFor, writeFileAtomic, writeSafetensors, type AnyTensorStore, type SafetensorsTensor } from '@kdtree/format';
import { planCompressedTensorsExport, quantizationConfigFor, SAFETENSORS_QUANTIZATION_KEY, validateQuantizedStore, withQuantizationConfig } from '@kdtree/quant';
import { tokenizerFromMetadata } from '@kdtree/tokenizer';
import { parseChoice, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { checkOutputName, refuseOverwritingInputs, storeFiles } from '../output-paths.js';
import { formatBytes, formatDuration } from '../output.js';
import { counted, openSources } from './import.js';

export const exportSpec: CommandSpec = {
  name: 'export',
  summary: 'Write the tensors of a bundle back out as one safetensors file, byte-identical. With --format compressed-tensors, INT4 weights go back to weight_packed / weight_scale / weight_shape with a matching quantization_config. A directory output (DIR/, or an existing directory) gets model.safetensors + config.json (a HuggingFace model directory), and the tokenizer the bundle carries as tiktoken.model, tokenizer_config.json and chat_template.jinja; a file output NAME.safetensors gets its config as NAME.config.json beside it, where `kdtree import` and `kdtree golden` find it. INT4 descriptors travel in the file\'s __metadata__ ("kdtree.quantization").',
  usage: 'kdtree export IN.kdtr -o OUT.safetensors|DIR/ [--format safetensors|compressed-tensors] [--json] [--quiet]',
  help: [
    '-o, --output PATH     NAME.safetensors (a file), or DIR/ or an existing directory (model.safetensors + config.json); any other name is refused',
    '--format NAME         safetensors (default: tensors as stored) or compressed-tensors (pack-quantized names)',
    '--json                print a JSON summary on stdout',
    '-q, --quiet           no progress bar',
  ],
  options: {
    output: { type: 'string', short: 'o' },
    format: { type: 'string' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [1, 1],
};

function stringMap(value: unknown): Record<string, string> | undefined {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return undefined;
  return Object.values(value).every((v) => typeof v === 'string') ? (value as Record<string, string>) : undefined;
}

interface ExportPlan {
  tensors: SafetensorsTensor[];
  metadata?: Record<string, string>;
  config?: Record<string, unknown>;
}

function plainPlan(store: AnyTensorStore, onBytes: (n: number, name: string) => void): ExportPlan {
  const meta = store.metadata as Record<string, unknown>;
  const metadata = stringMap(meta['safetensors.metadata']) ?? (store.format.startsWith('safetensors') ? stringMap(meta) : undefined);
  // __metadata__ holds strings only: the INT4 descriptors go in as JSON text, so that importing the
  // file (or running the reference on it) finds its .qw/.sc tensors described.
  const quantization = validateQuantizedStore(store);
  return {
    tensors: store.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, data: () => counted(store.chunks(t.name), (n) => onBytes(n, t.name)) })),
    metadata: quantization === undefined ? metadata : { ...(metadata ?? {}), [SAFETENSORS_QUANTIZATION_KEY]: JSON.stringify(quantization) },
    config: meta.config as Record<string, unknown> | undefined,
  };
}

function compressedTensorsPlan(store: AnyTensorStore, onBytes: (n: number, name: string) => void): ExportPlan {
  const meta = validateQuantizedStore(store);
  if (meta === undefined || Object.keys(meta.tensors).length === 0) {
    throw new CliError(`${store.path}: holds no INT4 weights; use 'kdtree quantize' first, or export with --format safetensors`);
  }
  const bundleMeta = store.metadata as Record<string, unknown>;
  const tensors = planCompressedTensorsExport(store.tensors, meta).map((e): SafetensorsTensor => {
    const from = e.from;
    return { name: e.name, dtype: e.dtype, shape: e.shape, data: 'bytes' in from ? from.bytes : () => counted(store.chunks(from.tensor), (n) => onBytes(n, from.tensor)) };
  });
  return {
    tensors,
    metadata: stringMap(bundleMeta['safetensors.metadata']) ?? { format: 'pt' },
    config: withQuantizationConfig(bundleMeta.config as Record<string, unknown> | undefined, quantizationConfigFor(meta, store.tensors)),
  };
}

/**
 * Where export writes. `DIR/` (a trailing separator) or an existing directory: DIR/model.safetensors
 * and DIR/config.json. Otherwise the name must end in .safetensors: NAME.safetensors and
 * NAME.config.json beside it. Anything else is refused, so `-o out` never silently becomes a file
 * named "out" when a directory was meant.
 */
async function exportTargets(output: string): Promise<{ file: string; configFile: string; isDir: boolean }> {
  const info = await stat(output).catch(() => undefined);
  const isDir = output.endsWith('/') || output.endsWith(sep) || info?.isDirectory() === true;
  if (isDir) return { file: join(output, 'model.safetensors'), configFile: join(output, 'config.json'), isDir };
  if (!output.toLowerCase().endsWith('.safetensors')) {
    throw new CliUsageError(`export: -o ${output} is neither a directory nor a .safetensors name; write ${output}/ for a model directory (model.safetensors + config.json) or ${output}.safetensors for one file`, 'export');
  }
  checkOutputName('export', '-o', output, 'safetensors');
  return { file: output, configFile: join(dirname(output), modelConfigNameFor(output)), isDir };
}

export async function runExport(p: Parsed, io: CommandIO): Promise<number> {
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('export: -o OUT.safetensors is required', 'export');
  const format = parseChoice(p.values.format as string | undefined, '--format', ['safetensors', 'compressed-tensors'] as const) ?? 'safetensors';
  const targets = await exportTargets(output);
  const [store] = await openSources(p.positionals);
  try {
    const total = store.totalBytes;
    const bar = io.progress('export', total, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    let done = 0;
    const onBytes = (n: number, name: string) => bar.update((done += n), name);
    const plan = format === 'compressed-tensors' ? compressedTensorsPlan(store, onBytes) : plainPlan(store, onBytes);
    const { file } = targets;
    const configFile = plan.config === undefined ? undefined : targets.configFile;
    // Everything that can fail on content is done before the first byte is written.
    const sideFiles: { flag: string; path: string; text: string }[] = [];
    if (configFile !== undefined) sideFiles.push({ flag: '-o (config)', path: configFile, text: `${JSON.stringify(plan.config, null, 2)}\n` });
    // a model directory carries its tokenizer as Kimi ships it (where import takes it from)
    const tokenizer = targets.isDir ? tokenizerFromMetadata(store.metadata as Record<string, unknown>, store.path) : undefined;
    if (tokenizer !== undefined) {
      for (const [name, text] of Object.entries(tokenizer.toFiles())) sideFiles.push({ flag: '-o (tokenizer)', path: join(output, name), text });
      tokenizer.free();
    }
    await refuseOverwritingInputs('export', [{ flag: '-o', path: file }, ...sideFiles], storeFiles([store]));
    if (targets.isDir) await makeDirectories(output);
    await writeSafetensors(file, plan.tensors, { metadata: plan.metadata });
    const written: string[] = [];
    try {
      for (const { path, text } of sideFiles) {
        await writeFileAtomic(path, text);
        written.push(path);
      }
    } catch (error) {
      // Half an export (weights without their config or tokenizer) is not left behind.
      for (const path of [file, ...written]) await unlink(path).catch(() => undefined);
      throw error;
    }
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    if (p.values.json) io.out(jsonReport('kdtree.export/1', { output: file, format, tensors: plan.tensors.length, bytes: total, config: configFile ?? null, tokenizer: tokenizer !== undefined, seconds: Number(seconds.toFixed(3)) }));
    else io.out(`exported ${plan.tensors.length} tensors (${formatBytes(total)}) to ${file}${format === 'compressed-tensors' ? ' in compressed-tensors form' : ''}${configFile ? `, config in ${configFile}` : ''}${tokenizer ? ', tokenizer beside it' : ''} in ${formatDuration(seconds)}`);
    return 0;
  } finally {
    await store.close();
  }
}
