// Throughput of the golden reference (@kdtree/reference): tokens/s of prefill and decode on a
// synthetic preset, and GFLOP/s of its core matmul against numpy's f32 matmul (OpenBLAS) on the
// same shapes in the same run.
//   node tools/bench/reference-forward.mjs [--preset small] [--reps 3]
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { matmulT, modelFromWeights, parseModelConfig, presetConfigJson, randomWeights } from '@kdtree/reference';
import { machine, median, run, table } from './bench-util.mjs';

const { values } = parseArgs({ options: { preset: { type: 'string', default: 'small' }, reps: { type: 'string', default: '3' } } });
const reps = Number(values.reps);
const config = parseModelConfig(presetConfigJson(values.preset));
const model = await modelFromWeights(config, randomWeights(config, 1));
const prompt = Array.from({ length: 64 }, (_, i) => (i * 37 + 1) % config.vocabSize);

const timeIt = (fn) => {
  const t = performance.now();
  fn();
  return (performance.now() - t) / 1000;
};
model.forward(prompt.slice(0, 8), model.newCache(8)); // warm-up (JIT)
const prefill = [];
const decode = [];
for (let r = 0; r < reps; r++) {
  const cache = model.newCache(prompt.length + 32);
  prefill.push(timeIt(() => model.forward(prompt, cache)));
  decode.push(timeIt(() => {
    for (let i = 0; i < 32; i++) model.forward([(i * 13) % config.vocabSize], cache);
  }) / 32);
}

// Core matmul: x[M, K] . w[N, K]^T at the preset's dense-MLP shape (prefill and decode rows) and
// a square 1024 case.
const shapes = [[64, config.intermediateSize, config.hiddenSize], [1, config.intermediateSize, config.hiddenSize], [64, 1024, 1024]];
const ours = shapes.map(([m, n, k]) => {
  const x = Float32Array.from({ length: m * k }, (_, i) => Math.sin(i));
  const w = Float32Array.from({ length: n * k }, (_, i) => Math.cos(i));
  matmulT(x, m, k, w, n);
  return median(Array.from({ length: reps }, () => timeIt(() => matmulT(x, m, k, w, n))));
});
const env = { ...process.env };
delete env.OPENBLAS_CORETYPE; // see /work/.library/env: these slow a current numpy
delete env.OPENBLAS_L2_SIZE;
const py = run('python3', [fileURLToPath(new URL('./reference_numpy.py', import.meta.url)), String(reps), ...shapes.map((s) => s.join('x'))], { env });
const numpy = py.stdout.trim().split('\n').map((l) => Number(l.split(' ')[3]));
const blas = run('python3', ['-c', 'import numpy; c = numpy.show_config(mode="dicts"); print(numpy.__version__, c["Build Dependencies"]["blas"]["name"])'], { env }).stdout.trim();

console.log(`@kdtree/reference forward on preset '${values.preset}' (${config.numLayers} layers, hidden ${config.hiddenSize}, ${config.nRoutedExperts} experts top-${config.numExpertsPerTok}); median of ${reps}`);
console.log(`machine: ${machine()}; numpy ${blas}`);
console.log(table(['phase', 'tokens', 'seconds', 'tokens/s'], [
  ['prefill', prompt.length, median(prefill).toFixed(3), (prompt.length / median(prefill)).toFixed(1)],
  ['decode (per token, KV cache)', 1, median(decode).toFixed(4), (1 / median(decode)).toFixed(1)],
]));
console.log('');
console.log(table(['matmul x[M,K] . w[N,K]^T', 'reference GFLOP/s', 'numpy GFLOP/s', 'reference / numpy'], shapes.map(([m, n, k], i) => {
  const flops = 2 * m * n * k;
  return [`M=${m} N=${n} K=${k}`, (flops / ours[i] / 1e9).toFixed(2), (flops / numpy[i] / 1e9).toFixed(2), (numpy[i] / ours[i]).toFixed(3)];
})));
