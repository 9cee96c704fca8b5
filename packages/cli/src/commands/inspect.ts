import { stat } from 'node:fs/promises';
import { findModelConfig, formatCrc32, readJsonFile, type AnyTensorStore } from '@kdtree/format';
import { isDflashConfig, parseDflashConfig } from '@kdtree/reference';
import type { CommandSpec, Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { DRAFTER_METADATA_KEY, drafterMetadata, drafterSummary, type DrafterMetadata } from '../drafter.js';
import { jsonReport, type CommandIO } from '../io.js';
import { formatBytes, renderTable } from '../output.js';
import { openSources } from './import.js';

export const inspectSpec: CommandSpec = {
  name: 'inspect',
  summary: 'Print the metadata and the tensor table of a bundle (KDTR, or any safetensors checkpoint). A DFlash drafter (a bundle from kdtree import, or its directory) shows its block size, target layers and mask token.',
  usage: 'kdtree inspect IN.kdtr [--json] [--filter REGEX] [--metadata]',
  help: [
    '--json                stable JSON (schema "kdtree.inspect/1") on stdout',
    '--filter REGEX        only tensors whose name matches',
    '--metadata            print the whole metadata JSON (default: a summary)',
  ],
  options: {
    json: { type: 'boolean' },
    filter: { type: 'string' },
    metadata: { type: 'boolean' },
  },
  positionals: [1, 1],
};

const CONFIG_FIELDS = ['model_type', 'architectures', 'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'n_routed_experts', 'num_experts_per_tok', 'vocab_size'];

export async function runInspect(p: Parsed, io: CommandIO): Promise<number> {
  let filter: RegExp | undefined;
  try {
    filter = p.values.filter === undefined ? undefined : new RegExp(p.values.filter as string);
  } catch (error) {
    throw new CliUsageError(`--filter: ${(error as Error).message}`, 'inspect');
  }
  const [store] = await openSources(p.positionals);
  try {
    const tensors = store.tensors.filter((t) => filter === undefined || filter.test(t.name));
    const fileBytes = (await Promise.all([...new Set([...store.tensors.map((t) => t.file), store.path])].map((f) => stat(f).then((s) => s.size)))).reduce((a, b) => a + b, 0);
    const drafter = await drafterOf(store);
    if (p.values.json) {
      io.out(jsonReport('kdtree.inspect/1', { ...inspectJson(store, tensors, fileBytes), drafter: drafter ?? null }));
      return 0;
    }
    const lines: string[] = [];
    lines.push(`${store.path}`);
    lines.push(`  format     ${store.format}${'version' in store ? ` v${store.version}` : ''}${'shards' in store && store.shards.length > 1 ? `, ${store.shards.length} shards` : ''}`);
    lines.push(`  size       ${formatBytes(fileBytes)} on disk, ${formatBytes(store.totalBytes)} of tensor data`);
    lines.push(`  tensors    ${store.tensors.length}${filter ? ` (${tensors.length} match ${filter})` : ''}`);
    const meta = store.metadata as Record<string, unknown>;
    if (drafter !== undefined) lines.push(`  drafter    ${drafterSummary(drafter)}`);
    if (p.values.metadata) {
      lines.push('  metadata', ...JSON.stringify(meta, null, 2).split('\n').map((l) => `    ${l}`));
    } else {
      for (const [key, value] of Object.entries(meta)) {
        if (key === DRAFTER_METADATA_KEY && drafter !== undefined) continue; // the line above
        if (key === 'config' && typeof value === 'object' && value !== null) {
          const cfg = value as Record<string, unknown>;
          const inner = (typeof cfg.text_config === 'object' && cfg.text_config !== null ? cfg.text_config : cfg) as Record<string, unknown>;
          const shown = CONFIG_FIELDS.filter((f) => inner[f] !== undefined).map((f) => `${f}=${JSON.stringify(inner[f])}`);
          lines.push(`  config     ${shown.join(' ') || `${Object.keys(cfg).length} fields`}`);
        } else {
          const text = JSON.stringify(value);
          lines.push(`  ${key.padEnd(10)} ${text.length > 100 ? `${text.slice(0, 97)}...` : text}`);
        }
      }
    }
    lines.push('');
    const showFile = new Set(store.tensors.map((t) => t.file)).size > 1;
    const header = ['name', 'dtype', 'shape', 'bytes', 'offset', 'crc32', ...(showFile ? ['file'] : [])];
    const rows = tensors.map((t) => [
      t.name,
      t.dtype,
      `[${t.shape.join(', ')}]`,
      String(t.size),
      String(t.offset),
      t.crc32 === undefined ? '-' : formatCrc32(t.crc32),
      ...(showFile ? [t.file.split('/').pop()!] : []),
    ]);
    lines.push(renderTable(header, rows, new Set([3, 4])));
    io.out(lines.join('\n'));
    return 0;
  } finally {
    await store.close();
  }
}

/**
 * The drafter a store holds, from its DFlash config.json: a bundle's metadata.config, or the
 * config.json beside a safetensors checkpoint. Undefined for any other model.
 */
async function drafterOf(store: AnyTensorStore): Promise<DrafterMetadata | undefined> {
  if (store.format.startsWith('kdtr')) {
    const config = (store.metadata as Record<string, unknown>).config;
    return isDflashConfig(config) ? drafterMetadata(parseDflashConfig(config, `${store.path} (metadata.config)`)) : undefined;
  }
  const path = await findModelConfig(store.path);
  if (path === undefined) return undefined;
  const config = await readJsonFile(path, 'model config');
  return isDflashConfig(config) ? drafterMetadata(parseDflashConfig(config, path)) : undefined;
}

/** The --json schema. Field names and order are stable; new fields are only ever added. */
function inspectJson(store: AnyTensorStore, tensors: AnyTensorStore['tensors'], fileBytes: number) {
  return {
    path: store.path,
    format: store.format,
    version: 'version' in store ? store.version : null,
    file_bytes: fileBytes,
    tensor_count: store.tensors.length,
    tensor_bytes: store.totalBytes,
    metadata: store.metadata,
    tensors: tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, offset: t.offset, size: t.size, crc32: t.crc32 === undefined ? null : formatCrc32(t.crc32), file: t.file })),
  };
}
