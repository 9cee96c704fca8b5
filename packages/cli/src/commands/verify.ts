import { formatCrc32 } from '@kdtree/format';
import type { CommandSpec, Parsed } from '../args.js';
import { CliError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { formatBytes, formatDuration } from '../output.js';
import { openSources } from './import.js';

export const verifySpec: CommandSpec = {
  name: 'verify',
  summary: 'Check a bundle: structure on open, then the CRC-32 of every tensor. Exits 0 when intact, 1 naming the first bad tensor otherwise.',
  usage: 'kdtree verify IN.kdtr [--json] [--quiet]',
  help: ['--json                print a JSON report on stdout (schema "kdtree.verify/1")', '-q, --quiet           no progress bar'],
  options: { json: { type: 'boolean' }, quiet: { type: 'boolean', short: 'q' } },
  positionals: [1, 1],
};

export async function runVerify(p: Parsed, io: CommandIO): Promise<number> {
  const [store] = await openSources(p.positionals);
  try {
    const bar = io.progress('verify', store.totalBytes, { enabled: !p.values.quiet && !p.values.json });
    const started = performance.now();
    const result = await store.verify({ onProgress: (q) => bar.update(q.bytesDone, q.tensor.name) });
    bar.finish();
    const seconds = (performance.now() - started) / 1000;
    if (p.values.json) {
      io.out(jsonReport('kdtree.verify/1', { path: store.path, ok: result.ok, checked: result.checked, bytes: result.bytes, failures: result.failures.map((f) => ({ tensor: f.tensor, file: f.file, expected: formatCrc32(f.expected), actual: formatCrc32(f.actual) })) }));
      return result.ok ? 0 : 1;
    }
    if (result.checked === 0 && store.tensors.length > 0) {
      throw new CliError(`${store.path}: ${store.format} stores no checksums; nothing to verify (import it into KDTR first)`);
    }
    if (!result.ok) {
      const f = result.failures[0];
      const more = result.failures.length > 1 ? ` (and ${result.failures.length - 1} more: ${result.failures.slice(1, 6).map((x) => x.tensor).join(', ')}${result.failures.length > 6 ? ', ...' : ''})` : '';
      throw new CliError(`${f.file}: tensor '${f.tensor}': checksum mismatch, expected crc32 ${formatCrc32(f.expected)}, found ${formatCrc32(f.actual)}${more}`);
    }
    io.out(`OK ${store.path}: ${result.checked} tensors, ${formatBytes(result.bytes)} verified in ${formatDuration(seconds)}`);
    return 0;
  } finally {
    await store.close();
  }
}
