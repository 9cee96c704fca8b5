import { existsSync, readdirSync, statSync } from 'node:fs';
import { rename, rm, stat } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { removeStaleTemps, tempPathFor } from '@kdtree/format';
import { PRESETS } from '@kdtree/quant';
import { MODEL_PRESET_NAMES, parseModelConfig, perturbWeights, presetConfigJson, randomWeights, walkDflashConfig, walkDflashWeights, walkStructure, walkWeights, WALK_TENSORS, weightSpecs, writeDflashDirectory, writeSyntheticModel } from '@kdtree/reference';
import { MIN_SYNTHETIC_VOCAB, SPECIAL_SLOTS, syntheticTokenizerFiles, Tokenizer, tokenizerMetadata, TOKENIZER_METADATA_KEY, type TokenizerMetadata } from '@kdtree/tokenizer';
import { parseChoice, parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { CLI_VERSION, jsonReport, type CommandIO } from '../io.js';
import { checkOutputName, refuseOverwritingInputs } from '../output-paths.js';
import { formatBytes, formatDuration } from '../output.js';

/** The seed when none is given (the demo's). */
export const DEFAULT_SEED = 1;
/** The built DFlash drafter's block when --dflash-block is not given (Kimi K2.5-DFlash's). */
export const DEFAULT_DFLASH_BLOCK = 8;
const STRUCTURES = ['random', 'walk'] as const;

export const genModelSpec: CommandSpec = {
  name: 'gen-model',
  summary: "Generate a synthetic DeepSeek-V3 / Kimi K2-shaped model bundle with seeded weights, its config, golden greedy tokens and logits for a fixed prompt (INT4 bundles: golden on the dequantized weights), and a Kimi-style tokenizer in its metadata where the vocabulary holds one (k2-mini: BPE ranks trained on a bundled corpus; small: the 256 byte tokens only; tiny, tp8: none). With --draft, also a correlated draft model (target = draft + noise) for speculative decoding. With --structure walk, a target whose continuation a drafter can predict (each token's embedding carries a code of its place on a walk that lm_head steps along; the random layers decide each step), and with --dflash a DFlash drafter built to predict it.",
  usage: 'kdtree gen-model --preset tiny|small|k2-mini|tp8 -o OUT.kdtr [--seed S] [--quant seed|kimi-k2] [--structure random|walk] [--draft DRAFT.kdtr [--draft-noise X]] [--dflash DIR [--dflash-block N]] [--json] [--quiet]',
  help: [
    `--preset NAME         ${MODEL_PRESET_NAMES.join(', ')} (tiny: CI-fast; k2-mini: Kimi K2's ratios, shrunk; tp8: splits over up to 8 tensor-parallel ranks, INT4 included)`,
    `--seed S              integer seed in [0, 2^32); the same seed gives the same weights on every machine (default ${DEFAULT_SEED})`,
    '-o, --output FILE     the model bundle to write',
    '--quant PRESET        quantize to INT4 with a selection preset: kimi-k2 (routed experts) or seed (every MLP)',
    '--draft FILE          also write a draft model (quantized like the target); the target becomes draft + noise',
    '--draft-noise X       relative noise between draft and target (default 0.05)',
    '--structure KIND      random (default): seeded random weights; walk: the same, plus a learnable walk (docs/reference.md)',
    '--dflash DIR          with --structure walk: also write a DFlash drafter directory (config.json + model.safetensors) built to predict the target',
    `--dflash-block N      the drafter's block size: it drafts depths 1..N-1 in one forward (default ${DEFAULT_DFLASH_BLOCK}, 2..16)`,
    '--json                print a JSON summary (schema "kdtree.gen-model/1")',
    '-q, --quiet           no progress lines on stderr',
  ],
  options: {
    preset: { type: 'string' },
    seed: { type: 'string' },
    output: { type: 'string', short: 'o' },
    quant: { type: 'string' },
    draft: { type: 'string' },
    'draft-noise': { type: 'string' },
    structure: { type: 'string' },
    dflash: { type: 'string' },
    'dflash-block': { type: 'string' },
    json: { type: 'boolean' },
    quiet: { type: 'boolean', short: 'q' },
  },
  positionals: [0, 0],
};

/** What gen-model says about the tokenizer it wrote (--json: `tokenizer`). */
interface TokenizerSummary {
  vocab_size: number;
  /** BPE ranks: the 256 byte tokens and the merges trained on the corpus. */
  ranks: number;
  merges: number;
  special_tokens: number;
}

/**
 * The tokenizer a synthetic model of `vocabSize` tokens carries (Kimi's layout: BPE ranks, then
 * 256 special slots), or none where the vocabulary is too small for the special slots.
 */
export function syntheticModelTokenizer(vocabSize: number): { metadata: TokenizerMetadata; summary: TokenizerSummary } | undefined {
  if (vocabSize < MIN_SYNTHETIC_VOCAB) return undefined;
  const files = syntheticTokenizerFiles({ vocabSize });
  const tokenizer = new Tokenizer(files, { source: `synthetic tokenizer (${vocabSize})` });
  const summary = { vocab_size: tokenizer.vocabSize, ranks: tokenizer.numBaseTokens, merges: tokenizer.numBaseTokens - 256, special_tokens: tokenizer.specialTokens.length };
  tokenizer.free();
  return { metadata: tokenizerMetadata(files), summary };
}

function tokenizerLine(vocabSize: number, s: TokenizerSummary | undefined): string {
  if (s === undefined) return `none (a vocabulary of ${vocabSize} has no room for 256 byte tokens and Kimi's ${SPECIAL_SLOTS} special slots; run --text, chat and serve need one)`;
  const ranks = s.merges > 0 ? `${s.ranks} BPE ranks (256 bytes + ${s.merges} merges trained on the bundled corpus)` : `the 256 byte tokens only (no room for merges in ${vocabSize})`;
  return `${ranks} + ${s.special_tokens} special tokens, Kimi's chat template (metadata.${TOKENIZER_METADATA_KEY})`;
}

export async function runGenModel(p: Parsed, io: CommandIO): Promise<number> {
  const preset = parseChoice(p.values.preset as string | undefined, '--preset', MODEL_PRESET_NAMES);
  if (preset === undefined) throw new CliUsageError(`gen-model: --preset is required (${MODEL_PRESET_NAMES.join(', ')})`, 'gen-model');
  const seed = parseIntArg(p.values.seed as string | undefined, '--seed', { min: 0, max: 2 ** 32 - 1 }) ?? DEFAULT_SEED;
  const output = p.values.output as string | undefined;
  if (!output) throw new CliUsageError('gen-model: -o OUT.kdtr is required', 'gen-model');
  checkOutputName('gen-model', '-o', output, 'kdtr');
  const quant = parseChoice(p.values.quant as string | undefined, '--quant', PRESETS);
  const draftPath = p.values.draft as string | undefined;
  const noiseText = p.values['draft-noise'] as string | undefined;
  if (noiseText !== undefined && draftPath === undefined) throw new CliUsageError('gen-model: --draft-noise needs --draft', 'gen-model');
  if (draftPath !== undefined) checkOutputName('gen-model', '--draft', draftPath, 'kdtr');
  await refuseOverwritingInputs('gen-model', [{ flag: '-o', path: output }, ...(draftPath !== undefined ? [{ flag: '--draft', path: draftPath }] : [])], []);
  const noise = noiseText === undefined ? 0.05 : Number(noiseText);
  if (!(noise >= 0 && Number.isFinite(noise))) throw new CliUsageError(`--draft-noise: expected a non-negative number, got '${noiseText}'`, 'gen-model');
  const structure = parseChoice(p.values.structure as string | undefined, '--structure', STRUCTURES) ?? 'random';
  const dflashDir = p.values.dflash as string | undefined;
  const dflashBlock = parseIntArg(p.values['dflash-block'] as string | undefined, '--dflash-block', { min: 2, max: 16 });
  if (dflashBlock !== undefined && dflashDir === undefined) throw new CliUsageError('gen-model: --dflash-block needs --dflash', 'gen-model');
  if (dflashDir !== undefined && structure !== 'walk') {
    throw new CliUsageError('gen-model: --dflash needs --structure walk (no drafter can predict a target of random weights: its next token depends on every weight)', 'gen-model');
  }
  // checked before anything is written (the outputs are written under temporary names beside their
  // own: an error then would name those): each bundle output a regular file or absent, in a directory
  for (const [flag, path] of [['-o', output], ['--draft', draftPath]] as const) {
    if (path === undefined) continue;
    const info = await stat(path).catch(() => undefined);
    if (info !== undefined && !info.isFile()) throw new CliUsageError(`gen-model: ${flag} ${path} is ${info.isDirectory() ? 'a directory' : 'not a regular file'}; give the path of a bundle file`, 'gen-model');
    if (!(await stat(dirname(resolve(path))).then((d) => d.isDirectory(), () => false))) throw new CliError(`${path}: cannot create the output: ${dirname(path)} is not a directory`);
  }
  if (dflashDir !== undefined) {
    if (existsSync(dflashDir) && (!statSync(dflashDir).isDirectory() || readdirSync(dflashDir).length > 0)) {
      throw new CliUsageError(`gen-model: --dflash ${dflashDir} already exists${statSync(dflashDir).isDirectory() ? ' and is not empty' : ' (a file)'}; choose a new directory`, 'gen-model');
    }
    for (const [flag, path] of [['-o', output], ['--draft', draftPath]] as const) {
      if (path !== undefined && resolve(path) === resolve(dflashDir)) throw new CliUsageError(`gen-model: --dflash and ${flag} name the same path ${path}`, 'gen-model');
    }
  }
  const quiet = Boolean(p.values.quiet || p.values.json);
  const started = performance.now();
  const log = (step: string) => quiet || io.err(`gen-model: ${step}`);
  const config = parseModelConfig(presetConfigJson(preset), `preset ${preset}`);
  const reference = `@kdtree/cli ${CLI_VERSION}`;
  const tokenizer = syntheticModelTokenizer(config.vocabSize);
  const extraMetadata = tokenizer === undefined ? undefined : { [TOKENIZER_METADATA_KEY]: tokenizer.metadata };
  const walk = structure === 'walk' ? walkStructure(config, seed) : undefined;
  // the walk's weights; a random target's are made by writeSyntheticModel unless a draft needs them
  let target = walk === undefined ? undefined : walkWeights(config, randomWeights(config, seed), walk);
  // The outputs are written under temporary names beside their own and renamed into place together
  // at the end: a run that fails or is stopped leaves every earlier output as it was (never a new
  // draft beside an old target, or a drafter directory half written). The drafter comes first, so
  // a path it cannot be written to fails before the bundles take their time.
  // (AtomicFile's temp names: removeStaleTemps also clears a killed run's)
  for (const path of [output, draftPath, dflashDir]) if (path !== undefined) await removeStaleTemps(path);
  const dflashPending = walk !== undefined && dflashDir !== undefined ? tempPathFor(dflashDir) : undefined;
  const draftPending = draftPath === undefined ? undefined : tempPathFor(draftPath);
  const targetPending = tempPathFor(output);
  let draftGolden;
  let golden;
  try {
    if (dflashPending !== undefined) {
      log(`DFlash drafter -> ${dflashDir}`);
      const drafter = walkDflashConfig(config, walk!, { blockSize: dflashBlock ?? DEFAULT_DFLASH_BLOCK });
      await writeDflashDirectory(dflashPending, drafter.json, walkDflashWeights(drafter.config, walk!));
    }
    if (draftPending !== undefined) {
      const base = target ?? randomWeights(config, seed);
      log(`draft model -> ${draftPath}`);
      draftGolden = await writeSyntheticModel(draftPending, { preset, seed, weights: base, quant, structure, extraMetadata, onProgress: (s) => log(`draft: ${s}`) }, reference);
      target = perturbWeights(base, noise, seed + 1, walk === undefined ? undefined : WALK_TENSORS);
    }
    log(`target model -> ${output}`);
    golden = await writeSyntheticModel(targetPending, { preset, seed, quant, weights: target, structure, extraMetadata, onProgress: log }, reference);
    // the target last: a rename that fails leaves the target as it was
    if (draftPending !== undefined) await rename(draftPending, draftPath!);
    if (dflashPending !== undefined) await rename(dflashPending, dflashDir!);
    await rename(targetPending, output);
  } catch (error) {
    // (a pending path under a file is ENOTDIR to rm too: the error that matters is the first)
    for (const path of [targetPending, draftPending, dflashPending]) if (path !== undefined) await rm(path, { recursive: true, force: true }).catch(() => undefined);
    throw error;
  }
  const params = weightSpecs(config).reduce((s, w) => s + w.shape.reduce((a, b) => a * b, 1), 0);
  const bytes = (await stat(output)).size;
  const seconds = (performance.now() - started) / 1000;
  const dflash = dflashDir === undefined ? null : { output: dflashDir, block_size: dflashBlock ?? DEFAULT_DFLASH_BLOCK };
  const summary = { output, preset, seed, quant: quant ?? null, structure, parameters: params, bytes, golden, tokenizer: tokenizer?.summary ?? null, draft: draftPath ? { output: draftPath, noise, golden: draftGolden } : null, dflash, seconds: Number(seconds.toFixed(3)) };
  if (p.values.json) io.out(jsonReport('kdtree.gen-model/1', summary));
  else {
    io.out(`wrote ${output}: preset ${preset}, seed ${seed}, ${structure === 'walk' ? 'walk-structured, ' : ''}${(params / 1e6).toFixed(2)}M parameters, ${quant ? `INT4 (${quant}), ` : ''}${formatBytes(bytes)}, in ${formatDuration(seconds)}`);
    io.out(`golden: prompt [${golden.prompt.join(', ')}] -> [${golden.tokens.join(', ')}]${golden.float_tokens ? `\n        float weights -> [${golden.float_tokens.join(', ')}]` : ''}`);
    io.out(`tokenizer: ${tokenizerLine(config.vocabSize, tokenizer?.summary)}`);
    if (draftPath) io.out(`draft:  ${draftPath} (target = draft + ${noise} x noise)`);
    if (dflash) io.out(`dflash: ${dflash.output} (block ${dflash.block_size}: drafts ${dflash.block_size - 1} token${dflash.block_size === 2 ? '' : 's'} a forward; run with --drafter dflash:${dflash.output})`);
  }
  return 0;
}
