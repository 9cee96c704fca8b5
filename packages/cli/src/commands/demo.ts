import { existsSync } from 'node:fs';
import { createHash } from 'node:crypto';
import { mkdtemp, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { homedir, tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { BACKEND_KINDS } from '@kdtree/cuda';
import { createEngine, type Engine, type GenerateOptions } from '@kdtree/engine';
import { makeDirectories, openBundle, tempPathFor } from '@kdtree/format';
import { greedyDecode, loadModel, MODEL_PRESET_NAMES, type GoldenRecord } from '@kdtree/reference';
import { MIN_SYNTHETIC_VOCAB, TOKENIZER_METADATA_KEY } from '@kdtree/tokenizer';
import { parseChoice, parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliError } from '../cli-error.js';
import { CLI_VERSION, type CommandIO } from '../io.js';
import { renderTable } from '../output.js';
import { runExport } from './export.js';
import { runGenModel } from './gen-model.js';
import { runImport } from './import.js';
import { runVerify } from './verify.js';

export const demoSpec: CommandSpec = {
  name: 'demo',
  summary:
    'The main job end to end on a small Kimi K2-shaped model (INT4 routed experts, a structure a drafter can learn, a correlated draft model and a DFlash drafter built to predict it): generate them (or reuse them from a cache folder), verify the bundle, decode it with the golden reference, then on the engine on the best backend decode greedily and with chain and DDTree speculation (the DFlash drafter, the draft model, n-grams), check every result against the golden tokens, print one table, and round-trip the weights through the compressed-tensors format of the real Kimi K2.x checkpoints.',
  usage: `kdtree demo [--preset ${MODEL_PRESET_NAMES.join('|')}] [--max-new N] [--backend auto|cpu|cuda] [--cache DIR | --no-cache] [--keep DIR]`,
  help: [
    '--preset NAME         model size (default k2-mini: Kimi K2\'s ratios, shrunk)',
    '--max-new N           tokens each mode generates (default 32)',
    '--backend KIND        auto (default: cuda, else cpu), cuda or cpu',
    '--cache DIR           keep the generated models here and reuse them (default ~/.cache/kdtree/demo)',
    '--no-cache            generate into a temp dir and remove it',
    '--keep DIR            work in DIR and keep every file (the round trip\'s too)',
  ],
  options: { preset: { type: 'string' }, 'max-new': { type: 'string' }, backend: { type: 'string' }, cache: { type: 'string' }, 'no-cache': { type: 'boolean' }, keep: { type: 'string' } },
  positionals: [0, 0],
};

const SEED = 1;
/** The demo's DFlash drafter drafts depths 1..DFLASH_BLOCK - 1 in one forward (Kimi K2.5-DFlash's block). */
const DFLASH_BLOCK = 8;

interface Mode {
  label: string;
  options: Partial<GenerateOptions>;
}

function defaultCache(): string {
  return join(process.env.XDG_CACHE_HOME ?? join(homedir(), '.cache'), 'kdtree', 'demo');
}

interface DemoModels {
  target: string;
  draft: string;
  /** The DFlash drafter directory built for the target. */
  dflash: string;
  reused: boolean;
}

/**
 * The sha256 of each file of a drafter directory, by name: safetensors and config.json carry no
 * checksum of their own, so the demo records these beside the directory it generates and compares
 * them before reusing it.
 */
async function directoryDigest(dir: string): Promise<string> {
  const names = (await readdir(dir)).sort();
  const sums = await Promise.all(names.map(async (name) => `${createHash('sha256').update(await readFile(join(dir, name))).digest('hex')}  ${name}`));
  return `${sums.join('\n')}\n`;
}

/** The cached models when all exist, verify, and were written by this version for this preset; else fresh ones. */
async function demoModels(dir: string, preset: string, io: CommandIO): Promise<DemoModels> {
  const stem = join(dir, `${preset}-seed${SEED}-walk`);
  const models = { target: `${stem}-int4.kdtr`, draft: `${stem}-draft.kdtr`, dflash: `${stem}-dflash${DFLASH_BLOCK}` };
  const dflashSums = `${models.dflash}.sha256`;
  if (existsSync(models.target) && existsSync(models.draft) && existsSync(join(models.dflash, 'model.safetensors'))) {
    try {
      for (const path of [models.target, models.draft]) {
        const b = await openBundle(path);
        try {
          const provenance = b.metadata.provenance as { tool?: string; preset?: string; structure?: string } | undefined;
          if (provenance?.preset !== preset || provenance.structure !== 'walk' || !provenance.tool?.includes(CLI_VERSION)) throw new Error('another version');
          // written before gen-model put a tokenizer into the bundles that have room for one
          const vocab = (b.metadata.config as { vocab_size?: number } | undefined)?.vocab_size ?? 0;
          if (vocab >= MIN_SYNTHETIC_VOCAB && b.metadata[TOKENIZER_METADATA_KEY] === undefined) throw new Error('no tokenizer');
          if (!(await b.verify()).ok) throw new Error('checksum');
        } finally {
          await b.close();
        }
      }
      if ((await directoryDigest(models.dflash)) !== (await readFile(dflashSums, 'utf8'))) throw new Error('drafter checksum');
      return { ...models, reused: true };
    } catch {
      io.err(`demo: the cached models in ${dir} are stale or damaged; generating them again`);
    }
  }
  await makeDirectories(dir);
  // the drafter directory and the oracles of models about to be replaced go with them
  await rm(models.dflash, { recursive: true, force: true });
  await rm(dflashSums, { force: true });
  for (const name of await readdir(dir)) if (name.startsWith(`${basename(models.target)}.greedy-`)) await rm(join(dir, name), { force: true });
  await runGenModel({ values: { preset, seed: String(SEED), output: models.target, quant: 'kimi-k2', structure: 'walk', draft: models.draft, dflash: models.dflash, 'dflash-block': String(DFLASH_BLOCK), quiet: true }, positionals: [] }, io);
  const pending = tempPathFor(dflashSums);
  await writeFile(pending, await directoryDigest(models.dflash));
  await rename(pending, dflashSums);
  return { ...models, reused: false };
}

/** The reference's greedy tokens for `maxNew` (the oracle every mode is checked against), cached beside the model. */
async function oracle(target: string, golden: GoldenRecord, maxNew: number): Promise<number[]> {
  const file = `${target}.greedy-${maxNew}.json`;
  try {
    const cached = JSON.parse(await readFile(file, 'utf8')) as { prompt: number[]; tokens: number[] };
    if (cached.prompt.join() === golden.prompt.join() && cached.tokens.length === maxNew) return cached.tokens;
  } catch {
    // not cached yet
  }
  const { model } = await loadModel(target);
  const { tokens } = greedyDecode(model, golden.prompt, { maxNew, eos: [] });
  const recorded = golden.tokens.slice(0, Math.min(maxNew, golden.tokens.length));
  if (tokens.slice(0, recorded.length).join() !== recorded.join()) throw new CliError(`demo: the reference's greedy tokens [${tokens}] differ from the golden record [${golden.tokens}]`);
  await writeFile(file, JSON.stringify({ prompt: golden.prompt, tokens }));
  return tokens;
}

async function table(engine: Engine, prompt: number[], expected: number[], modes: Mode[]): Promise<{ rows: string[][]; exact: boolean }> {
  const rows: string[][] = [];
  let exact = true;
  let greedyRate = 0;
  // untimed: an engine's first generation pays for its first graphs and the JIT's first pass, which
  // would slow the greedy row that every speedup is measured against
  await engine.complete(prompt, { maxNew: expected.length, eos: [] });
  for (const mode of modes) {
    const r = await engine.complete(prompt, { maxNew: expected.length, eos: [], ...mode.options });
    const same = r.tokens.join() === expected.join();
    exact &&= same;
    const rate = r.stats.tokensPerSecond;
    if (mode.options.spec === undefined) greedyRate = rate;
    rows.push([mode.label, r.stats.backend, rate.toFixed(1), r.stats.meanAcceptedLength.toFixed(2), String(r.stats.targetForwards), greedyRate > 0 ? `${(rate / greedyRate).toFixed(2)}x` : '-', same ? 'yes' : 'NO']);
  }
  return { rows, exact };
}

export async function runDemo(p: Parsed, io: CommandIO): Promise<number> {
  const preset = parseChoice(p.values.preset as string | undefined, '--preset', MODEL_PRESET_NAMES) ?? 'k2-mini';
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 1, max: 256 }) ?? 32;
  const backend = parseChoice(p.values.backend as string | undefined, '--backend', BACKEND_KINDS);
  const keep = p.values.keep as string | undefined;
  const temp = keep === undefined ? await mkdtemp(join(tmpdir(), 'kdtree-demo-')) : undefined;
  const work = keep ?? temp!;
  const cache = keep ?? (p.values['no-cache'] ? work : ((p.values.cache as string | undefined) ?? defaultCache()));
  const section = (title: string) => io.out(`\n== ${title}`);
  try {
    section(`1. a ${preset} Kimi K2-shaped model: INT4 routed experts, a walk a drafter can learn, a draft model (target = draft + noise), a DFlash drafter built for it, golden tokens`);
    const { target, draft, dflash, reused } = await demoModels(cache, preset, io);
    io.out(`${reused ? 'reused' : 'generated'} ${target}, its draft model ${draft} and its DFlash drafter ${dflash}`);

    section('2. every checksum of the bundle');
    await runVerify({ values: { quiet: true }, positionals: [target] }, io);

    section(`3. the golden reference (f32, matches transformers) decodes ${maxNew} tokens greedily: the oracle`);
    const b = await openBundle(target);
    const golden = b.metadata.golden as GoldenRecord;
    await b.close();
    const expected = await oracle(target, golden, maxNew);
    io.out(`prompt [${golden.prompt.join(', ')}] -> [${expected.join(', ')}]  (its first ${golden.tokens.length} are the golden record)`);

    section('4. the engine: greedy, chain and DDTree decoding, each checked against the oracle');
    const engine = await createEngine({ model: target, backend, cacheTokens: golden.prompt.length + maxNew + 80, maxBudget: 64 });
    let result;
    try {
      const model = `model:${draft}`;
      const flash = `dflash:${dflash}`;
      const depth = DFLASH_BLOCK - 1;
      result = await table(engine, golden.prompt, expected, [
        { label: 'greedy', options: {} },
        { label: `chain, dflash, ${depth} nodes`, options: { spec: 'chain', drafter: flash, budget: depth } },
        { label: `ddtree, dflash, budget ${depth}`, options: { spec: 'ddtree', drafter: flash, budget: depth } },
        { label: 'ddtree, dflash, budget 16', options: { spec: 'ddtree', drafter: flash, budget: 16 } },
        { label: 'ddtree, dflash, budget auto', options: { spec: 'ddtree', drafter: flash, budget: 'auto' } },
        // the same engine keeps what auto learnt of the drafter: its second generation shows what auto settled on
        { label: 'ddtree, dflash, budget auto, 2nd run', options: { spec: 'ddtree', drafter: flash, budget: 'auto' } },
        { label: 'chain, draft model, 4 nodes', options: { spec: 'chain', drafter: model, budget: 4, depth: 4 } },
        { label: 'ddtree, draft model, budget 16, depth 4', options: { spec: 'ddtree', drafter: model, budget: 16, depth: 4 } },
        { label: 'ddtree, ngram, budget 8, depth 4', options: { spec: 'ddtree', drafter: 'ngram', budget: 8, depth: 4 } },
      ]);
      io.out(`${engine.device}\n`);
      io.out(renderTable(['mode', 'backend', 'tokens/s', 'mean accepted', 'target forwards', 'speedup', 'exact'], result.rows, new Set([2, 3, 4, 5])));
      if (engine.backend.kind === 'cpu') {
        io.out('\nOn the cpu twin a step is compute-bound: verifying n nodes costs about n decode steps, and the draft model here is');
        io.out('as large as the target, so speculation saves target forwards but not time. On a GPU a step is bound by the');
        io.out('bytes it reads, which a tree verify shares among its nodes (docs/benchmarks/engine.md).');
      }
      io.out('\nBudget auto learns on its first generation how often the drafter\'s nodes are accepted and what a tree');
      io.out('costs; it speculates only where that pays. Its 2nd run on the same engine shows what it settled on.');
      io.out('\nThe target walks: each token\'s embedding carries a code of its place on a walk, lm_head scores the next');
      io.out('place or the one after, and the random layers choose between them. The DFlash drafter is built, not trained:');
      io.out(`one forward drafts the likeliest token at each of ${depth} depths; DDTree spends its budget on the drafter\'s`);
      io.out('alternatives as well (docs/reference.md, "A target a drafter can predict").');
    } finally {
      await engine.dispose();
    }
    if (!result.exact) throw new CliError('demo: a mode decoded other tokens than the reference (see the table)');

    section('5. round trip through compressed-tensors (the format of the real Kimi K2.x checkpoints)');
    const hfDir = join(work, 'compressed-tensors');
    const back = join(work, 'reimported.kdtr');
    await runExport({ values: { output: `${hfDir}/`, format: 'compressed-tensors', quiet: true }, positionals: [target] }, io);
    await runImport({ values: { output: back, quiet: true }, positionals: [hfDir] }, io);
    const again = await createEngine({ model: back, backend, cacheTokens: golden.prompt.length + maxNew + 8 });
    try {
      const tokens = (await again.complete(golden.prompt, { maxNew, eos: [] })).tokens;
      if (tokens.join() !== expected.join()) throw new CliError('demo: the re-imported model decodes differently');
    } finally {
      await again.dispose();
    }
    io.out('the re-imported model decodes the same tokens on the engine');
    io.out(`\ndemo OK${keep ? ` (files in ${keep})` : ''}`);
    return 0;
  } finally {
    if (temp !== undefined) await rm(temp, { recursive: true, force: true });
  }
}
