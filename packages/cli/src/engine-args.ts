/**
 * The engine's options as `kdtree run`, `chat` and `serve` take them: the backend, the KV cache,
 * and speculative decoding (which emits exactly greedy's tokens, whatever the options).
 */
import { BACKEND_KINDS } from '@kdtree/cuda';
import { createEngine, EngineError, launchPlans, SPECS, type Engine, type LaunchPlan, type Spec, type TpMaster } from '@kdtree/engine';
import { parseChoice, parseIntArg, type OptionSpec, type Parsed } from './args.js';
import { CliUsageError } from './cli-error.js';
import type { CommandIO } from './io.js';
import { formatBytes } from './output.js';

export const ENGINE_OPTIONS: OptionSpec = {
  config: { type: 'string' },
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
  '--config FILE         config.json for a safetensors checkpoint without one beside it',
  '--backend KIND        auto (cuda, else cpu), cuda or cpu; default: $KDTREE_BACKEND, else auto',
  '--device N            CUDA device ordinal (default 0)',
  '--spec MODE           greedy (default), chain or ddtree',
  '--drafter D           ngram (default), model:PATH (a draft model of the same vocabulary) or dflash:PATH (a DFlash drafter bundle or directory for this target)',
  '--budget B            draft nodes per step, or auto (ddtree: chosen each step from the cost curve); default 16',
  '--depth L             draft depth (default 4; a DFlash drafter: its block_size - 1)',
  "--cache-tokens N      KV cache capacity: the context (default: 4096, or the model's max positions)",
  '--cache-dtype T       bf16 or f32 (default: bf16 on cuda, f32 on cpu)',
  '--activations T       dtype of the GEMMs\' inputs, bf16 or f32 (default: bf16 on cuda, f32 on cpu)',
  '--tp N                tensor-parallel ranks (default 1; per node with --nnodes): the model split over N ranks (cpu: threads or processes; cuda: one process per device, NCCL)',
  '--ranks HOW           under --tp on cpu: ranks 1..N-1 as threads (default: worker threads, shared memory) or processes (one forked process each, TCP to rank 0)',
  '--tp-timeout MS       how long a rank may go silent before the run ends naming it (default 20000)',
];

/** A run over several nodes (kdtree run only); torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT stand in for them. */
export const LAUNCH_OPTIONS: OptionSpec = {
  nnodes: { type: 'string' },
  'node-rank': { type: 'string' },
  'master-addr': { type: 'string' },
  'master-port': { type: 'string' },
};

export const LAUNCH_HELP = [
  '--nnodes M            nodes of the run (default 1): --tp ranks on each, M x N in all; every node runs the same command with its --node-rank',
  "--node-rank R         this node (default 0): node 0 runs rank 0 and prints the tokens, node R > 0 starts ranks R*N..R*N+N-1, which join it, and exits when the run ends",
  "--master-addr A       node 0's address, where the other nodes' ranks connect (default $MASTER_ADDR, else 127.0.0.1; needed with --nnodes > 1)",
  '--master-port P       the port node 0 listens on for its ranks (default $MASTER_PORT, else 29500); under torchrun (RANK and WORLD_SIZE set) each process is one rank: RANK 0 prints the tokens, the others join it',
];

export const LAUNCH_USAGE = '[--nnodes M --node-rank R --master-addr A --master-port P]';

/** Where this process sits in a run over several nodes or under torchrun; undefined for a run on this host alone. */
export interface Launch {
  /** The ranks this process starts (node R) or is (torchrun): plans[0].rank 0 means it runs rank 0. */
  plans: LaunchPlan[];
  /** One rank per process, as torchrun starts them. */
  torchrun: boolean;
}

export function parseLaunch(p: Parsed, args: EngineArgs, env: NodeJS.ProcessEnv = process.env): Launch | undefined {
  const nnodes = parseIntArg(p.values.nnodes as string | undefined, '--nnodes', { min: 1, max: 4096 });
  const nodeRank = parseIntArg(p.values['node-rank'] as string | undefined, '--node-rank', { min: 0, max: 4095 });
  const masterPort = parseIntArg(p.values['master-port'] as string | undefined, '--master-port', { min: 1, max: 65535 });
  const masterAddr = p.values['master-addr'] as string | undefined;
  if (masterAddr === '') throw new CliUsageError('--master-addr: expected a host name or address', 'run');
  const torchrun = env.RANK !== undefined || env.WORLD_SIZE !== undefined;
  if (!torchrun && nnodes === undefined && nodeRank === undefined && masterAddr === undefined && masterPort === undefined) return undefined;
  if (!torchrun && nodeRank !== undefined && nnodes === undefined) throw new CliUsageError('--node-rank: needs --nnodes', 'run');
  if (args.tpRanks === 'threads') throw new CliUsageError('--ranks threads: a run over several nodes, or under torchrun, has rank processes', 'run');
  return { plans: launchPlans({ tp: args.tp, nnodes, nodeRank, masterAddr, masterPort }, env), torchrun };
}

/** The usage text of the engine options. */
export const ENGINE_USAGE = '[--config FILE] [--backend auto|cpu|cuda] [--spec greedy|chain|ddtree] [--drafter ngram|model:PATH|dflash:PATH] [--budget B|auto] [--depth L] [--cache-tokens N] [--tp N [--ranks threads|processes]]';

export interface EngineArgs {
  /** A config.json for a checkpoint that has none beside it. */
  config?: string;
  backend?: (typeof BACKEND_KINDS)[number];
  device?: number;
  cacheTokens?: number;
  cacheDtype?: 'bf16' | 'f32';
  activations?: 'bf16' | 'f32';
  tp?: number;
  tpTimeoutMs?: number;
  tpRanks?: 'threads' | 'processes';
  /** Rank 0 of a run over several nodes: this node's ranks and where the others connect. */
  tpLocalRanks?: number;
  tpMaster?: TpMaster;
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
    config: p.values.config as string | undefined,
    backend: parseChoice(p.values.backend as string | undefined, '--backend', BACKEND_KINDS),
    device: parseIntArg(p.values.device as string | undefined, '--device', { min: 0, max: 2 ** 31 - 1 }),
    // the upper bound is the model's (max_position_embeddings), which the engine names
    cacheTokens: parseIntArg(p.values['cache-tokens'] as string | undefined, '--cache-tokens', { min: 2 }),
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
    config: args.config,
    backend: args.backend,
    device: args.device,
    cacheTokens: args.cacheTokens,
    cacheDtype: args.cacheDtype,
    activations: args.activations,
    tp: args.tp,
    tpTimeoutMs: args.tpTimeoutMs,
    tpRanks: args.tpRanks,
    tpLocalRanks: args.tpLocalRanks,
    tpMaster: args.tpMaster,
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

/** The commands that take ENGINE_OPTIONS, whose engine errors usageErrorOf names by their flags. */
export const ENGINE_COMMANDS: readonly string[] = ['run', 'chat', 'serve'];

/** The flag of each engine option a command line sets (`EngineError.field` -> flag). */
const OPTION_FLAGS: Readonly<Record<string, string>> = { maxNew: '--max-new', cacheTokens: '--cache-tokens', depth: '--depth', budget: '--budget', spec: '--spec', drafter: '--drafter', tp: '--tp', device: '--device', config: '--config' };

/**
 * An engine's refusal of an option the command line set, as the usage error it is (exit 2), named
 * by its flag: `depth: expected ...` becomes `--depth: expected ...`, and an element's field by its
 * list's flag (`prompt[1]: token 512 ...` becomes `--prompt: id 2: token 512 ...`, given `prompt`
 * in `extra`, the flags a command sets beyond ENGINE_OPTIONS). Undefined for any other error.
 */
export function usageErrorOf(error: EngineError, extra: Readonly<Record<string, string>> = {}): CliUsageError | undefined {
  const element = error.field === undefined ? null : /^(.*)\[(\d+)\]$/.exec(error.field);
  const field = element === null ? error.field : element[1];
  const flag = field === undefined ? undefined : (extra[field] ?? OPTION_FLAGS[field]);
  if (flag === undefined || (error.code !== 'KDTREE_ENGINE_ARGUMENT' && error.code !== 'KDTREE_ENGINE_CAPACITY')) return undefined;
  const prefix = `${error.field}: `;
  const detail = error.message.startsWith(prefix) ? error.message.slice(prefix.length) : error.message;
  return new CliUsageError(`${flag}: ${element === null ? '' : `id ${Number(element[2]) + 1}: `}${detail}`);
}
