import { mkdir, stat } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { writeFileAtomic, writeSafetensors, type AnyTensorStore, type SafetensorsTensor } from '@kdtree/format';
import { planCompressedTensorsExport, quantizationConfigFor, validateQuantizedStore, withQuantizationConfig } from '@kdtree/quant';
import { parseChoice, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { json, type CommandIO } from '../io.js';
import { formatBytes, formatDuration } from '../output.js';
import { counted, openSources } from './import.js';

export const exportSpec: CommandSpec = {
  name: 'export',
  summary: 'Write the tensors of a bundle back out as one safetensors file, byte-identical. With --format compressed-tensors, INT4 weights go back to weight_packed / weight_scale / weight_shape with a matching quantization_config. A directory output gets model.safetensors + config.json (a HuggingFace model directory); a file output gets its config as NAME.config.json beside it.',
  usage: 'kdtree export IN.kdtr -o OUT.safetensors|DIR [--format safetensors|compressed-tensors] [--json] [--quiet]',
  help: [
    '-o, --output PATH     a .safetensors file, or a directory (model.safetensors + config.json)',
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
  return {
    tensors: store.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, data: () => counted(store.chunks(t.name), (n) => onBytes(n, t.name)) })),
    metadata: stringMap(meta['safetensors.metadata']) ?? (store.format.startsWith('safetensors') ? stringMap(meta) : undefined),
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

export async function runExport(p: Parsed, io: CommandIO): Promise<number> {
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('export: -o OUT.safetensors is required', 'export');
  const format = parseChoice(p.values.format as string | undefined, '--format', ['safetensors', 'compressed-tensors'] as const) ?? 'safetensors';
  const [store] = await openSources(p.positionals);
  try {
    const isDir = output.endsWith('/') || (await stat(output).then((s) => s.isDirectory(), () => false));
    if (isDir) await mkdir(output, { recursive: true });
    const file = isDir ? join(output, 'model.safetensors') : output;
    const total = store.totalBytes;
    const bar = io.progress('export', total, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    let done = 0;
    const onBytes = (n: number, name: string) => bar.update((done += n), name);
    const plan = format === 'compressed-tensors' ? compressedTensorsPlan(store, onBytes) : plainPlan(store, onBytes);
    await writeSafetensors(file, plan.tensors, { metadata: plan.metadata });
    let configFile: string | undefined;
    if (plan.config !== undefined) {
      configFile = isDir ? join(output, 'config.json') : join(dirname(file), `${basename(file).replace(/\.safetensors$/, '')}.config.json`);
      await writeFileAtomic(configFile, `${JSON.stringify(plan.config, null, 2)}\n`);
    }
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    if (p.values.json) io.out(json({ output: file, format, tensors: plan.tensors.length, bytes: total, config: configFile ?? null, seconds: Number(seconds.toFixed(3)) }));
    else io.out(`exported ${plan.tensors.length} tensors (${formatBytes(total)}) to ${file}${format === 'compressed-tensors' ? ' in compressed-tensors form' : ''}${configFile ? `, config in ${configFile}` : ''} in ${formatDuration(seconds)}`);
    return 0;
  } finally {
    await store.close();
  }
}
