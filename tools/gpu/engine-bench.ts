/**
 * The engine's benchmark on one GPU (bundled into .gpu/engine-bench.mjs; docs/benchmarks/engine.md):
 * a model with Kimi K2's real dimensions and quantization scheme (hidden 7168, 64 heads, q_lora
 * 1536, kv_lora 512, 384 experts top-8 INT4 g32 + a shared expert, attention bf16, vocab 163840),
 * `KDTREE_BENCH_LAYERS` layers (default 4: one dense, the rest MoE), seeded weights made in memory.
 * In one run:
 *   - the copy bandwidth, and the floor: the bytes a decode step must read / that bandwidth
 *   - greedy decode tokens/s, and where a step's device time goes (attention, MoE, MLP, lm_head)
 *     against the host's share (the wall time of a step beyond its device time)
 *   - the verify cost curve: a tree step of 1..256 nodes against a decode step
 *   - chain and DDTree (fixed budgets 4..64 and auto) with a draft model and with ngram
 *   - prefill of a 2048-token prompt
 *   - a DFlash drafter of Kimi K2.5-DFlash's shape (6 layers, hidden 7168, 64 / 8 heads of 128,
 *     intermediate 18432, block 8, 6 tapped layers; seeded weights): its step (commit of the
 *     accepted rows + one draft) against the target's verify at the same tree sizes, measured on
 *     this model and extrapolated to Kimi K2's 61 layers from a 2-layer model's curve (the
 *     difference is two layers' cost: one MoE layer = half of it)
 *   - the same model with 64 experts (what fits transformers' bf16 experts on one GPU)
 * Speculative rows are the median of 3 generations after one that captures their graphs.
 * Writes $OUT/engine-bench.json. Transformers' figures come from hf_peer.py in the same run.
 */
import { createHash } from 'node:crypto';
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createBackend, type KdtreeBackend } from '@kdtree/cuda';
import { createEngine, SeededSource, weightBytes, type Engine, type GenerateOptions, type GenerationResult } from '@kdtree/engine';
import { dflashConfigJson, lcgTokens, parseDflashConfig, presetConfigJson } from '@kdtree/reference';

const here = dirname(fileURLToPath(import.meta.url));
// KDTREE_BENCH_SMOKE=1: the same run on the cpu twin at toy sizes, to check the script itself
const smoke = process.env.KDTREE_BENCH_SMOKE === '1';
const b = smoke ? createBackend({ backend: 'cpu', searchPaths: [here], onlySearchPaths: true }) : createBackend({ backend: 'cuda', searchPaths: [here], onlySearchPaths: true });
const layers = Number(process.env.KDTREE_BENCH_LAYERS ?? 4);
const report: Record<string, unknown> = { device: b.info(), layers };
const log = (s: string) => console.log(s);

export function k2Config(numLayers: number, experts: number, hidden = 7168): Record<string, unknown> {
  if (smoke) {
    return {
      ...presetConfigJson('small'), num_hidden_layers: numLayers, n_routed_experts: Math.min(experts, 16), num_experts_per_tok: 4,
      hidden_size: hidden === 7168 ? 256 : 128, vocab_size: 4096, max_position_embeddings: 8192,
    };
  }
  return {
    architectures: ['DeepseekV3ForCausalLM'], model_type: 'kimi_k2',
    vocab_size: 163840, hidden_size: hidden, intermediate_size: 18432, moe_intermediate_size: 2048,
    num_hidden_layers: numLayers, first_k_dense_replace: 1, num_attention_heads: 64, num_key_value_heads: 64,
    q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128,
    n_routed_experts: experts, num_experts_per_tok: 8, n_shared_experts: 1, n_group: 1, topk_group: 1,
    norm_topk_prob: true, routed_scaling_factor: 2.827, scoring_func: 'sigmoid', topk_method: 'noaux_tc', hidden_act: 'silu',
    rms_norm_eps: 1e-5, rope_theta: 50000, max_position_embeddings: 262144,
    rope_scaling: { type: 'yarn', factor: 64, original_max_position_embeddings: 4096, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1 },
    tie_word_embeddings: false, eos_token_id: null,
  };
}

/** A small draft of the same vocabulary: 2 layers (dense + 16-expert MoE), hidden 1024. */
function draftConfig(): Record<string, unknown> {
  if (smoke) return { ...k2Config(2, 16, 128), num_experts_per_tok: 4 };
  return {
    ...k2Config(2, 16, 1024), intermediate_size: 2816, moe_intermediate_size: 256, num_attention_heads: 8, num_key_value_heads: 8,
    q_lora_rank: 256, kv_lora_rank: 128, qk_nope_head_dim: 64, qk_rope_head_dim: 32, v_head_dim: 64, num_experts_per_tok: 4,
  };
}

/**
 * Device-to-device copy of 1 GiB: bytes read + written per second, the fastest of 10 after a
 * warm-up. The floor is a limit, so it takes the device's best (a median of 5 moved ~6% between runs).
 */
function copyBandwidth(k: KdtreeBackend): number {
  const bytes = smoke ? 2 ** 24 : 2 ** 30;
  const src = k.native.alloc(bytes);
  const dst = k.native.alloc(bytes);
  try {
    const times: number[] = [];
    for (let i = 0; i < 11; i++) times.push(k.time(() => k.native.copy({ dst, src, bytes })));
    const ms = Math.min(...times.slice(1));
    return (2 * bytes) / (ms / 1000);
  } finally {
    k.native.free(src);
    k.native.free(dst);
  }
}

/** The bytes one decode step reads: every weight but the embedding table and the unrouted experts, plus one embedding row and the KV cache so far. */
function decodeBytes(source: SeededSource, contextTokens: number): number {
  const c = source.config;
  const parts = weightBytes(source, c);
  const total = parts.reduce((s, p) => s + p.bytes, 0);
  const embed = c.vocabSize * c.hiddenSize * 2;
  const perExpert = 3 * (c.hiddenSize * c.moeIntermediateSize * 0.5 + (c.hiddenSize * c.moeIntermediateSize * 2) / 32);
  const moeLayers = c.numLayers - c.firstKDenseReplace;
  const experts = moeLayers * c.nRoutedExperts * perExpert;
  const cache = c.numLayers * contextTokens * (c.kvLoraRank + c.qkRopeDim) * 2;
  return total - embed + c.hiddenSize * 2 - experts + moeLayers * c.numExpertsPerTok * perExpert + cache;
}

async function median<T>(runs: number, fn: () => Promise<T>, key: (t: T) => number): Promise<T> {
  const out: T[] = [];
  for (let i = 0; i < runs; i++) out.push(await fn());
  return out.sort((x, y) => key(x) - key(y))[Math.floor(runs / 2)];
}

/**
 * A mode's generation as a server sees it: one generation first captures the graphs the mode
 * needs (tree and chain sizes, catch-up counts, slot bounds), then the median of 3 by tokens/s.
 */
async function warmMedian(run: () => Promise<GenerationResult>): Promise<GenerationResult> {
  await run();
  return median(3, run, (r) => r.stats.tokensPerSecond);
}

/** Device ms of a decode step by stage, summed over layers. */
function stages(profile: { part: string; ms: number }[]): Record<string, number> {
  const sum = (re: RegExp) => profile.filter((p) => re.test(p.part)).reduce((s, p) => s + p.ms, 0);
  return {
    qProjection: sum(/^q \d/), kvProjection: sum(/^kv \d/), mlaAttention: sum(/^mla \d/), oProjection: sum(/^attention \d/),
    router: sum(/^router \d/), routedExperts: sum(/^routed \d/), sharedExperts: sum(/^moe \d/), denseMlp: sum(/^mlp \d/), lmHead: sum(/^lm_head/), embedding: sum(/^embedding/),
    device: profile.reduce((s, p) => s + p.ms, 0),
  };
}

async function benchModel(experts: number, full: boolean, cacheTokens = 4096, activations?: 'bf16' | 'f32'): Promise<Record<string, unknown>> {
  const json = k2Config(layers, experts);
  const source = new SeededSource(json, { seed: 7 });
  const t0 = performance.now();
  const engine: Engine = await createEngine({ model: source, backend: b, cacheTokens, activations, maxBudget: full ? 256 : 64 });
  const loadS = (performance.now() - t0) / 1000;
  const out: Record<string, unknown> = { experts, activations: activations ?? 'default', cacheTokens, loadSeconds: loadS, memory: engine.memory };
  log(`\n== ${layers} layers, ${experts} experts, ${activations ?? 'default'} activations, ${cacheTokens}-token cache: loaded in ${loadS.toFixed(1)} s (${(engine.memory.total / 2 ** 30).toFixed(1)} GiB)`);
  try {
    const V = source.config.vocabSize;
    const prompt = lcgTokens(64, 1, V);
    const maxNew = 128;
    const greedy = await median(3, () => engine.complete(prompt, { maxNew, eos: [] }), (r) => r.stats.tokensPerSecond);
    const bytes = decodeBytes(source, prompt.length + maxNew / 2);
    const stepMs = 1000 / greedy.stats.tokensPerSecond;
    // the tokens' fingerprint: builds and kernel forms that keep the bits decode the same tokens
    const tokensSha256 = createHash('sha256').update(greedy.tokens.join(',')).digest('hex').slice(0, 16);
    // the tokens themselves: a drafter's steps (ngram's matches) can then be replayed off the GPU
    out.greedy = { tokensPerSecond: greedy.stats.tokensPerSecond, stepMs, bytesPerToken: bytes, tokensSha256, prompt, tokens: greedy.tokens };
    log(`greedy: ${greedy.stats.tokensPerSecond.toFixed(1)} tokens/s (${stepMs.toFixed(3)} ms a token), ${(bytes / 1e9).toFixed(3)} GB read a token; tokens ${tokensSha256}`);
    const profile = await engine.profileDecode(prompt);
    const st = stages(profile);
    out.breakdown = { ...st, hostMs: Math.max(0, stepMs - st.device), parts: profile };
    log(`step (cache ${cacheTokens}): device ${st.device.toFixed(3)} ms = ${Object.entries(st).filter(([k]) => k !== 'device').map(([k, v]) => `${k} ${v.toFixed(3)}`).join(', ')}; host and sync ${Math.max(0, stepMs - st.device).toFixed(3)} ms`);
    if (!full) return out;
    const curve = engine.measureCosts(4);
    out.verifyCurve = { decodeMs: curve.decodeMs, verifyMs: Object.fromEntries(curve.verifyMs) };
    log(`verify curve (depth 4): decode ${curve.decodeMs.toFixed(3)} ms; ${[...curve.verifyMs].map(([k, v]) => `${k + 1} nodes ${v.toFixed(3)} ms`).join(', ')}`);
    const draft = await engine.modelDrafter(new SeededSource(draftConfig(), { seed: 8 }), 'model:seeded 2-layer draft (hidden 1024)');
    const modes: [string, Partial<GenerateOptions>][] = [
      ['chain, model, 4', { spec: 'chain', drafter: draft, budget: 4, depth: 4 }],
      ...[4, 8, 16, 32, 64].map((budget): [string, Partial<GenerateOptions>] => [`ddtree, model, B ${budget}`, { spec: 'ddtree', drafter: draft, budget, depth: 4 }]),
      ['ddtree, model, auto', { spec: 'ddtree', drafter: draft, budget: 'auto', depth: 4 }],
      ['chain, ngram, 4', { spec: 'chain', drafter: 'ngram', budget: 4, depth: 4 }],
      ...[4, 6, 8, 32].map((budget): [string, Partial<GenerateOptions>] => [`ddtree, ngram, B ${budget}`, { spec: 'ddtree', drafter: 'ngram', budget, depth: 4 }]),
      ['ddtree, ngram, auto', { spec: 'ddtree', drafter: 'ngram', budget: 'auto', depth: 4 }],
    ];
    const rows: Record<string, unknown>[] = [];
    for (const [label, options] of modes) {
      const r = await warmMedian(() => engine.complete(prompt, { maxNew, eos: [], ...options }));
      const exact = r.tokens.join() === greedy.tokens.join();
      rows.push({ mode: label, tokensPerSecond: r.stats.tokensPerSecond, meanAcceptedLength: r.stats.meanAcceptedLength, targetForwards: r.stats.targetForwards, exact });
      log(`${label}: ${r.stats.tokensPerSecond.toFixed(1)} tokens/s, ${r.stats.meanAcceptedLength.toFixed(2)} tokens a step, ${exact ? 'exact' : 'DIFFERENT FROM GREEDY'}`);
    }
    out.speculative = rows;
    // how ngram's steps go at budget 8 and under auto, step by step (traced, so untimed): '.' a
    // plain step (a wait, no match, or no tree worth it), 'B/a' a tree of B nodes that accepted a
    const ngramSteps: Record<string, string> = {};
    for (const budget of [8, 'auto'] as const) {
      const t = await engine.complete(prompt, { maxNew, eos: [], spec: 'ddtree', drafter: 'ngram', budget, depth: 4, trace: true });
      ngramSteps[String(budget)] = t.steps.map((s) => (s.treeSize === 1 ? '.' : `${s.budget}/${s.accepted}`)).join(' ');
      log(`ddtree, ngram, ${budget === 'auto' ? 'auto' : `B ${budget}`} (traced): ${ngramSteps[String(budget)]}`);
    }
    out.ngramSteps = ngramSteps;
    draft.dispose();
    if (process.env.KDTREE_BENCH_DFLASH !== '0') out.dflash = await benchDflash(engine, source, prompt, greedy.tokens, maxNew);
    out.greedyTokensRepeat = new Set(greedy.tokens.slice(64)).size;
    const long = lcgTokens(2048, 3, V);
    const prefill = await median(3, () => engine.complete(long, { maxNew: 1, eos: [] }), (r) => r.stats.prefillMs);
    out.prefill2048Ms = prefill.stats.prefillMs;
    log(`prefill of 2048 tokens: ${prefill.stats.prefillMs.toFixed(1)} ms`);
  } finally {
    await engine.dispose();
  }
  return out;
}

/**
 * A seeded drafter of Kimi K2.5-DFlash's shape on `engine`'s target. The real one taps 6 of 61
 * layers; this target has fewer, so some are tapped twice (the same fc of 6 x 7168 inputs and the
 * same work). Its weights are random: acceptance means nothing here, only the cost.
 */
async function benchDflash(engine: Engine, source: SeededSource, prompt: number[], greedyTokens: number[], maxNew: number): Promise<Record<string, unknown>> {
  const L = source.config.numLayers;
  const taps = Array.from({ length: 6 }, (_, i) => Math.round((i * (L - 1)) / 5));
  const shape = smoke ? { layers: 2, heads: 4, kvHeads: 2, headDim: 32, intermediate: 512 } : { layers: 6, heads: 64, kvHeads: 8, headDim: 128, intermediate: 18432 };
  const config = parseDflashConfig(dflashConfigJson(source.config, { ...shape, blockSize: 8, targetLayerIds: taps }), 'K2.5-DFlash shape');
  const t0 = performance.now();
  // a seeded source makes any tensor by name: the drafter's are seeded like the target's
  const drafter = await engine.dflashDrafter(config, new SeededSource(source.configJson, { seed: 9, quant: 'none' }), 'dflash:seeded K2.5-DFlash shape');
  const out: Record<string, unknown> = { config: { ...shape, blockSize: 8, targetLayerIds: taps }, loadSeconds: (performance.now() - t0) / 1000 };
  try {
    const H = config.hiddenSize;
    const V = config.vocabSize;
    const depth = config.blockSize - 1;
    const logits = b.zeros('f32', [depth, V]);
    const tapsOf = (rows: number) => taps.map((_, j) => b.fromArray('f32', [rows, H], Float32Array.from({ length: rows * H }, (_, i) => Math.sin(0.37 * i + j))));
    const context = tapsOf(prompt.length);
    drafter.begin();
    drafter.commit(context, prompt.length);
    const step: Record<string, unknown>[] = [];
    // 64: a batch of the rows auto's plain decode steps hold back (one commit each, up to 512)
    for (const rows of [1, 2, 4, 8, 64]) {
      const hidden = tapsOf(rows);
      const commitMs: number[] = [];
      const draftMs: number[] = [];
      const wallMs: number[] = [];
      for (let rep = 0; rep < 6; rep++) {
        const w0 = performance.now();
        const c = b.time(() => drafter.commit(hidden, rows));
        const tokens = new Array<number>(drafter.contextLength + 1).fill(1);
        const d = b.time(() => drafter.draft({ tokens, depth, out: logits }));
        b.synchronize();
        // the first call captures the graphs
        if (rep > 0) commitMs.push(c), draftMs.push(d), wallMs.push(performance.now() - w0);
      }
      const med = (x: number[]) => x.sort((p, q) => p - q)[Math.floor(x.length / 2)];
      step.push({ acceptedRows: rows, commitMs: med(commitMs), draftMs: med(draftMs), wallMs: med(wallMs) });
      b.free(...hidden);
    }
    b.free(...context, logits);
    out.step = step;
    log(`DFlash (K2.5 shape, loaded in ${(out.loadSeconds as number).toFixed(1)} s): ${step.map((s) => `commit ${s.acceptedRows} rows ${(s.commitMs as number).toFixed(3)} ms + draft ${(s.draftMs as number).toFixed(3)} ms (wall ${(s.wallMs as number).toFixed(3)})`).join('; ')}`);
    const curve = engine.measureCosts(depth);
    out.verifyCurve = { decodeMs: curve.decodeMs, verifyMs: Object.fromEntries(curve.verifyMs) };
    const rows: Record<string, unknown>[] = [];
    for (const [label, options] of [
      ['chain, dflash (random), 7', { spec: 'chain', budget: 7 }],
      ['ddtree, dflash (random), B 16', { spec: 'ddtree', budget: 16 }],
      ['ddtree, dflash (random), auto', { spec: 'ddtree', budget: 'auto' }],
    ] as [string, Partial<GenerateOptions>][]) {
      const r = await warmMedian(() => engine.complete(prompt, { maxNew, eos: [], drafter, depth, ...options }));
      const exact = r.tokens.join() === greedyTokens.join();
      rows.push({ mode: label, tokensPerSecond: r.stats.tokensPerSecond, meanAcceptedLength: r.stats.meanAcceptedLength, targetForwards: r.stats.targetForwards, exact });
      log(`${label}: ${r.stats.tokensPerSecond.toFixed(1)} tokens/s, ${r.stats.meanAcceptedLength.toFixed(2)} tokens a step, ${exact ? 'exact' : 'DIFFERENT FROM GREEDY'}`);
    }
    out.generation = rows;
  } finally {
    drafter.dispose();
  }
  return out;
}

/** The verify curve of a `numLayers`-layer model (one dense layer, the rest MoE) at `depth`. */
async function verifyCurveOf(numLayers: number, depth: number): Promise<Record<string, unknown>> {
  const engine = await createEngine({ model: new SeededSource(k2Config(numLayers, 384), { seed: 7 }), backend: b, cacheTokens: 4096, maxBudget: 256 });
  try {
    const curve = engine.measureCosts(depth);
    return { layers: numLayers, decodeMs: curve.decodeMs, verifyMs: Object.fromEntries(curve.verifyMs) };
  } finally {
    await engine.dispose();
  }
}

const bandwidth = copyBandwidth(b);
report.copyBandwidth = bandwidth;
log(`copy bandwidth: ${(bandwidth / 1e12).toFixed(3)} TB/s (bytes read + written)`);
const models: Record<string, unknown>[] = [];
for (const experts of (process.env.KDTREE_BENCH_EXPERTS ?? '384,64').split(',').map(Number)) {
  // KDTREE_BENCH_FULL=1 runs the speculative modes and prefill at every expert count, =0 at none
  const full = process.env.KDTREE_BENCH_FULL === '1' || (experts === 384 && process.env.KDTREE_BENCH_FULL !== '0');
  const m = await benchModel(experts, full, 4096);
  // KDTREE_BENCH_VARIANTS=0 leaves out the 512-slot cache and f32 activations
  if (experts === 384 && !smoke && process.env.KDTREE_BENCH_VARIANTS !== '0') {
    m.smallCache = await benchModel(experts, false, 512);
    // the same model with f32 activations into the GEMMs (three bf16 planes of x), in the same run
    m.f32Activations = await benchModel(experts, false, 4096, 'f32');
  }
  const g = m.greedy as { bytesPerToken: number; tokensPerSecond: number };
  const floorMs = (g.bytesPerToken / bandwidth) * 1000;
  m.floorMs = floorMs;
  m.fractionOfFloor = floorMs / (1000 / g.tokensPerSecond);
  log(`floor: ${floorMs.toFixed(3)} ms a token at the copy bandwidth; greedy runs at ${(100 * (m.fractionOfFloor as number)).toFixed(1)}% of it`);
  models.push(m);
}
report.models = models;
const full = models.find((m) => m.experts === 384);
if (full?.dflash !== undefined) {
  // verify(61 layers) = verify(L) + (61 - L) x one MoE layer, one MoE layer = (verify(L) - verify(L - 2)) / 2
  const small = await verifyCurveOf(layers - 2, 7);
  const dflash = full.dflash as { verifyCurve: { verifyMs: Record<string, number> }; step: { acceptedRows: number; commitMs: number; draftMs: number }[] };
  const big = dflash.verifyCurve.verifyMs;
  const k2 = Object.fromEntries(Object.entries(big).map(([n, ms]) => [n, ms + ((61 - layers) * (ms - (small.verifyMs as Record<string, number>)[n])) / 2]));
  dflash.verifyCurve = { ...dflash.verifyCurve, ...{ smallModel: small, kimiK2Extrapolated: k2 } };
  const stepMs = (rows: number) => {
    const s = dflash.step.find((x) => x.acceptedRows === rows)!;
    return s.commitMs + s.draftMs;
  };
  log(`DFlash step / verify, budget B (B + 1 nodes), 4 accepted rows: ${Object.keys(big).filter((n) => [4, 8, 16, 32, 64].includes(Number(n))).map((n) => `B ${n}: ${(100 * stepMs(4) / big[n]).toFixed(1)}% of this model's verify (${big[n].toFixed(3)} ms), ${(100 * stepMs(4) / k2[n]).toFixed(1)}% of Kimi K2's 61 layers (${k2[n].toFixed(2)} ms)`).join('; ')}`);
}
if (process.env.OUT) {
  mkdirSync(process.env.OUT, { recursive: true });
  writeFileSync(join(process.env.OUT, 'engine-bench.json'), `${JSON.stringify(report, null, 1)}\n`);
}
