import { writeNpy } from '@kdtree/format';
import { ddtreeDecode, greedyDecode, loadModel, modelDrafter, teacherForcedLogits } from '@kdtree/reference';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import type { CommandIO } from '../io.js';
import { tokenList } from '../token-list.js';

export const goldenSpec: CommandSpec = {
  name: 'golden',
  summary: 'Greedy decoding with the golden reference forward pass (f32, matches transformers). Works on KDTR bundles and directly on HuggingFace directories or safetensors with a config.json.',
  usage: 'kdtree golden MODEL --prompt 1,2,3 --max-new N [--logits OUT.npy] [--eos ID,...] [--config config.json] [--draft DRAFT --budget B --depth L] [--json]',
  help: [
    '--prompt IDS          comma-separated token ids',
    '--max-new N           tokens to generate at most',
    '--eos IDS             stop tokens (default: the config\'s eos_token_id; "" for none)',
    '--logits FILE         write f32 [T, vocab] teacher-forced logits of prompt + generated (.npy)',
    '--config FILE         config.json for a checkpoint without one beside it',
    '--draft MODEL         also decode with DDTree speculation using this draft model, and check it equals greedy',
    '--budget B            DDTree draft nodes per step (default 16)',
    '--depth L             DDTree draft depth (default 4)',
    '--json                print {"prompt": [...], "tokens": [...]}',
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
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 0 });
  if (maxNew === undefined) throw new CliUsageError('golden: --max-new is required', 'golden');
  const eos = p.values.eos === undefined ? undefined : tokenList(p.values.eos as string, '--eos');
  const { model } = await loadModel(p.positionals[0], { config: p.values.config as string | undefined });
  const { tokens } = greedyDecode(model, prompt, { maxNew, eos });
  let speculative: { budget: number; depth: number; steps: number; meanAccepted: number } | undefined;
  if (p.values.draft !== undefined) {
    const { model: draft } = await loadModel(p.values.draft as string);
    const budget = parseIntArg(p.values.budget as string | undefined, '--budget', { min: 0 }) ?? 16;
    const depth = parseIntArg(p.values.depth as string | undefined, '--depth', { min: 1 }) ?? 4;
    const out = ddtreeDecode(model, prompt, { maxNew, budget, depth, drafter: modelDrafter(draft), eos });
    if (out.tokens.join(',') !== tokens.join(',')) {
      throw new Error(`DDTree decoding diverged from greedy decoding: [${out.tokens.join(', ')}] vs [${tokens.join(', ')}]`);
    }
    speculative = { budget, depth, steps: out.acceptedPerStep.length, meanAccepted: out.acceptedPerStep.reduce((a, b) => a + b, 0) / Math.max(1, out.acceptedPerStep.length) };
  }
  if (p.values.logits !== undefined) {
    const all = [...prompt, ...tokens];
    const logits = teacherForcedLogits(model, all);
    await writeNpy(p.values.logits as string, { dtype: 'F32', shape: [all.length, model.config.vocabSize], data: new Uint8Array(logits.buffer) });
  }
  if (p.values.json) io.out(JSON.stringify({ prompt, tokens }));
  else {
    io.out(`prompt: [${prompt.join(', ')}]`);
    io.out(`tokens: [${tokens.join(', ')}]`);
    if (speculative) io.out(`ddtree: identical to greedy; ${speculative.steps} target forwards for ${tokens.length} tokens (${speculative.meanAccepted.toFixed(2)} tokens per forward, budget ${speculative.budget}, depth ${speculative.depth})`);
    if (p.values.logits !== undefined) io.out(`logits: ${p.values.logits as string} (f32 [${prompt.length + tokens.length}, ${model.config.vocabSize}])`);
  }
  return 0;
}
