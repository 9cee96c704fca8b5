import { writeNpy } from '@kdtree/format';
import { ddtreeDecode, greedyDecode, loadModel, modelDrafter, teacherForcedLogits } from '@kdtree/reference';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliError, CliUsageError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { checkOutputName, refuseOverwritingInputs } from '../output-paths.js';
import { tokenList } from '../token-list.js';
import { inputFiles } from './import.js';

/**
 * Bounds checked before anything is allocated. The reference keeps every position's KV cache and
 * a verify's logits ([budget + 1, vocab] f32: 0.7 GB at budget 1024 and Kimi's vocabulary), so
 * a mistyped 1000000000 must not reach an allocation. max-new is also bounded by the model's
 * max_position_embeddings once its config is read.
 */
export const MAX_NEW_TOKENS = 1 << 20;
export const MAX_BUDGET = 1024;
export const MAX_DEPTH = 64;

export const goldenSpec: CommandSpec = {
  name: 'golden',
  summary: 'Greedy decoding with the golden reference forward pass (f32, matches transformers). Works on KDTR bundles and directly on HuggingFace directories or safetensors with a config.json.',
  usage: 'kdtree golden MODEL --prompt 1,2,3 --max-new N [--logits OUT.npy] [--eos ID,...] [--config config.json] [--draft DRAFT --budget B --depth L] [--json]',
  help: [
    '--prompt IDS          comma-separated token ids',
    `--max-new N           tokens to generate at most (0 to ${MAX_NEW_TOKENS}; prompt + N within the model's max_position_embeddings)`,
    '--eos IDS             stop tokens (default: the config\'s eos_token_id; "" for none)',
    '--logits FILE         write f32 [T, vocab] teacher-forced logits of prompt + generated (.npy)',
    '--config FILE         config.json for a checkpoint without one beside it',
    '--draft MODEL         also decode with DDTree speculation using this draft model, and check it equals greedy',
    `--budget B            DDTree draft nodes per step (default 16, at most ${MAX_BUDGET})`,
    `--depth L             DDTree draft depth (default 4, 1 to ${MAX_DEPTH})`,
    '--json                print the result as JSON (schema "kdtree.golden/1")',
  ],
  options: {
    prompt: { type: 'string' },
    'max-new': { type: 'string' },
    eos: { type: 'string' },
    logits: { type: 'string' },
    config: { type: 'string' },
    draft: { type: 'string' },
    budget: { type: 'string' },
    depth: { type: 'string' },
    json: { type: 'boolean' },
  },
  positionals: [1, 1],
};

export async function runGolden(p: Parsed, io: CommandIO): Promise<number> {
  if (p.values.prompt === undefined) throw new CliUsageError('golden: --prompt is required', 'golden');
  const prompt = tokenList(p.values.prompt as string, '--prompt');
  if (prompt.length === 0) throw new CliUsageError('--prompt: needs at least one token', 'golden');
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 0, max: MAX_NEW_TOKENS });
  if (maxNew === undefined) throw new CliUsageError('golden: --max-new is required', 'golden');
  const eos = p.values.eos === undefined ? undefined : tokenList(p.values.eos as string, '--eos');
  const draftPath = p.values.draft as string | undefined;
  if (draftPath === undefined && (p.values.budget !== undefined || p.values.depth !== undefined)) throw new CliUsageError('golden: --budget and --depth need --draft', 'golden');
  const budget = parseIntArg(p.values.budget as string | undefined, '--budget', { min: 0, max: MAX_BUDGET }) ?? 16;
  const depth = parseIntArg(p.values.depth as string | undefined, '--depth', { min: 1, max: MAX_DEPTH }) ?? 4;
  const logitsPath = p.values.logits as string | undefined;
  const configPath = p.values.config as string | undefined;
  if (logitsPath !== undefined) {
    checkOutputName('golden', '--logits', logitsPath, 'npy');
    const inputs = [...(await inputFiles([p.positionals[0], ...(draftPath ? [draftPath] : [])])), ...(configPath ? [configPath] : [])];
    await refuseOverwritingInputs('golden', [{ flag: '--logits', path: logitsPath }], inputs);
  }
  const { model } = await loadModel(p.positionals[0], { config: configPath });
  const positions = model.config.maxPositionEmbeddings;
  const needed = prompt.length + maxNew + (draftPath ? depth : 0);
  if (needed > positions) {
    throw new CliUsageError(`--max-new: the prompt (${prompt.length} tokens) + ${maxNew} new${draftPath ? ` + depth ${depth}` : ''} = ${needed} positions, more than the model's max_position_embeddings (${positions})`, 'golden');
  }
  const { tokens } = greedyDecode(model, prompt, { maxNew, eos });
  let speculative: { budget: number; depth: number; steps: number; mean_accepted: number } | undefined;
  if (draftPath !== undefined) {
    const { model: draft } = await loadModel(draftPath);
    const out = ddtreeDecode(model, prompt, { maxNew, budget, depth, drafter: modelDrafter(draft), eos });
    if (out.tokens.join(',') !== tokens.join(',')) {
      throw new CliError(`DDTree decoding diverged from greedy decoding: [${out.tokens.join(', ')}] vs [${tokens.join(', ')}]`);
    }
    speculative = { budget, depth, steps: out.acceptedPerStep.length, mean_accepted: out.acceptedPerStep.reduce((a, b) => a + b, 0) / Math.max(1, out.acceptedPerStep.length) };
  }
  if (logitsPath !== undefined) {
    const all = [...prompt, ...tokens];
    const logits = teacherForcedLogits(model, all);
    await writeNpy(logitsPath, { dtype: 'F32', shape: [all.length, model.config.vocabSize], data: new Uint8Array(logits.buffer) });
  }
  if (p.values.json) io.out(jsonReport('kdtree.golden/1', { prompt, tokens, ddtree: speculative ?? null, logits: logitsPath ?? null }));
  else {
    io.out(`prompt: [${prompt.join(', ')}]`);
    io.out(`tokens: [${tokens.join(', ')}]`);
    if (speculative) io.out(`ddtree: identical to greedy; ${speculative.steps} target forwards for ${tokens.length} tokens (${speculative.mean_accepted.toFixed(2)} tokens per forward, budget ${speculative.budget}, depth ${speculative.depth})`);
    if (logitsPath !== undefined) io.out(`logits: ${logitsPath} (f32 [${prompt.length + tokens.length}, ${model.config.vocabSize}])`);
  }
  return 0;
}
