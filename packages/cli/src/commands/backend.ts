import { AddonLoadError, BACKEND_KINDS, createBackend, type KdtreeBackend, type LoadAttempt, type NativeDeviceInfo } from '@kdtree/cuda';
import { parseChoice, parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { jsonReport, type CommandIO } from '../io.js';
import { formatBytes } from '../output.js';

export const backendSpec: CommandSpec = {
  name: 'backend',
  summary:
    'Show which native backend of @kdtree/cuda loads on this machine (cuda or cpu), from which binary and build, on which device, and why the candidates before it were skipped. Exits 1 listing every candidate and how to fix it when none loads.',
  usage: 'kdtree backend [--backend auto|cuda|cpu] [--device N] [--json]',
  help: [
    '--backend KIND        auto (cuda, else cpu), cuda or cpu; default: $KDTREE_BACKEND, else auto',
    '--device N            CUDA device ordinal (default 0); one the machine lacks is an error, not a cpu fallback',
    '--json                stable JSON (schema "kdtree.backend/1") on stdout, also when nothing loads',
  ],
  options: { backend: { type: 'string' }, device: { type: 'string' }, json: { type: 'boolean' } },
  positionals: [0, 0],
};

/** CUDA encodes versions as 1000 x major + 10 x minor (13000 = 13.0). */
function cudaVersion(v: number): string {
  return `${Math.floor(v / 1000)}.${Math.floor((v % 1000) / 10)}`;
}

function deviceLine(index: number, d: NativeDeviceInfo): string {
  if (d.kind === 'cpu') return d.name;
  return `${index}: ${d.name}, compute capability ${d.computeCapability}, ${d.multiprocessors} SMs, ${formatBytes(d.totalMemory)}, driver ${cudaVersion(d.driverVersion)}, runtime ${cudaVersion(d.runtimeVersion)}`;
}

/** The JSON report (schema "kdtree.backend/1"; snake_case like every --json; fields are only ever added). */
function report(backend: KdtreeBackend, index: number, info: NativeDeviceInfo) {
  const { loaded } = backend;
  // the cpu twin has no compute capability, memory or driver: only its thread pool
  const device =
    info.kind === 'cuda'
      ? { kind: info.kind, index, name: info.name, compute_capability: info.computeCapability, multiprocessors: info.multiprocessors, total_memory: info.totalMemory, driver_version: info.driverVersion, runtime_version: info.runtimeVersion }
      : { kind: info.kind, name: info.name, threads: info.multiprocessors };
  const m = loaded.meta;
  const build = { name: m.name, version: m.version, variant: m.variant, platform: m.platform, arch: m.arch, napi_version: m.napiVersion, cuda_version: m.cudaVersion, cuda_architectures: m.cudaArchitectures, source_hash: m.sourceHash ?? null, built: m.built ?? null };
  return { ok: true, backend: backend.kind, source: loaded.source, path: loaded.path, build, device, skipped: loaded.skipped.map(attempt) };
}

function attempt(a: LoadAttempt) {
  return { variant: a.variant, candidate: a.candidate, reason: a.reason };
}

export async function runBackend(p: Parsed, io: CommandIO): Promise<number> {
  const kind = parseChoice(p.values.backend as string | undefined, '--backend', BACKEND_KINDS);
  const named = parseIntArg(p.values.device as string | undefined, '--device', { min: 0, max: 2 ** 31 - 1 });
  const device = named ?? 0;
  let backend: KdtreeBackend;
  try {
    backend = createBackend({ backend: kind, device: named });
  } catch (error) {
    if (!(error instanceof AddonLoadError) || !p.values.json) throw error;
    io.out(jsonReport('kdtree.backend/1', { ok: false, requested: error.requested, platform: error.platformKey, attempts: error.attempts.map(attempt) }));
    return 1;
  }
  const info = backend.info();
  const r = report(backend, device, info);
  if (p.values.json) {
    io.out(jsonReport('kdtree.backend/1', r));
    return 0;
  }
  const b = r.build;
  const cuda = b.cuda_version ? `, CUDA ${b.cuda_version}, ${b.cuda_architectures.join(' ')}` : '';
  const lines = [
    `backend  ${r.backend}, from ${r.source}`,
    `binary   ${r.path}`,
    `build    @kdtree/cuda ${b.version} (${b.variant}, ${b.platform}-${b.arch}${cuda}${b.source_hash ? `, sources ${b.source_hash}` : ''})`,
    `device   ${deviceLine(device, info)}`,
    ...r.skipped.map((a, i) => `${i === 0 ? 'skipped' : '       '}  ${a.variant} ${a.candidate}: ${a.reason}`),
  ];
  io.out(lines.join('\n'));
  return 0;
}
