import { dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend, type DeviceTensor } from '@kdtree/cuda';
import { DeviceModel, ModelSource, Runner } from '@kdtree/engine';
import { parseModelConfig, presetConfigJson, randomWeights, writeSyntheticModel } from '@kdtree/reference';

const here = dirname(fileURLToPath(import.meta.url));
const kind = (process.env.DBG_BACKEND ?? 'cuda') as 'cuda' | 'cpu';
const b = createBackend({ backend: kind, searchPaths: [here], onlySearchPaths: true });
const path = '/tmp/dbg-tiny.kdtr';
const config = parseModelConfig(presetConfigJson('tiny'), 'tiny');
await writeSyntheticModel(path, { preset: 'tiny', seed: 21, weights: randomWeights(config, 21), quant: 'kimi-k2' }, 'dbg');
const prompt = [1, 7, 42, 3, 99, 5, 64, 11];
const source = await ModelSource.open(path);
const model = await DeviceModel.load(b, source, { rows: 64 });
await source.close();
const V = config.vocabSize;
const OPS = new Set(['w4a16Gemm', 'gemm', 'moeGemm', 'mlaAttention', 'embedding', 'rmsNorm', 'rope', 'siluMul', 'add', 'router', 'argmax', 'kvWrite', 'arange', 'copy']);
let limit = Infinity;
let count = 0;
const names: string[] = [];
const native = new Proxy(b.native, {
  get(t, p) {
    const v = (t as any)[p];
    if (typeof v !== 'function') return v;
    return (...args: unknown[]) => {
      if (OPS.has(String(p)) && (args[0] as { stream?: number })?.stream !== undefined) {
        if (count >= limit) return undefined;
        names[count] = String(p);
        count++;
      }
      return v.apply(t, args);
    };
  },
});
const pb = Object.create(b, { native: { value: native } });
(model as any).b = pb;
const r = new Runner(pb, model, 256, 'f32', 64);
const logits = r.own(b.empty('f32', [1, V]));
r.prefill(prompt, 0);
const ws = (model as any).workspace;
const watched: [string, DeviceTensor][] = [...(ws.buffers as Map<string, DeviceTensor>)].map(([k, t]) => [k, t]);
watched.push(['moeAct', ws.moeAct], ['token', r.token], ['L', r.cache.length[0]], ['logits', logits], ['c0', r.cache.c[0]], ['kpe0', r.cache.kpe[0]], ['c1', r.cache.c[1]]);
const save = () => watched.map(([, t]) => b.toArray(t).slice());
const restore = (s: ArrayBufferView[]) => watched.forEach(([, t], i) => b.native.upload(t.buffer, s[i]));
const state0 = save();
// count the ops of a step
limit = Infinity; count = 0;
r.queueAppend(1, r.token, logits, 0); b.synchronize();
const total = count;
console.log('ops in a step:', total, names.slice(0, total).join(' '));
const cs = b.native.createStream();
for (let k = 1; k <= total; k++) {
  restore(state0); b.synchronize();
  limit = k; count = 0;
  r.queueAppend(1, r.token, logits, 0); b.synchronize();
  const direct = save();
  restore(state0); b.synchronize();
  limit = k; count = 0;
  const g = b.capture(cs, () => r.queueAppend(1, r.token, logits, cs));
  b.native.launchGraph(g, cs); b.native.synchronize(cs);
  const graph = save();
  b.native.freeGraph(g);
  const diff = watched.map(([name], i) => { const a = direct[i] as Float32Array, c = graph[i] as Float32Array; let n = 0; for (let j = 0; j < a.length; j++) if (a[j] !== c[j] && !(Number.isNaN(a[j]) && Number.isNaN(c[j]))) n++; return n ? `${name}(${n})` : ''; }).filter(Boolean);
  if (diff.length) { console.log(`first difference after op ${k} (${names[k - 1]}): ${diff.join(', ')}`); break; }
  if (k === total) console.log('no difference');
}
