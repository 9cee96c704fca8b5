import { BACKEND_KINDS } from '@kdtree/cuda';
import { createEngine, SPECS, type GenerateOptions, type GenerationStats, type StepTrace } from '@kdtree/engine';
import { parseChoice, parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { jsonReport, type CommandIO } from '../io.js';
import { formatBytes } from '../output.js';
import { tokenList } from '../token-list.js';

export const runSpec: CommandSpec = {
  name: 'run',
  summary:
    'Decode with the engine on the best native backend (cuda, else the cpu twin): greedy, or chain / DDTree speculation with an ngram or draft-model drafter, which emit exactly the tokens of greedy decoding. Tokens stream to stdout as steps accept them; the stats go to stderr.',
  usage: 'kdtree run MODEL --prompt 1,2,3 --max-new N [--backend auto|cpu|cuda] [--spec greedy|chain|ddtree] [--drafter ngram|model:PATH] [--budget B|auto] [--depth L] [--eos IDS] [--tp N] [--json] [--trace]',
  help: [
    '--prompt IDS          comma-separated token ids',
    '--max-new N           tokens to generate at most',
    '--backend KIND        auto (cuda, else cpu), cuda or cpu; default: $KDTREE_BACKEND, else auto',
    '--device N            CUDA device ordinal (default 0)',
    '--spec MODE           greedy (default), chain or ddtree',
    '--drafter D           ngram (default) or model:PATH, a draft model of the same vocabulary',
    '--budget B            draft nodes per step, or auto (ddtree: chosen each step from the cost curve); default 16',
    '--depth L             draft depth (default 4)',
    '--eos IDS             stop tokens (default: the config\'s eos_token_id; "" for none)',
    '--cache-tokens N      KV cache capacity (default: 4096, or the model\'s max positions)',
    '--cache-dtype T       bf16 or f32 (default: bf16 on cuda, f32 on cpu)',
    '--tp N                tensor-parallel ranks (default 1): the model split over N ranks, started as worker threads (cpu backend)',
    '--tp-timeout MS       how long a rank may go silent before the run ends naming it (default 20000)',
    '--json                print the result as JSON (schema "kdtree.run/1": prompt, tokens, stats) at the end instead of streaming',
    '--trace               with each step: the drafter\'s argmax per depth, the tree size and the tokens accepted',
  ],
  options: {
    prompt: { type: 'string' },
    'max-new': { type: 'string' },
    backend: { type: 'string' },
    device: { type: 'string' },
    spec: { type: 'string' },
    drafter: { type: 'string' },
    budget: { type: 'string' },
    depth: { type: 'string' },
    eos: { type: 'string' },
    'cache-tokens': { type: 'string' },
    'cache-dtype': { type: 'string' },
    tp: { type: 'string' },
    'tp-timeout': { type: 'string' },
    json: { type: 'boolean' },
    trace: { type: 'boolean' },
  },
  positionals: [1, 1],
};

function statsLine(s: GenerationStats, tokens: number): string {
  const spec = s.drafter ? `${s.spec} (${s.drafter})` : s.spec;
  return `${tokens} tokens, ${spec} on ${s.backend} (${s.device}${s.tp > 1 ? `, ${s.tp} ranks` : ''}): ${s.tokensPerSecond.toFixed(1)} tokens/s, prefill ${s.prefillMs.toFixed(1)} ms, decode ${s.decodeMs.toFixed(1)} ms, ${s.targetForwards} target forwards, ${s.meanAcceptedLength.toFixed(2)} tokens per step`;
}

/** The --json forms of the engine's stats and step traces: snake_case, as every --json output. */
function statsJson(s: GenerationStats) {
  return { backend: s.backend, device: s.device, tp: s.tp, spec: s.spec, drafter: s.drafter, tokens_per_second: s.tokensPerSecond, prefill_ms: s.prefillMs, decode_ms: s.decodeMs, target_forwards: s.targetForwards, steps: s.steps, mean_accepted_length: s.meanAcceptedLength, stopped_by: s.stoppedBy };
}

function stepJson(t: StepTrace) {
  return { draft_top1: t.draftTop1, tree_size: t.treeSize, accepted: t.accepted, budget: t.budget };
}

export async function runRun(p: Parsed, io: CommandIO): Promise<number> {
  if (p.values.prompt === undefined) throw new CliUsageError('run: --prompt is required', 'run');
  const prompt = tokenList(p.values.prompt as string, '--prompt');
  if (prompt.length === 0) throw new CliUsageError('--prompt: needs at least one token', 'run');
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 0, max: 1 << 24 });
  if (maxNew === undefined) throw new CliUsageError('run: --max-new is required', 'run');
  const spec = parseChoice(p.values.spec as string | undefined, '--spec', SPECS) ?? 'greedy';
  const budgetText = p.values.budget as string | undefined;
  const budget = budgetText === 'auto' ? 'auto' : parseIntArg(budgetText, '--budget', { min: 1, max: 1024 });
  const depth = parseIntArg(p.values.depth as string | undefined, '--depth', { min: 1, max: 64 });
  const cacheDtype = parseChoice(p.values['cache-dtype'] as string | undefined, '--cache-dtype', ['bf16', 'f32'] as const);
  const options: GenerateOptions = {
    maxNew,
    spec,
    drafter: p.values.drafter as string | undefined,
    budget,
    depth,
    eos: p.values.eos === undefined ? undefined : tokenList(p.values.eos as string, '--eos'),
    trace: Boolean(p.values.trace),
  };
  if (spec === 'greedy' && (options.drafter !== undefined || budget !== undefined || depth !== undefined)) {
    throw new CliUsageError('run: --drafter, --budget and --depth apply to --spec chain or ddtree', 'run');
  }
  const cacheTokens = parseIntArg(p.values['cache-tokens'] as string | undefined, '--cache-tokens', { min: 2, max: 2 ** 30 });
  const progress = p.values.json ? undefined : io.progress('loading', 1, { unit: 'bytes' });
  let bar = progress;
  const engine = await createEngine({
    model: p.positionals[0],
    backend: parseChoice(p.values.backend as string | undefined, '--backend', BACKEND_KINDS),
    device: parseIntArg(p.values.device as string | undefined, '--device', { min: 0, max: 2 ** 31 - 1 }),
    cacheTokens,
    cacheDtype,
    tp: parseIntArg(p.values.tp as string | undefined, '--tp', { min: 1, max: 64 }),
    tpTimeoutMs: parseIntArg(p.values['tp-timeout'] as string | undefined, '--tp-timeout', { min: 100, max: 3_600_000 }),
    maxBudget: typeof budget === 'number' ? Math.max(64, budget) : undefined,
    maxDepth: depth !== undefined ? Math.max(16, depth) : undefined,
    onLoadProgress: (l) => {
      if (bar === progress && progress) bar = io.progress('loading', l.bytesTotal, { unit: 'bytes' });
      bar?.update(l.bytesDone, l.part);
    },
  });
  try {
    bar?.finish(`${formatBytes(engine.memory.total)} on ${engine.backend.kind}`);
    const tokens: number[] = [];
    const steps: StepTrace[] = [];
    let stats: GenerationStats | undefined;
    for await (const chunk of engine.generate(prompt, options)) {
      if (!p.values.json && chunk.tokens.length > 0) io.write(`${tokens.length > 0 ? ', ' : ''}${chunk.tokens.join(', ')}`);
      tokens.push(...chunk.tokens);
      if (chunk.step) {
        steps.push(chunk.step);
        if (!p.values.json) io.err(`\nstep ${steps.length}: draft top-1 [${chunk.step.draftTop1.join(', ')}], tree ${chunk.step.treeSize} nodes, ${chunk.step.accepted} accepted`);
      }
      stats = chunk.stats ?? stats;
    }
    if (p.values.json) {
      io.out(jsonReport('kdtree.run/1', { prompt, tokens, stats: statsJson(stats!), ...(options.trace ? { steps: steps.map(stepJson) } : {}) }));
    } else {
      io.write('\n');
      io.err(statsLine(stats!, tokens.length));
    }
    return 0;
  } finally {
    await engine.dispose();
  }
}
