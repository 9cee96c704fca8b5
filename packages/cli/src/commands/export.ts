import { mkdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { writeFileAtomic, writeSafetensors } from '@kdtree/format';
import { parseChoice, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { json, type CommandIO } from '../io.js';
import { formatBytes, formatDuration } from '../output.js';
import { counted, openSources } from './import.js';

export const exportSpec: CommandSpec = {
  name: 'export',
  summary: 'Write the tensors of a bundle back out as one safetensors file, byte-identical. With a directory as output, also writes config.json from the metadata (a HuggingFace model directory).',
  usage: 'kdtree export IN.kdtr -o OUT.safetensors|DIR [--json] [--quiet]',
  help: [
    '-o, --output PATH     a .safetensors file, or a directory (model.safetensors + config.json)',
    '--format NAME         safetensors (default)',
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

export async function runExport(p: Parsed, io: CommandIO): Promise<number> {
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('export: -o OUT.safetensors is required', 'export');
  parseChoice(p.values.format as string | undefined, '--format', ['safetensors'] as const);
  const [store] = await openSources(p.positionals);
  try {
    const isDir = output.endsWith('/') || (await stat(output).then((s) => s.isDirectory(), () => false));
    if (isDir) await mkdir(output, { recursive: true });
    const file = isDir ? join(output, 'model.safetensors') : output;
    const total = store.totalBytes;
    const bar = io.progress('export', total, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    let done = 0;
    const meta = store.metadata as Record<string, unknown>;
    const metadata = stringMap(meta['safetensors.metadata']) ?? (store.format.startsWith('safetensors') ? stringMap(meta) : undefined);
    await writeSafetensors(
      file,
      store.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape, data: () => counted(store.chunks(t.name), (n) => bar.update((done += n), t.name)) })),
      { metadata },
    );
    if (isDir && meta.config !== undefined) await writeFileAtomic(join(output, 'config.json'), `${JSON.stringify(meta.config, null, 2)}\n`);
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    if (p.values.json) io.out(json({ output: file, tensors: store.tensors.length, bytes: total, seconds: Number(seconds.toFixed(3)) }));
    else io.out(`exported ${store.tensors.length} tensors (${formatBytes(total)}) to ${file} in ${formatDuration(seconds)}`);
    return 0;
  } finally {
    await store.close();
  }
}
