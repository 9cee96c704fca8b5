/**
 * NCCL on one GPU (bundled into .gpu/nccl-check.mjs): the library loads and reports its version; a
 * world-size-1 communicator comes up on the backend's device; an all-reduce, an all-gather and a
 * broadcast captured into a CUDA graph with a kernel before them give the right values at each
 * launch; the engine's decode over NcclCollective (one rank: every layer's all-reduces are NCCL
 * kernels inside the step's graph) emits exactly the tokens of the plain model; and a per-layer
 * all-reduce (hidden 7168 f32 x T rows, T = 1, 16, 64) is timed, captured and uncaptured.
 *   /tmp/node .gpu/nccl-check.mjs          (OUT=dir writes nccl-check.json; NCCL_NVLS_ENABLE=0 is set)
 * Prints one JSON object; exits 1 if any check fails.
 */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { writeSyntheticModel } from '@kdtree/reference';
import { createBackend, ncclVersionString, type KdtreeBackend } from '@kdtree/cuda';
import { DeviceModel, ModelSource, NcclCollective, Runner } from '@kdtree/engine';

process.env.NCCL_NVLS_ENABLE ??= '0'; // no NVLink multicast on shared machines
const here = dirname(fileURLToPath(import.meta.url));
const b = createBackend({ backend: (process.env.KDTREE_NCCL_CHECK_BACKEND ?? 'cuda') as 'cuda' | 'cpu', searchPaths: [here], onlySearchPaths: true });
const report: { device: string; nccl?: string; checks: { check: string; ok: boolean; detail: string }[]; allReduce: { rows: number; hidden: number; bytes: number; graphUs: number; eagerUs: number }[] } = { device: b.info().name, checks: [], allReduce: [] };
const record = (check: string, ok: boolean, detail = '') => {
  report.checks.push({ check, ok, detail });
  console.error(`${ok ? 'PASS' : 'FAIL'} ${check}${detail ? `: ${detail}` : ''}`);
};
const attempt = async (check: string, run: () => Promise<string> | string) => {
  try {
    record(check, true, await run());
  } catch (error) {
    record(check, false, error instanceof Error ? error.message : String(error));
  }
};

const one = (bk: KdtreeBackend, gatherFloats = 0) => new NcclCollective(bk, { rank: 0, world: 1, id: bk.ncclUniqueId(), timeoutMs: 30_000, gatherFloats });

await attempt('ncclGetVersion', () => (report.nccl = ncclVersionString(b.ncclVersion())));

await attempt('world-size-1 communicator; all-reduce, all-gather, broadcast captured in one graph', () => {
  const c = one(b);
  try {
    const n = 7168;
    const x = b.fromArray('f32', [1, n], Float32Array.from({ length: n }, (_, i) => i * 0.25 - 3));
    const twice = b.zeros('f32', [1, n]);
    const gathered = b.zeros('f32', [1, n]);
    const ids = b.fromArray('i32', [5], Int32Array.of(3, 1, 4, 1, 5));
    const stream = b.native.createStream();
    const graph = b.capture(stream, () => {
      b.native.add({ a: x, b: x, out: twice, stream }); // a kernel before the collectives, in the same graph
      c.allReduceSum(twice, stream);
      c.allGather(twice, gathered, stream);
      c.broadcast([ids], 0, stream);
    });
    for (let launch = 0; launch < 3; launch++) {
      b.native.launchGraph(graph, stream);
      b.synchronize(stream);
      const got = b.toArray(gathered) as Float32Array;
      const bad = got.findIndex((v, i) => v !== 2 * (i * 0.25 - 3));
      if (bad >= 0) throw new Error(`launch ${launch}: element ${bad} is ${got[bad]}, expected ${2 * (bad * 0.25 - 3)}`);
    }
    if ([...(b.toArray(ids) as Int32Array)].join() !== '3,1,4,1,5') throw new Error('the broadcast changed the root\'s own tensor');
    return `${graph.calls} captured calls, 3 launches exact`;
  } finally {
    c.close();
  }
});

await attempt('decode over NCCL (tp 1) == the plain model, token for token', async () => {
  const work = mkdtempSync(join(tmpdir(), 'kdtree-nccl-check-'));
  const path = join(work, 'k2-mini.kdtr');
  await writeSyntheticModel(path, { preset: 'k2-mini', seed: 5, quant: 'kimi-k2' }, 'nccl-check');
  const PROMPT = [1, 7, 42, 3, 99, 5, 64, 11];
  const decode = async (nccl: boolean) => {
    const source = await ModelSource.open(path);
    const collective = nccl ? one(b) : undefined;
    const model = await DeviceModel.load(b, source, { rows: 64, collective });
    await source.close();
    const r = new Runner(b, model, 256, 'bf16', 64);
    try {
      // every step under the communicator's watchdog (armed for its timeout, disarmed after), as
      // the engine runs them
      const tokens = [r.guarded(() => (r.prefill(PROMPT, 0), r.readToken()))];
      for (let i = 1; i < 32; i++) {
        tokens.push(
          r.guarded(() => {
            r.run({ kind: 'decode' });
            r.advance(1);
            return r.readToken();
          }),
        );
      }
      return tokens;
    } finally {
      r.dispose();
      model.dispose();
      collective?.close();
    }
  };
  const plain = await decode(false);
  const over = await decode(true);
  const diverge = plain.findIndex((t, i) => t !== over[i]);
  if (diverge >= 0) throw new Error(`first divergence at token ${diverge}: ${over[diverge]} over NCCL, ${plain[diverge]} plain`);
  return `identical ${plain.length} tokens (${plain.slice(0, 8).join(' ')} ...), each step under the armed watchdog`;
});

await attempt('per-layer all-reduce time (hidden 7168 f32 x T rows)', () => {
  const c = one(b);
  try {
    const stream = b.native.createStream();
    for (const rows of [1, 16, 64]) {
      const t = b.zeros('f32', [rows, 7168]);
      const reps = 50;
      const graph = b.capture(stream, () => {
        for (let i = 0; i < reps; i++) c.allReduceSum(t, stream);
      });
      b.native.launchGraph(graph, stream); // warm-up
      b.synchronize(stream);
      const graphUs = (b.time(() => b.native.launchGraph(graph, stream), stream, 2000) * 1000) / reps;
      // queued one by one behind a hold, so launches overlap the device work: device time per call
      const eagerUs = (b.time(() => {
        for (let i = 0; i < reps; i++) c.allReduceSum(t, stream);
      }, stream, 5000) * 1000) / reps;
      b.synchronize(stream);
      report.allReduce.push({ rows, hidden: 7168, bytes: rows * 7168 * 4, graphUs: Number(graphUs.toFixed(2)), eagerUs: Number(eagerUs.toFixed(2)) });
      b.native.freeGraph(graph);
      b.free(t);
    }
    return report.allReduce.map((a) => `T=${a.rows} ${a.graphUs} us`).join(', ');
  } finally {
    c.close();
  }
});

const json = JSON.stringify(report, null, 2);
console.log(json);
if (process.env.OUT) writeFileSync(join(process.env.OUT, 'nccl-check.json'), json);
process.exit(report.checks.every((c) => c.ok) ? 0 : 1);
