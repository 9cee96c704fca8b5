/**
 * The engine's options as `kdtree run`, `chat` and `serve` take them: the backend, the KV cache,
 * and speculative decoding (which emits exactly greedy's tokens, whatever the options).
 */
import { BACKEND_KINDS } from '@kdtree/cuda';
import { createEngine, SPECS, type Engine, type Spec } from '@kdtree/engine';
import { parseChoice, parseIntArg, type OptionSpec, type Parsed } from './args.js';
import { CliUsageError } from './cli-error.js';
import type { CommandIO } from './io.js';
import { formatBytes } from './output.js';

export const ENGINE_OPTIONS: OptionSpec = {
  backend: { type: 'string' },
  device: { type: 'string' },
  spec: { type: 'string' },
  drafter: { type: 'string' },
  budget: { type: 'string' },
  depth: { type: 'string' },
  'cache-tokens': { type: 'string' },
  'cache-dtype': { type: 'string' },
  activations: { type: 'string' },
  tp: { type: 'string' },
  'tp-timeout': { type: 'string' },
  ranks: { type: 'string' },
};

export const ENGINE_HELP = [
  '--backend KIND        auto (cuda, else cpu), cuda or cpu; default: $KDTREE_BACKEND, else auto',
  '--device N            CUDA device ordinal (default 0)',
  '--spec MODE           greedy (default), chain or ddtree',
  '--drafter D           ngram (default), model:PATH (a draft model of the same vocabulary) or dflash:PATH (a DFlash drafter bundle or directory for this target)',
  '--budget B            draft nodes per step, or auto (ddtree: chosen each step from the cost curve); default 16',
  '--depth L             draft depth (default 4; a DFlash drafter: its block_size - 1)',
  "--cache-tokens N      KV cache capacity: the context (default: 4096, or the model's max positions)",
  '--cache-dtype T       bf16 or f32 (default: bf16 on cuda, f32 on cpu)',
  '--activations T       dtype of the GEMMs\' inputs, bf16 or f32 (default: bf16 on cuda, f32 on cpu)',
  '--tp N                tensor-parallel ranks (default 1): the model split over N ranks (cpu backend)',
  '--ranks HOW           under --tp: ranks 1..N-1 as threads (default: worker threads, shared memory) or processes (one forked process each, TCP to rank 0)',
  '--tp-timeout MS       how long a rank may go silent before the run ends naming it (default 20000)',
];

/** The usage text of the engine options. */
export const ENGINE_USAGE = '[--backend auto|cpu|cuda] [--spec greedy|chain|ddtree] [--drafter ngram|model:PATH|dflash:PATH] [--budget B|auto] [--depth L] [--cache-tokens N] [--tp N [--ranks threads|processes]]';

export interface EngineArgs {
  backend?: (typeof BACKEND_KINDS)[number];
  device?: number;
  cacheTokens?: number;
  cacheDtype?: 'bf16' | 'f32';
  activations?: 'bf16' | 'f32';
  tp?: number;
  tpTimeoutMs?: number;
  tpRanks?: 'threads' | 'processes';
  decoding: { spec: Spec; drafter?: string; budget?: number | 'auto'; depth?: number };
}

export function parseEngineArgs(p: Parsed, command: string): EngineArgs {
  const spec = parseChoice(p.values.spec as string | undefined, '--spec', SPECS) ?? 'greedy';
  const budgetText = p.values.budget as string | undefined;
  const budget = budgetText === 'auto' ? 'auto' : parseIntArg(budgetText, '--budget', { min: 1, max: 1024 });
  const depth = parseIntArg(p.values.depth as string | undefined, '--depth', { min: 1, max: 64 });
  const drafter = p.values.drafter as string | undefined;
  if (spec === 'greedy' && (drafter !== undefined || budget !== undefined || depth !== undefined)) {
    throw new CliUsageError(`${command}: --drafter, --budget and --depth apply to --spec chain or ddtree`, command);
  }
  return {
    backend: parseChoice(p.values.backend as string | undefined, '--backend', BACKEND_KINDS),
    device: parseIntArg(p.values.device as string | undefined, '--device', { min: 0, max: 2 ** 31 - 1 }),
    cacheTokens: parseIntArg(p.values['cache-tokens'] as string | undefined, '--cache-tokens', { min: 2, max: 2 ** 30 }),
    cacheDtype: parseChoice(p.values['cache-dtype'] as string | undefined, '--cache-dtype', ['bf16', 'f32'] as const),
    activations: parseChoice(p.values.activations as string | undefined, '--activations', ['bf16', 'f32'] as const),
    tp: parseIntArg(p.values.tp as string | undefined, '--tp', { min: 1, max: 64 }),
    tpTimeoutMs: parseIntArg(p.values['tp-timeout'] as string | undefined, '--tp-timeout', { min: 100, max: 3_600_000 }),
    tpRanks: parseChoice(p.values.ranks as string | undefined, '--ranks', ['threads', 'processes'] as const),
    decoding: { spec, drafter, budget, depth },
  };
}

/** Loads the model on the engine, with a progress bar on stderr unless `quiet`. */
export async function openEngine(model: string, args: EngineArgs, io: CommandIO, quiet = false): Promise<Engine> {
  const { budget, depth } = args.decoding;
  const progress = quiet ? undefined : io.progress('loading', 1, { unit: 'bytes' });
  let bar = progress;
  const engine = await createEngine({
    model,
    backend: args.backend,
    device: args.device,
    cacheTokens: args.cacheTokens,
    cacheDtype: args.cacheDtype,
    activations: args.activations,
    tp: args.tp,
    tpTimeoutMs: args.tpTimeoutMs,
    tpRanks: args.tpRanks,
    maxBudget: typeof budget === 'number' ? Math.max(64, budget) : undefined,
    maxDepth: depth !== undefined ? Math.max(16, depth) : undefined,
    onLoadProgress: (l) => {
      if (bar === progress && progress) bar = io.progress('loading', l.bytesTotal, { unit: 'bytes' });
      bar?.update(l.bytesDone, l.part);
    },
  });
  bar?.finish(`${formatBytes(engine.memory.total)} on ${engine.backend.kind}`);
  return engine;
}

/** "ddtree (ngram, budget 16, depth 4) on cpu": what decodes, for a status line. */
export function decodingLine(engine: Engine, args: EngineArgs): string {
  const d = args.decoding;
  const depth = d.depth ?? (d.drafter?.startsWith('dflash:') ? 'block_size - 1' : 4);
  const detail = d.spec === 'greedy' ? '' : ` (${d.drafter ?? 'ngram'}, budget ${d.budget ?? 16}, depth ${depth})`;
  return `${d.spec}${detail} on ${engine.backend.kind} (${engine.device}${engine.tp > 1 ? `, ${engine.tp} ranks` : ''})`;
}
