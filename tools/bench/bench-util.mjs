// Shared helpers of the benchmark scripts: timing, medians and the printed table.
import { spawnSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export function median(values) {
  const s = [...values].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
}

export async function timeIt(fn) {
  const t = performance.now();
  await fn();
  return (performance.now() - t) / 1000;
}

export function benchDir(name) {
  const dir = join(process.env.KDTREE_BENCH_DIR ?? tmpdir(), `kdtree-bench-${name}`);
  mkdirSync(dir, { recursive: true });
  return dir;
}

export function run(cmd, args, options = {}) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 256 << 20, ...options });
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} failed (${r.status}): ${r.stderr}`);
  return r;
}

export function table(header, rows) {
  const widths = header.map((h, c) => Math.max(h.length, ...rows.map((r) => String(r[c]).length)));
  const line = (cells) => '| ' + cells.map((x, c) => String(x).padEnd(widths[c])).join(' | ') + ' |';
  return [line(header), '|' + widths.map((w) => '-'.repeat(w + 2)).join('|') + '|', ...rows.map(line)].join('\n');
}

export function machine() {
  const cpu = run('sh', ['-c', "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"]).stdout.trim();
  return `${cpu}, ${run('nproc', []).stdout.trim()} cores, Node ${process.version}`;
}

export const GB = 1e9;
export const MiB = 1 << 20;
