import { EngineError, type GenerateOptions, type GenerationStats, type StepTrace } from '@kdtree/engine';
import { completionStopTokens } from '@kdtree/server';
import { parseIntArg, type CommandSpec, type Parsed } from '../args.js';
import { CliUsageError } from '../cli-error.js';
import { joinAsRank, startNodeRanks, TP_TIMEOUT_MS } from '@kdtree/engine';
import { ENGINE_HELP, ENGINE_OPTIONS, ENGINE_USAGE, LAUNCH_HELP, LAUNCH_OPTIONS, LAUNCH_USAGE, openEngine, parseEngineArgs, parseLaunch, usageErrorOf, type EngineArgs, type Launch } from '../engine-args.js';
import { jsonReport, type CommandIO } from '../io.js';
import { openTokenizer } from '../model-tokenizer.js';
import { tokenList } from '../token-list.js';

export const runSpec: CommandSpec = {
  name: 'run',
  summary:
    "Decode with the engine on the best native backend (cuda, else the cpu twin): greedy, or chain / DDTree speculation with an ngram, draft-model or DFlash drafter, which emit exactly the tokens of greedy decoding. The prompt is token ids (--prompt), or text (--text) encoded with the model's tokenizer, which then decodes the answer as it streams (the text kdtree serve's /v1/completions answers). Tokens or text stream to stdout as steps accept them; the stats go to stderr.",
  usage: `kdtree run MODEL --prompt 1,2,3 | --text "..." --max-new N ${ENGINE_USAGE} ${LAUNCH_USAGE} [--eos IDS] [--tokenizer DIR] [--json] [--trace]`,
  help: [
    '--prompt IDS          comma-separated token ids',
    "--text TEXT           the prompt as text, encoded with the model's tokenizer (special-token text parsed); the answer is printed as text",
    '--max-new N           tokens to generate at most',
    ...ENGINE_HELP,
    ...LAUNCH_HELP,
    "--eos IDS             stop tokens (default: the config's eos_token_id, and with --text the tokenizer's eos; \"\" for none)",
    "--tokenizer DIR       the tokenizer's model directory (default: the one the bundle carries, or MODEL's directory)",
    '--json                print the result as JSON (schema "kdtree.run/1": prompt, tokens, stats; with --text also text, with --trace also steps) at the end instead of streaming',
    "--trace               with each step: the drafter's argmax per depth, the tree size and the tokens accepted",
  ],
  options: {
    prompt: { type: 'string' },
    text: { type: 'string' },
    'max-new': { type: 'string' },
    ...ENGINE_OPTIONS,
    ...LAUNCH_OPTIONS,
    eos: { type: 'string' },
    tokenizer: { type: 'string' },
    json: { type: 'boolean' },
    trace: { type: 'boolean' },
  },
  positionals: [1, 1],
};

function statsLine(s: GenerationStats, tokens: number): string {
  const spec = s.drafter ? `${s.spec} (${s.drafter})` : s.spec;
  return `${tokens} tokens, ${spec} on ${s.backend} (${s.device}${s.tp > 1 ? `, ${s.tp} ranks` : ''}): ${s.tokensPerSecond.toFixed(1)} tokens/s, prefill ${s.prefillMs.toFixed(1)} ms, ${s.calibrationMs > 0 ? `cost curve measured in ${s.calibrationMs.toFixed(1)} ms, ` : ''}decode ${s.decodeMs.toFixed(1)} ms, ${s.targetForwards} target forwards, ${s.meanAcceptedLength.toFixed(2)} tokens per step`;
}

/** The --json forms of the engine's stats and step traces: snake_case, as every --json output. */
function statsJson(s: GenerationStats) {
  return { backend: s.backend, device: s.device, tp: s.tp, spec: s.spec, drafter: s.drafter, tokens_per_second: s.tokensPerSecond, prefill_ms: s.prefillMs, calibration_ms: s.calibrationMs, decode_ms: s.decodeMs, target_forwards: s.targetForwards, steps: s.steps, mean_accepted_length: s.meanAcceptedLength, stopped_by: s.stoppedBy };
}

function stepJson(t: StepTrace) {
  return { draft_top1: t.draftTop1, tree_size: t.treeSize, accepted: t.accepted, budget: t.budget };
}

/** `chunks`, with the engine's refusal of a value a flag gave (`flags`: field -> flag) as that flag's usage error. */
async function* refusedAsUsage<T, R>(chunks: AsyncGenerator<T, R>, flags: Readonly<Record<string, string>>): AsyncGenerator<T, R> {
  try {
    return yield* chunks;
  } catch (error) {
    throw (error instanceof EngineError ? usageErrorOf(error, flags) : undefined) ?? error;
  }
}

/**
 * A node other than node 0 (its ranks join rank 0 and run until it ends the run), or a torchrun
 * process of a rank other than 0 (it is that rank, and ends its process with the run).
 */
async function joinRun(launch: Launch, model: string, args: EngineArgs, io: CommandIO): Promise<number> {
  const timeoutMs = args.tpTimeoutMs ?? TP_TIMEOUT_MS;
  const [first] = launch.plans;
  const at = `${first.masterAddr}:${first.masterPort}`;
  if (launch.torchrun) {
    io.err(`rank ${first.rank} of ${first.world} (local rank ${first.localRank}) joining rank 0 at ${at}`);
    return joinAsRank(first, { timeoutMs, model });
  }
  const node = startNodeRanks(launch.plans, { timeoutMs, model });
  const ranks = launch.plans.map((plan) => plan.rank);
  io.err(`node ${first.rank / launch.plans.length} of ${first.world / launch.plans.length}: ranks ${ranks.join(', ')} (pids ${node.pids.join(', ')}) joining rank 0 at ${at}`);
  const stop = () => node.kill();
  process.once('SIGINT', stop).once('SIGTERM', stop);
  try {
    await node.done;
  } finally {
    process.off('SIGINT', stop).off('SIGTERM', stop);
  }
  io.err(`node ${first.rank / launch.plans.length}: ranks ${ranks.join(', ')} done`);
  return 0;
}

export async function runRun(p: Parsed, io: CommandIO): Promise<number> {
  const text = p.values.text as string | undefined;
  if ((p.values.prompt === undefined) === (text === undefined)) throw new CliUsageError(`run: give --prompt IDS or --text TEXT, not ${text === undefined ? 'neither' : 'both'}`, 'run');
  if (p.values.tokenizer !== undefined && text === undefined) throw new CliUsageError('run: --tokenizer applies to --text', 'run');
  const ids = text === undefined ? tokenList(p.values.prompt as string, '--prompt') : undefined;
  if (ids?.length === 0) throw new CliUsageError('--prompt: needs at least one token', 'run');
  const maxNew = parseIntArg(p.values['max-new'] as string | undefined, '--max-new', { min: 0, max: 1 << 24 });
  if (maxNew === undefined) throw new CliUsageError('run: --max-new is required', 'run');
  const args = parseEngineArgs(p, 'run');
  const launch = parseLaunch(p, args);
  if (launch !== undefined && launch.plans[0].rank !== 0) return joinRun(launch, p.positionals[0], args, io);
  if (launch !== undefined) {
    const [plan] = launch.plans;
    args.tp = plan.world;
    args.tpLocalRanks = launch.plans.length;
    args.tpMaster = { host: plan.masterAddr, port: plan.masterPort };
  }
  const eosGiven = p.values.eos === undefined ? undefined : tokenList(p.values.eos as string, '--eos');
  // the tokenizer first: a model without one fails before the weights load
  const tokenizer = text === undefined ? undefined : await openTokenizer((p.values.tokenizer as string | undefined) ?? p.positionals[0]);
  try {
    const prompt = ids ?? tokenizer!.encode(text!);
    if (prompt.length === 0) throw new CliUsageError('--text: the text encodes to no tokens', 'run');
    const engine = await openEngine(p.positionals[0], args, io, Boolean(p.values.json));
    try {
      // with text, the answer ends where /v1/completions ends it: the config's eos and the tokenizer's
      const eos = eosGiven ?? (tokenizer ? completionStopTokens(engine.config, tokenizer) : undefined);
      const options: GenerateOptions = { maxNew, ...args.decoding, eos, trace: Boolean(p.values.trace) };
      const tokens: number[] = [];
      const steps: StepTrace[] = [];
      let stats: GenerationStats | undefined;
      // the text of /v1/completions: special tokens and the stop token left out
      const stops = new Set(eos ?? []);
      const decoder = tokenizer?.streamDecoder({ skipSpecial: true });
      let answer = '';
      // whether streamed output has left a stdout line open since the last trace line
      let lineOpen = false;
      // the ids and stop tokens given on the command line are named by their flags when refused
      const flags = { ...(ids !== undefined ? { prompt: '--prompt' } : {}), ...(eosGiven !== undefined ? { eos: '--eos' } : {}) };
      for await (const chunk of refusedAsUsage(engine.generate(prompt, options), flags)) {
        if (decoder !== undefined) {
          const piece = decoder.push(chunk.tokens.filter((t) => !stops.has(t)));
          answer += piece;
          if (!p.values.json) io.write(piece);
          lineOpen ||= piece !== '';
        } else if (!p.values.json && chunk.tokens.length > 0) {
          io.write(`${tokens.length > 0 ? ', ' : ''}${chunk.tokens.join(', ')}`);
          lineOpen = true;
        }
        tokens.push(...chunk.tokens);
        if (chunk.step) {
          steps.push(chunk.step);
          if (!p.values.json) {
            io.err(`${lineOpen && io.sharedTerminal ? '\n' : ''}step ${steps.length}: draft top-1 [${chunk.step.draftTop1.join(', ')}], tree ${chunk.step.treeSize} nodes, ${chunk.step.accepted} accepted`);
            lineOpen = false;
          }
        }
        stats = chunk.stats ?? stats;
      }
      if (decoder !== undefined) {
        const tail = decoder.flush();
        answer += tail;
        if (!p.values.json) io.write(tail);
      }
      if (p.values.json) {
        io.out(jsonReport('kdtree.run/1', { prompt, ...(text !== undefined ? { text: answer } : {}), tokens, stats: statsJson(stats!), ...(options.trace ? { steps: steps.map(stepJson) } : {}) }));
      } else {
        io.write('\n');
        io.err(statsLine(stats!, tokens.length));
      }
      return 0;
    } finally {
      await engine.dispose();
    }
  } finally {
    tokenizer?.free();
  }
}
