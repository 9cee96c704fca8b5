/**
 * The engine: a model loaded on the best backend, and generation as an async iterator.
 *
 *   const engine = await createEngine({ model: 'k2.kdtr', backend: 'auto', cacheTokens: 4096 });
 *   for await (const chunk of engine.generate(prompt, { maxNew: 64, spec: 'ddtree', drafter: 'ngram' })) {
 *     process.stdout.write(chunk.tokens.join(' '));   // the tokens each step accepted
 *     if (chunk.stats) console.log(chunk.stats);        // on the last chunk
 *   }
 *   await engine.dispose();
 *
 * Generations on one engine run one after another (a call waits for the previous one to finish).
 * Speculative decoding (chain, ddtree) emits exactly the tokens of greedy decoding of the target.
 */
import { stat } from 'node:fs/promises';
import { createBackend, KdtreeBackend, type BackendKind, type DeviceTensor } from '@kdtree/cuda';
import type { DflashConfig } from '@kdtree/reference';
import { BUDGET_BUCKETS, bucketsUpTo, BudgetPolicy, type CostCurve } from './budget.js';
import { HostCollective, type Collective } from './collective.js';
import { DflashDrafter, type DrafterWeights } from './dflash-drafter.js';
import { ModelDrafter, NgramDrafter, type Drafter } from './drafters.js';
import { argumentError, checkInt, EngineError, modelError, throwIfAborted } from './errors.js';
import type { CacheDtype } from './kv-cache.js';
import type { ActivationDtype } from './workspace.js';
import { view } from './linear.js';
import { checkFits, estimateMemory, type MemoryEstimate } from './memory.js';
import { DeviceModel, type LoadProgress } from './model.js';
import { ModelSource, type WeightReader } from './model-source.js';
import { Runner, type TreeBuffers } from './runner.js';
import type { Shard } from './shard.js';
import { openModel } from './shard-source.js';
import { NcclCollective } from './nccl-collective.js';
import { ncclIdBytes, ncclIdHex, parseTpFault, rankDevice, TP_TIMEOUT_MS, TpGroup, type TpFault, type TpMaster, type TpRanks } from './tp.js';

export type Spec = 'greedy' | 'chain' | 'ddtree';
/**
 * Rows of taps auto's plain decode steps hold back before they commit them anyway (see heldTaps):
 * rows still held when a generation ends are never committed, so a wait that lasts to the end of
 * a generation (and holds fewer rows than this) costs its drafter no commit at all. 512 rows of a
 * 7168-wide model's 6 tapped layers take 88 MB.
 */
const HELD_TAP_ROWS = 512;

export const SPECS: readonly Spec[] = ['greedy', 'chain', 'ddtree'];

/** 'ngram', 'model:PATH' (a draft model bundle or directory), 'dflash:PATH' (a DFlash drafter bundle or directory), or a Drafter of your own. */
export type DrafterSpec = string | Drafter;

export interface EngineOptions {
  /** A KDTR bundle, a HuggingFace directory, a safetensors checkpoint with a config.json, or weights made in memory (SeededSource). */
  model: string | WeightReader;
  /** A config.json for a checkpoint that has none beside it. */
  config?: string;
  /** Default: KDTREE_BACKEND, else 'auto' (cuda where a usable GPU is, else the cpu twin); or a backend already loaded (engines may share one). */
  backend?: BackendKind | KdtreeBackend;
  device?: number;
  /** KV cache capacity in tokens: prompt + generated + the largest tree (default 4096, at most max_position_embeddings). */
  cacheTokens?: number;
  /** The latent cache's dtype (default bf16 on cuda, f32 on the cpu twin). */
  cacheDtype?: CacheDtype;
  /**
   * The dtype of the activations that feed the GEMMs (the normed hidden state, the MLPs'
   * silu(gate) * up): default bf16 on cuda, as a bf16 checkpoint computes, and f32 on the cpu twin,
   * which then follows the f32 reference. The residual stream and every sum stay f32.
   */
  activations?: ActivationDtype;
  /** Tokens per prefill pass (default 2048 on cuda, so a long prompt reads the experts once; 64 on cpu). */
  prefillChunk?: number;
  /** The largest DDTree budget a generation may ask for (default 64; sizes the verify buffers). */
  maxBudget?: number;
  /** The deepest draft (default 16). */
  maxDepth?: number;
  /**
   * Tensor-parallel ranks (default 1): the model split over `tp` ranks (heads, intermediate
   * channels and vocabulary; docs/tp.md). On the cpu backend the engine starts tp - 1 worker
   * threads or processes itself (tpRanks); on cuda, one process per device over NCCL; other
   * nodes' ranks can join (tpLocalRanks). `model` must be a path, which every rank reads its shard of.
   */
  tp?: number;
  /** Under tp > 1: how long a rank may go silent (loading a part, reaching a collective) before the run ends with an error naming it (default 20000 ms). */
  tpTimeoutMs?: number;
  /** Under tp > 1, for tests: a fault to inject, `RANK:load:KIND` or `RANK:collective=N:KIND` (KIND throw, stall or exit); default $KDTREE_TP_FAULT. */
  tpFault?: string;
  /**
   * Under tp > 1 on the cpu backend: how ranks 1..tp-1 run. 'threads' (the default): worker
   * threads of this process over shared memory; 'processes': one forked process each, over TCP to
   * rank 0 (the path GPU ranks take: one process per device; the default on cuda and across nodes).
   */
  tpRanks?: TpRanks;
  /**
   * Under tp > 1 with rank processes, for a run over several nodes: this engine starts ranks
   * 0..tpLocalRanks-1 (default tp), and the others join it from their nodes (`kdtree run --nnodes`,
   * torchrun; docs/tp.md). The run waits up to tpTimeoutMs for them, then fails naming the missing.
   */
  tpLocalRanks?: number;
  /** Where rank 0 listens for its ranks (default 127.0.0.1 and a free port): the master address and port the other nodes are given. */
  tpMaster?: TpMaster;
  /** Progress of the model's load (rank 0's shard under tp > 1). */
  onLoadProgress?: (progress: LoadProgress) => void;
  signal?: AbortSignal;
  /** Backend choice and fallbacks, one line each. */
  log?: (line: string) => void;
}

export interface GenerateOptions {
  maxNew: number;
  /** Stop after any of these (included in the output). Default: the model config's eos_token_id. */
  eos?: readonly number[];
  spec?: Spec;
  /** For chain and ddtree (default 'ngram'). */
  drafter?: DrafterSpec;
  /** Draft nodes per step (chain: the chain's length, at most `depth`), or 'auto' (ddtree). Default 16. */
  budget?: number | 'auto';
  /** Draft depth L (default: the drafter's defaultDepth — block_size - 1 for dflash — else 4; at most the drafter's and the engine's maxDepth). */
  depth?: number;
  signal?: AbortSignal;
  /** Record each step's draft and acceptance in the chunks (`step`). */
  trace?: boolean;
}

export interface StepTrace {
  /** The drafter's argmax at depths 1..L. */
  draftTop1: number[];
  /** Nodes verified, root included. */
  treeSize: number;
  /** Draft nodes accepted (the bonus token not counted). */
  accepted: number;
  /** The budget this step ran (auto chooses one per step; 0: a plain decode step). */
  budget: number;
}

export interface GenerationStats {
  backend: 'cpu' | 'cuda';
  device: string;
  /** Tensor-parallel ranks the model ran on. */
  tp: number;
  spec: Spec;
  drafter: string | null;
  /** Tokens after the first, per second of decoding. */
  tokensPerSecond: number;
  /** Until the first token (the prompt's forward), calibrationMs apart. */
  prefillMs: number;
  /**
   * Budget `auto`'s one-time measurement of the verify cost curve on this backend at this depth
   * (its first generation at a depth; 0 after, and for fixed budgets), before the prefill.
   */
  calibrationMs: number;
  decodeMs: number;
  /** Target forward passes: prefill chunks and one per step. */
  targetForwards: number;
  /** Decode or verify steps after the first token. */
  steps: number;
  /** Tokens emitted per step (accepted drafts + the bonus): 1 for greedy. */
  meanAcceptedLength: number;
  stoppedBy: 'eos' | 'max';
}

export interface GenerationChunk {
  /** Tokens accepted by one step (the first chunk: the token after the prompt). */
  tokens: number[];
  step?: StepTrace;
  /** On the last chunk. */
  stats?: GenerationStats;
}

export interface GenerationResult {
  tokens: number[];
  stats: GenerationStats;
  steps: StepTrace[];
}

interface SpecState {
  drafter: Drafter;
  depth: number;
  budget: number | 'auto';
  /** Auto: the policy (its calibration and the wait before the next try) of this drafter and depth. */
  policy?: BudgetPolicy;
}

export class Engine {
  readonly config;
  private readonly runner: Runner;
  private readonly tree: TreeBuffers;
  /** f32 [maxDepth, vocab]: the drafter's per-depth logits. */
  private readonly draftLogits: DeviceTensor;
  private readonly draftTop1: DeviceTensor;
  private readonly drafters = new Map<string, Promise<Drafter>>();
  private readonly costs = new Map<number, CostCurve>();
  /** Two events an auto try is timed between, created on first use (a pair per try would be four more native calls a step). */
  private tryEvents: [number, number] | undefined;
  /** firstBuild's answers by depth and largest budget (a try would otherwise ask the dispatch rule up to 21 times). */
  private readonly firstBuilds = new Map<string, number>();
  /**
   * Auto's policy per drafter and depth, kept between generations as a server's requests share a
   * drafter: the calibration the trees of one generation taught holds for the next, so later
   * requests start calibrated instead of probing the drafter as an unknown. The waits between tries start
   * afresh with each generation (a new context: prompt lookup may match where the last did not),
   * except a drafter's never accepted in CALIBRATION_PROBES tries or more (BudgetPolicy.begin).
   */
  private readonly autoPolicies = new WeakMap<Drafter, Map<number, BudgetPolicy>>();
  /** Layer -> f32 [workspace rows, hidden]: the target's taps for a drafter of hidden states (Runner.taps). */
  private readonly tapBuffers = new Map<number, DeviceTensor>();
  /** The generation's drafter when it reads the target's hidden states (it gets each committed row). */
  private tapping: Drafter | undefined;
  /**
   * Rows of taps held back from the tapping drafter while `auto` decodes without drafting (its
   * plain steps): a commit costs the drafter's fc and K/V projections (0.45 ms a step for a drafter
   * of Kimi K2.5-DFlash's size), a held row a kvWrite inside its step; they reach commit() in one
   * batch before the next draft (heldCapacity rows at most: what one commit may bring). f32
   * [heldCapacity, hidden] per tapped layer; the held decode step writes its row there on the
   * device (Runner.held), at the row `heldNext` (i32 [1]) holds.
   */
  private readonly heldTaps = new Map<number, DeviceTensor>();
  private heldNext: DeviceTensor | undefined;
  /** Rows held now (the host's count of what heldNext holds on the device). */
  private heldRows = 0;
  /** Rows the held buffers take: HELD_TAP_ROWS, or fewer where the drafter's commits are smaller (the workspace's rows). */
  private get heldCapacity(): number {
    return Math.min(HELD_TAP_ROWS, this.model.workspace.rows);
  }
  private tail: Promise<void> = Promise.resolve();
  /** Aborted when dispose() begins: a running generation ends at its next step, a queued one at once. */
  private readonly closing = new AbortController();
  private disposal: Promise<void> | undefined;

  /** @internal createEngine builds engines: it checks the options and the memory first. */
  constructor(
    readonly backend: KdtreeBackend,
    readonly model: DeviceModel,
    readonly source: { path: string; configJson: Record<string, unknown> },
    readonly options: Required<Pick<EngineOptions, 'cacheTokens' | 'cacheDtype' | 'activations' | 'prefillChunk' | 'maxBudget' | 'maxDepth'>>,
    /** Per rank under tensor parallelism (rank 0's shard). */
    readonly memory: MemoryEstimate,
    /** The other tensor-parallel ranks (absent with one). */
    private readonly group?: TpGroup,
  ) {
    this.config = model.config;
    const b = backend;
    this.runner = new Runner(b, model, options.cacheTokens, options.cacheDtype, options.prefillChunk);
    const nodes = Math.max(options.maxBudget, options.maxDepth) + 1;
    this.tree = this.runner.treeBuffers(nodes);
    this.draftLogits = this.runner.own(b.zeros('f32', [options.maxDepth, model.config.vocabSize]));
    this.draftTop1 = this.runner.own(b.zeros('i32', [options.maxDepth]));
    this.runner.useStepBuffers(this.tree, this.draftLogits);
    this.runner.peers = group;
  }

  /** Tensor-parallel ranks the model runs on. */
  get tp(): number {
    return this.group?.world ?? 1;
  }

  /** The process ids of ranks 1..tp-1 under `tpRanks: 'processes'` (empty otherwise): for an operator's monitoring, and the tests' check that none outlives the engine. */
  get rankPids(): number[] {
    return this.group?.pids ?? [];
  }

  /** Throws the failure of a tensor-parallel rank, once one has ended the group. */
  private checkRanks(): void {
    const failed = this.group?.failure();
    if (failed) throw failed;
  }

  /** Runs `fn`; when a rank failed meanwhile, terminates the other ranks and throws that failure. */
  private async guarded<T>(fn: () => Promise<T> | T): Promise<T> {
    this.checkRanks();
    try {
      return await fn();
    } catch (error) {
      throw await this.rankFailureOr(error);
    }
  }

  /** The error to report for `error`: a rank's failure when one failed (the other ranks then ended now, not at dispose). */
  private async rankFailureOr(error: unknown): Promise<unknown> {
    const failed = this.group?.failure();
    if (!failed) return error;
    await this.group!.close();
    // a rank process's failure is named by how it exited once that is known
    return this.group!.failure() ?? failed;
  }

  get device(): string {
    return this.backend.info().name;
  }

  /** Loads (once) and returns the drafter `spec` names. */
  async drafter(spec: DrafterSpec): Promise<Drafter> {
    if (typeof spec !== 'string') return checkDrafter(spec);
    let d = this.drafters.get(spec);
    if (d === undefined) {
      d = this.makeDrafter(spec);
      this.drafters.set(spec, d);
      d.catch(() => this.drafters.delete(spec));
    }
    return d;
  }

  private async makeDrafter(spec: string): Promise<Drafter> {
    const V = this.config.vocabSize;
    if (spec === 'ngram') return new NgramDrafter(this.backend, V, this.options.maxDepth);
    const path = spec.slice(spec.indexOf(':') + 1);
    if (spec.startsWith('model:') || spec.startsWith('dflash:')) {
      if (path === '') throw argumentError('drafter', `${spec} needs the path of its model after the colon`);
      if (!(await exists(path))) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${spec}: ${path}: no such file or directory`, 'drafter');
    }
    if (spec.startsWith('model:')) {
      const source = await ModelSource.open(path).catch((error: unknown) => {
        // a DFlash directory given as a draft model: the drafter's refusal, naming the right spec
        throw error instanceof EngineError && error.field === 'architectures' ? new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${spec}: ${error.message}`, 'drafter', { cause: error }) : error;
      });
      try {
        return await this.modelDrafter(source, spec);
      } finally {
        await source.close();
      }
    }
    if (spec.startsWith('dflash:')) {
      this.checkOneDevice();
      return DflashDrafter.load(this.backend, path, this.model, { ...this.dflashOptions(), name: spec });
    }
    throw argumentError('drafter', `expected 'ngram', 'model:PATH' or 'dflash:PATH', got '${spec}'`);
  }

  /** A DFlash drafter reads the target's hidden states and lm_head on one device. */
  private checkOneDevice(): void {
    if (this.tp > 1) throw argumentError('drafter', 'a DFlash drafter runs on one device (it reads the target\'s hidden states and lm_head there); use tp 1');
  }

  /** A DFlash drafter's cache and commit sizes on this engine: the target's KV capacity and largest pass. */
  private dflashOptions(): { capacity: number; maxRows: number; heldRows: number; activations: ActivationDtype } {
    return { capacity: this.options.cacheTokens, maxRows: this.model.workspace.rows, heldRows: this.heldCapacity, activations: this.options.activations };
  }

  /**
   * A DFlash drafter of `config` from any weights (seeded values for a benchmark at Kimi
   * K2.5-DFlash's size; a checkpoint goes through `drafter: 'dflash:PATH'`), paired with this
   * engine's target: pass it as `drafter` to generate().
   */
  async dflashDrafter(config: DflashConfig, weights: DrafterWeights, name = `dflash:${weights.path}`): Promise<DflashDrafter> {
    this.checkOneDevice();
    return DflashDrafter.fromWeights(this.backend, config, weights, this.model, { ...this.dflashOptions(), name });
  }

  /** A draft model's drafter from any weight reader (a bundle, seeded weights), on this engine's backend. */
  async modelDrafter(source: WeightReader, name = `model:${source.path}`): Promise<ModelDrafter> {
    const V = this.config.vocabSize;
    if (source.config.vocabSize !== V) {
      throw new EngineError('KDTREE_ENGINE_DRAFTER', `draft model ${source.path} has a vocabulary of ${source.config.vocabSize} tokens, the target ${V}: a drafter must share the target's vocabulary`, 'drafter');
    }
    const rows = Math.max(this.options.maxDepth + 1, Math.min(this.options.prefillChunk, 64));
    checkFits(this.backend, estimateMemory(source, { capacity: this.options.cacheTokens, cacheDtype: 'bf16', rows, nodes: 0, depth: 0 }), `draft model ${source.path}`);
    const model = await DeviceModel.load(this.backend, source, { rows, activations: this.options.activations });
    return new ModelDrafter(this.backend, model, name, this.options.cacheTokens, this.options.maxDepth);
  }

  /**
   * Waits for the engine's turn and returns its release. With `signals`, a wait that one of them
   * aborts gives the turn up at once (rejecting): whoever queued behind it goes when the holder
   * before it releases.
   */
  private async lock(signals: readonly AbortSignal[] = []): Promise<() => void> {
    const previous = this.tail;
    let release!: () => void;
    this.tail = new Promise((r) => (release = r));
    try {
      await untilAborted(previous, signals);
    } catch (error) {
      void previous.then(release);
      throw error;
    }
    return release;
  }

  /** Throws KDTREE_ENGINE_DISPOSED once dispose() has begun. */
  private checkOpen(): void {
    if (this.closing.signal.aborted) throw new EngineError('KDTREE_ENGINE_DISPOSED', 'the engine was disposed', 'engine');
  }

  /** `field`'s token ids: an array (or a typed array) of integers in the vocabulary, every index set. */
  private checkPrompt(prompt: readonly number[], field = 'prompt'): number[] {
    if (!Array.isArray(prompt) && !(ArrayBuffer.isView(prompt) && !(prompt instanceof DataView))) {
      throw argumentError(field, `expected an array of token ids, got ${prompt === null ? 'null' : typeof prompt}`);
    }
    if (prompt.length === 0) throw argumentError(field, 'needs at least one token');
    const V = this.config.vocabSize;
    // by index, not forEach: a hole in a sparse array is no token (forEach would skip it)
    const ids: number[] = [];
    for (let i = 0; i < prompt.length; i++) {
      const t = prompt[i] as unknown;
      if (typeof t !== 'number' || !Number.isInteger(t)) throw argumentError(`${field}[${i}]`, `expected an integer token id, got ${t === undefined ? 'nothing (a hole in the array)' : typeof t === 'number' ? t : `${JSON.stringify(String(t))} (a ${typeof t})`}`);
      if (t < 0 || t >= V) throw argumentError(`${field}[${i}]`, `token ${t} is outside the vocabulary [0, ${V})`);
      ids.push(t);
    }
    return ids;
  }

  /**
   * Generates after `prompt`: an async iterator of the tokens each step accepts, with the stats on
   * the last chunk. Errors in the arguments are thrown at the first `next()`; the engine stays
   * usable after any error or abort.
   */
  async *generate(prompt: readonly number[], options: GenerateOptions): AsyncGenerator<GenerationChunk, GenerationResult> {
    this.checkOpen();
    const tokens = this.checkPrompt(prompt);
    if (typeof options !== 'object' || options === null) throw argumentError('options', `expected the generation's options ({ maxNew, ... }), got ${options === null ? 'null' : typeof options}`);
    const spec = options.spec ?? 'greedy';
    if (!SPECS.includes(spec)) throw argumentError('spec', `expected one of ${SPECS.join(', ')}, got '${String(spec)}'`);
    const cap = this.options.cacheTokens;
    // too many for the cache is the capacity check's (below), which names the cache's size
    const maxNew = options.maxNew;
    if (typeof maxNew !== 'number' || !Number.isSafeInteger(maxNew) || maxNew < 0) throw argumentError('maxNew', `expected an integer >= 0, got ${typeof maxNew === 'number' ? maxNew : JSON.stringify(maxNew)}`);
    const V = this.config.vocabSize;
    const given = options.eos as unknown;
    if (given !== undefined && !Array.isArray(given) && !(given instanceof Set) && !(ArrayBuffer.isView(given) && !(given instanceof DataView))) throw argumentError('eos', `expected an array of token ids, got ${given === null ? 'null' : typeof given}`);
    const eos = new Set(options.eos ?? this.config.eosTokenIds);
    const eosFrom = options.eos === undefined ? " (the model config's eos_token_id)" : '';
    for (const e of eos) if (!Number.isInteger(e) || e < 0 || e >= V) throw argumentError('eos', `token ${e}${eosFrom} is outside the vocabulary [0, ${V})`);
    let state: SpecState | undefined;
    if (spec !== 'greedy') {
      const drafter = await this.drafter(options.drafter ?? 'ngram');
      if (drafter.vocabSize !== V) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${drafter.name} has a vocabulary of ${drafter.vocabSize}, the target ${V}`, 'drafter');
      if (drafter.targetLayers !== undefined) {
        if (drafter.commit === undefined) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${drafter.name} reads target layers but has no commit() to receive them`, 'drafter');
        const bad = drafter.targetLayers.find((l) => !Number.isInteger(l) || l < 0 || l >= this.config.numLayers);
        if (bad !== undefined) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${drafter.name} reads target layer ${bad}, outside the target's ${this.config.numLayers} layers`, 'drafter');
        if (this.tp > 1) throw argumentError('drafter', `drafter ${drafter.name} reads the target's hidden states, which the engine taps on one device only; use tp 1`);
      }
      const maxDepth = Math.min(this.options.maxDepth, drafter.maxDepth);
      const depthBound = drafter.maxDepth < this.options.maxDepth ? `the deepest draft of ${drafter.name}` : "the engine's maxDepth";
      const depth = checkInt('depth', options.depth ?? Math.min(drafter.defaultDepth ?? 4, this.options.maxDepth), 1, maxDepth, depthBound);
      const budget = options.budget ?? 16;
      // a tree cannot hold more nodes than the vocabulary offers at its depths (depth 1: V)
      const holds = spec === 'ddtree' ? treeCapacity(V, depth) : Infinity;
      if (budget === 'auto') {
        if (spec !== 'ddtree') throw argumentError('budget', "'auto' chooses a DDTree budget; chain decoding takes a number");
      } else if (holds < this.options.maxBudget) checkInt('budget', budget, 1, holds, `a tree of depth ${depth} over ${V} tokens holds ${holds} nodes`);
      else checkInt('budget', budget, 1, this.options.maxBudget, "the engine's maxBudget");
      state = { drafter, depth, budget };
    }
    const lookahead = this.scratchSlots({ spec, budget: state?.budget, depth: state?.depth });
    if (tokens.length + maxNew + lookahead > cap) {
      // a cache already as long as the model's positions cannot grow: only a shorter request fits
      const room = cap >= this.config.maxPositionEmbeddings ? "the model's max_position_embeddings" : 'cacheTokens; kdtree run --cache-tokens';
      throw new EngineError('KDTREE_ENGINE_CAPACITY', `prompt (${tokens.length}) + maxNew (${maxNew}) + a step's ${lookahead} scratch slots exceed the KV cache of ${cap} tokens (${room})`, 'maxNew');
    }
    // queued behind other generations until its turn: an abort or a dispose() meanwhile ends it there
    const release = await this.lock(options.signal === undefined ? [this.closing.signal] : [this.closing.signal, options.signal]).catch((error: unknown) => {
      this.checkOpen();
      this.checkAbort(options.signal);
      throw error;
    });
    try {
      this.checkOpen();
      this.checkRanks();
      return yield* this.decode(tokens, maxNew, eos, spec, state, options);
    } catch (error) {
      throw await this.rankFailureOr(error);
    } finally {
      release();
    }
  }

  /**
   * The KV cache slots a step of a generation with these options holds beyond the sequence (the
   * chain or tree it verifies; 1 for greedy). A generation fits when prompt + maxNew + this is at
   * most `cacheTokens`, so `cacheTokens - prompt - scratchSlots(options)` is the most it may ask
   * for (what a server offers as the room left in its context).
   */
  scratchSlots(options: Pick<GenerateOptions, 'spec' | 'budget' | 'depth'> = {}): number {
    if ((options.spec ?? 'greedy') === 'greedy') return 1;
    const budget = options.budget ?? 16;
    return Math.max(options.depth ?? 4, budget === 'auto' ? this.options.maxBudget : budget) + 1;
  }

  /**
   * One forward pass over `tokens` (a new sequence, at most the workspace's rows): the logits of
   * every position [T, vocab] and the residual stream after each layer [T, hidden] (what
   * transformers returns as hidden_states[1:]), for checking the engine against a reference.
   */
  async teacherForced(tokens: readonly number[]): Promise<{ logits: Float32Array; hidden: Float32Array[] }> {
    const ids = this.checkPrompt(tokens, 'tokens');
    const rows = this.model.workspace.rows;
    if (ids.length > this.options.cacheTokens) throw new EngineError('KDTREE_ENGINE_CAPACITY', `${ids.length} tokens exceed the KV cache of ${this.options.cacheTokens} (cacheTokens)`, 'tokens');
    if (ids.length > rows) throw argumentError('tokens', `at most ${rows} tokens in one pass (createEngine's prefillChunk / maxBudget), got ${ids.length}`);
    const release = await this.lock();
    const b = this.backend;
    const c = this.config;
    const T = ids.length;
    const taps = new Map<number, DeviceTensor>();
    let logits: DeviceTensor | undefined;
    try {
      this.checkOpen();
      return await this.guarded(() => {
        for (let l = 0; l < c.numLayers; l++) taps.set(l, b.empty('f32', [T, c.hiddenSize]));
        const out = b.empty('f32', [T, c.vocabSize]);
        logits = out;
        // one pass and its reads under the collective's watchdog
        return this.runner.guarded(() => {
          this.runner.teacherForced(ids, 0, out, taps);
          return { logits: b.toArray(out) as Float32Array, hidden: [...taps.values()].map((t) => b.toArray(t) as Float32Array) };
        });
      });
    } finally {
      b.free(...taps.values(), ...(logits ? [logits] : []));
      release();
    }
  }

  /**
   * Where a decode step's device time goes, by part of the forward (embedding, each layer's
   * attention and MLP or MoE, lm_head), after a prefill of `prompt`; the ops run directly with an
   * event between parts. The step runs twice and the second is reported: a kernel's first direct
   * launch may include loading its module (tens of milliseconds on a GPU), which is not its speed.
   * Leaves no sequence behind.
   */
  async profileDecode(prompt: readonly number[]): Promise<{ part: string; ms: number }[]> {
    const tokens = this.checkPrompt(prompt);
    if (this.tp > 1) throw argumentError('profileDecode', 'profiles one device; it does not run under tensor parallelism (tp > 1)');
    if (tokens.length + 3 > this.options.cacheTokens) throw argumentError('prompt', `needs ${tokens.length + 3} cache slots, the cache has ${this.options.cacheTokens}`);
    const release = await this.lock();
    try {
      this.checkOpen();
      this.runner.prefill(tokens, 0);
      this.runner.profileDecode();
      return this.runner.profileDecode();
    } finally {
      this.runner.committed = 0;
      release();
    }
  }

  /** Runs `generate` to the end and returns every token with the stats. */
  async complete(prompt: readonly number[], options: GenerateOptions): Promise<GenerationResult> {
    const it = this.generate(prompt, options);
    for (;;) {
      const r = await it.next();
      if (r.done) return r.value;
    }
  }

  private checkAbort(signal: AbortSignal | undefined): void {
    throwIfAborted(signal, 'the generation');
  }

  private async *decode(prompt: number[], maxNew: number, eos: Set<number>, spec: Spec, state: SpecState | undefined, o: GenerateOptions): AsyncGenerator<GenerationChunk, GenerationResult> {
    const r = this.runner;
    const out: number[] = [];
    const steps: StepTrace[] = [];
    const t0 = performance.now();
    let prefillMs = 0;
    let calibrationMs = 0;
    let forwards = 0;
    let stoppedBy: 'eos' | 'max' = 'max';
    const finish = (): GenerationResult => {
      const decodeMs = performance.now() - t0 - calibrationMs - prefillMs;
      const stepCount = Math.max(0, forwards - Math.ceil(prompt.length / this.options.prefillChunk));
      const stats: GenerationStats = {
        backend: this.backend.kind,
        device: this.device,
        tp: this.tp,
        spec,
        drafter: state?.drafter.name ?? null,
        tokensPerSecond: out.length > 1 && decodeMs > 0 ? ((out.length - 1) * 1000) / decodeMs : 0,
        prefillMs,
        calibrationMs,
        decodeMs,
        targetForwards: forwards,
        steps: stepCount,
        meanAcceptedLength: stepCount > 0 ? (out.length - 1) / stepCount : 0,
        stoppedBy,
      };
      return { tokens: out, stats, steps };
    };
    /** Appends `emitted` up to eos or maxNew; true when the generation is over. */
    const take = (emitted: number[]): { taken: number[]; done: boolean } => {
      const taken: number[] = [];
      for (const t of emitted) {
        if (out.length >= maxNew) break;
        out.push(t);
        taken.push(t);
        if (eos.has(t)) {
          stoppedBy = 'eos';
          return { taken, done: true };
        }
      }
      return { taken, done: out.length >= maxNew };
    };
    if (maxNew === 0) {
      const result = finish();
      yield { tokens: [], stats: result.stats };
      return result;
    }
    this.checkAbort(o.signal);
    this.checkOpen();
    // a drafter of hidden states: every target pass of this generation taps its layers (the runner
    // captures those steps as graphs of their own), and each committed row reaches commit()
    this.tapping = state?.drafter.targetLayers !== undefined ? state.drafter : undefined;
    r.taps = this.tapping === undefined ? undefined : this.tapsFor(this.tapping.targetLayers!);
    if (state?.budget === 'auto') {
      const curve = this.costs.get(state.depth);
      (state.policy = await this.budgetPolicy(state)).begin();
      // the curve measured now (once per depth), not a kept one
      if (this.costs.get(state.depth) !== curve) calibrationMs = performance.now() - t0;
    }
    state?.drafter.begin(prompt);
    this.resetHeldRows();
    // the prefill and its read under the collective's watchdog, its deadline one step's per chunk
    const firstToken = r.guarded(() => {
      r.prefill(prompt, 0, undefined, this.tapping && ((rows) => this.commitRows(rows)));
      return r.readToken();
    }, r.prefillPasses(prompt.length));
    forwards += Math.ceil(prompt.length / this.options.prefillChunk);
    const first = take([firstToken]);
    prefillMs = performance.now() - t0 - calibrationMs;
    if (first.done) {
      const result = finish();
      yield { tokens: first.taken, stats: result.stats };
      return result;
    }
    // greedy on one device decodes a step ahead (plainStep): the first step is queued before the
    // prefill's token is handed out
    if (state === undefined && this.runsAhead) this.launchPlain(false);
    try {
      yield { tokens: first.taken };
      // the sequence so far, for the drafter: grown by each step's tokens, not rebuilt every step
      const context = [...prompt, ...out];
      for (;;) {
        // a macrotask turn between steps: timers, socket closes and signals reach the signal's owner
        // even when the consumer awaits the next chunk at once
        await new Promise<void>((resolve) => setImmediate(resolve));
        this.checkAbort(o.signal);
        this.checkOpen();
        // whether a step may follow this one (its token is not the last maxNew allows)
        const more = out.length + 1 < maxNew;
        const step = state === undefined ? { emitted: [this.plainStep(false, more)] } : this.speculativeStep(spec, state, context, o.trace ?? false, more);
        forwards++;
        const { taken, done } = take(step.emitted);
        context.push(...taken);
        if (step.trace) steps.push(step.trace);
        if (done) {
          const result = finish();
          yield { tokens: taken, step: step.trace, stats: result.stats };
          return result;
        }
        yield { tokens: taken, step: step.trace };
      }
    } catch (error) {
      r.dropDecodesAhead(true);
      throw error;
    } finally {
      r.dropDecodesAhead();
    }
  }

  /**
   * A plain decode step (greedy's, or one of auto's between tries) and its token. On one device it
   * runs ahead: read from the step queued before (launched now if none was), and with `next` (the
   * next step is known to be a plain one too) that step queued before this one's token is read
   * (Runner.launchDecode), so the device does not wait for the host between them. Under tensor
   * parallelism, launched and read in turn under the collective's watchdog (a step's deadline, not
   * a prefill's). `hold`: one of auto's plain steps, whose row of the taps is held back (on the
   * device) for the tapping drafter's next commit instead of committed now.
   */
  private plainStep(hold: boolean, next: boolean): number {
    const r = this.runner;
    if (!this.runsAhead) {
      const token = r.guarded(() => {
        r.run({ kind: 'decode' });
        r.advance(1);
        return r.readToken();
      });
      this.commitRows(1);
      return token;
    }
    // a tapped row not held is committed after its step, before the next step overwrites the taps
    if (this.tapping !== undefined && !hold) throw new Error('a plain step of a tapping drafter holds its row');
    if (r.decodesAhead === 0) this.launchPlain(hold);
    if (next) this.launchPlain(hold);
    return r.readDecoded();
  }

  /** Whether plain decode steps run ahead (plainStep): on one device, without a collective. */
  private get runsAhead(): boolean {
    return this.model.collective === undefined;
  }

  /** Queues a plain decode step ahead of its read (Runner.launchDecode): held (see plainStep) where a drafter taps the target. */
  private launchPlain(hold: boolean): void {
    const held = hold && this.tapping !== undefined;
    if (held) this.prepareHeldRow();
    this.runner.launchDecode(held);
    if (held) this.heldRows++;
  }

  /** The tap buffers of `layers` (allocated on first use, for the workspace's rows). */
  private tapsFor(layers: readonly number[]): Map<number, DeviceTensor> {
    const taps = new Map<number, DeviceTensor>();
    for (const l of layers) {
      let t = this.tapBuffers.get(l);
      if (t === undefined) {
        t = this.runner.own(this.backend.empty('f32', [this.model.workspace.rows, this.config.hiddenSize]));
        this.tapBuffers.set(l, t);
      }
      taps.set(l, t);
    }
    return taps;
  }

  /**
   * Hands the tapping drafter the first `n` rows of the last pass's taps (the committed tokens, in
   * order: a prefill chunk, a decode step, a chain's accepted nodes, or a tree's once
   * leadTreePath moved them there), after the rows held back before them.
   */
  private commitRows(n: number): void {
    const drafter = this.tapping;
    if (drafter === undefined) return;
    this.commitHeldTaps();
    const H = this.config.hiddenSize;
    drafter.commit!(drafter.targetLayers!.map((l) => view(this.tapBuffers.get(l)!, [n, H])), n);
  }

  /**
   * A tree step's accepted nodes `path` (rising node indices, from the root's 0) to the leading
   * rows of each tap, in place on the device: kv_commit's move of a path's rows, one launch for
   * every tapped layer where a copy per row and layer would each be a native call. A path that is
   * already 0, 1, 2, ... (the drafter's top chain accepted) moves nothing and launches nothing.
   */
  private leadTreePath(path: Int32Array): void {
    const drafter = this.tapping;
    if (drafter === undefined || path.every((node, k) => node === k)) return;
    const t = this.tree;
    const caches = [...new Set(drafter.targetLayers!)].map((l) => this.tapBuffers.get(l)!);
    this.backend.native.kvCommit({ caches, path: view(t.path, [t.path.shape[0]]), pathLen: t.pathLen, start: 0 });
  }

  /** Makes room for one more held row (committing the held ones when full), allocating the held rows on first use. */
  private prepareHeldRow(): void {
    const drafter = this.tapping!;
    const r = this.runner;
    const H = this.config.hiddenSize;
    if (this.heldNext === undefined) this.heldNext = r.own(this.backend.zeros('i32', [1]));
    for (const l of drafter.targetLayers!) {
      if (!this.heldTaps.has(l)) this.heldTaps.set(l, r.own(this.backend.empty('f32', [this.heldCapacity, H])));
    }
    r.held = { rows: this.heldTaps, next: this.heldNext };
    if (this.heldRows === this.heldCapacity) this.commitHeldTaps();
  }

  /** Hands the tapping drafter the rows held back during plain decode steps, in order. */
  private commitHeldTaps(): void {
    const n = this.heldRows;
    if (n === 0) return;
    this.resetHeldRows();
    const H = this.config.hiddenSize;
    this.tapping!.commit!(this.tapping!.targetLayers!.map((l) => view(this.heldTaps.get(l)!, [n, H])), n);
  }

  /**
   * No rows held: the host's count and the device's next row back to 0 (queued on stream 0 after
   * the held steps and the commit that read their rows: an upload from the host would wait for them).
   */
  private resetHeldRows(): void {
    this.heldRows = 0;
    if (this.heldNext !== undefined) this.backend.native.arange({ out: this.heldNext, start: 0, stream: 0 });
  }

  /** A step of chain or DDTree decoding, or one of auto's plain decode steps; `more`: a step may follow it. */
  private speculativeStep(spec: Spec, state: SpecState, context: number[], trace: boolean, more: boolean): { emitted: number[]; trace?: StepTrace } {
    const r = this.runner;
    const b = this.backend;
    const V = this.config.vocabSize;
    const { drafter, depth, policy } = state;
    if (policy !== undefined && !policy.tryNow()) {
      // the last tries found nothing: plain decode steps pay for them before the next try (the
      // next one queued ahead while the wait goes on)
      const token = this.plainStep(true, more && policy.wait > 0);
      return { emitted: [token], trace: trace ? { draftTop1: [], treeSize: 1, accepted: 0, budget: 0 } : undefined };
    }
    // a try drafts from the tokens read so far: no plain step is queued ahead of it
    if (r.decodesAhead !== 0) throw new Error('a try with a decode step queued ahead');
    const draftLogits = view(this.draftLogits, [depth, V]);
    // auto: the best tree of the largest budget, only for its nodes' probabilities (its prefixes are
    // the best smaller trees), built first only as far as one launch builds (firstBuild) where the
    // policy can tell that nodes past those cannot change its plan (decides); the builds and their
    // read-backs are timed with the draft, as a try pays them, and so is the commit of the rows
    // held back during a wait (up to HELD_TAP_ROWS: after a long wait it may cost more than the draft)
    // a budget planned from the last tree's probabilities (BudgetPolicy.planFromLast), else a
    // sticky one (BudgetPolicy.sticky), runs without a plan: the draft only, timed where planned
    // from the last tree and the policy wants a sample of the draft's cost (sampleDue: a timing
    // is three native calls, a tenth of a small model's step), and read once the step's read back
    // has waited for the device anyway, or at once where the drafter proposed nothing. A drafter
    // that knows its tree on the host (Drafter.treeLogProbs) plans every try afresh instead: its
    // plan builds nothing on the device and reads nothing back before the verify, and its last tree
    // says little of this one (prompt lookup's matches change from token to token); its draft is
    // timed as one planned from the last tree is
    const hostPlans = policy !== undefined && drafter.treeLogProbs !== undefined;
    const fromLast = hostPlans ? undefined : policy?.planFromLast();
    const sticky = fromLast === undefined && !hostPlans ? policy?.sticky() : undefined;
    const planner = fromLast === undefined && sticky === undefined ? policy : undefined;
    const timed = (fromLast !== undefined || hostPlans) && policy!.sampleDue();
    // false: the drafter proposes nothing this step (typed without narrowing: set in the closures)
    let proposes = true as boolean;
    const draft = () => {
      proposes = drafter.draft({ tokens: context, depth, out: draftLogits, rootOnDevice: r.token }) !== false;
    };
    // (assigned in the timed closure below: typed without narrowing to its initial value)
    let logProbs = undefined as Float32Array | undefined;
    const work = () => {
      this.commitHeldTaps();
      draft();
    };
    if (planner === undefined || hostPlans) {
      if (timed) this.markTry(work);
      else work();
      if (hostPlans && proposes) logProbs = drafter.treeLogProbs!(policy!.largestUseful);
      else if (hostPlans) policy!.recordSilent(timed ? this.triedMs() : undefined);
    } else {
      const largest = planner.largestUseful;
      const first = this.firstBuild(depth, largest);
      const ms = this.timeTry(() => {
        this.commitHeldTaps();
        draft();
        if (proposes) logProbs = this.buildForLogProbs(draftLogits, first);
      });
      if (proposes) planner.updateDraftMs(ms);
      else planner.recordSilent(ms);
      if (proposes && first < largest && !planner.decides(logProbs!)) {
        const more = this.timeTry(() => {
          logProbs = this.buildForLogProbs(draftLogits, largest);
        });
        planner.amendDraftMs(more);
      }
    }
    if (!proposes) {
      // the tree would be all guesses: a plain step emits the same one token. For auto the try
      // proposed nothing (its draft paid by a wait; recorded above where it was planned), or a
      // sticky run ends
      if (fromLast !== undefined) policy!.recordSilent(timed ? this.triedMs() : undefined);
      if (sticky !== undefined) policy!.recordSticky(0);
      const token = this.plainStep(true, more && (policy?.wait ?? 0) > 0);
      return { emitted: [token], trace: trace ? { draftTop1: [], treeSize: 1, accepted: 0, budget: 0 } : undefined };
    }
    let draftTop1: number[] = [];
    if (trace) {
      b.native.argmax({ x: draftLogits, out: view(this.draftTop1, [depth]) });
      draftTop1 = Array.from((b.toArray(this.draftTop1) as Int32Array).subarray(0, depth));
    }
    let budget: number;
    let probe = false;
    if (planner !== undefined && logProbs !== undefined) {
      ({ budget, probe } = planner.plan(logProbs));
      if (budget === 0) {
        // no tree worth running: the policy waits a while before the next try, sized by its cost
        if (timed) planner.updateDraftMs(this.triedMs());
        planner.record(logProbs, 0, 0);
        const token = this.plainStep(true, more && planner.wait > 0);
        return { emitted: [token], trace: trace ? { draftTop1, treeSize: 1, accepted: 0, budget: 0 } : undefined };
      }
    } else budget = fromLast ?? sticky ?? (state.budget as number);
    const n = spec === 'chain' ? Math.min(budget, depth) + 1 : budget + 1;
    // the verify and its reads under the collective's watchdog; the draft above is not a collective's wait
    const { pathLen, path, emitted, treeLogProbs } = r.guarded(() => {
      r.run(spec === 'chain' ? { kind: 'chain', length: n - 1 } : { kind: 'tree', budget, depth });
      // one read: [pathLen, bonus, path (nodes), tokens (nodes), the tree's log-probs (nodes, f32)]
      const back = b.toArray(this.tree.readBack) as Int32Array;
      const nodes = this.tree.tokens.shape[0];
      const pathLen = back[0];
      const path = back.subarray(2, 2 + pathLen);
      const tokens = back.subarray(2 + nodes);
      // root excluded (auto's: a DDTree step's)
      const treeLogProbs = policy === undefined ? undefined : new Float32Array(back.buffer, back.byteOffset + (2 + 2 * nodes) * 4, n).slice(1);
      return { pathLen, path, emitted: [...Array.from(path.subarray(1), (i) => tokens[i]), back[1]], treeLogProbs };
    });
    r.advance(pathLen);
    this.leadTreePath(path);
    this.commitRows(pathLen);
    if (planner !== undefined && logProbs !== undefined) {
      if (timed) planner.updateDraftMs(this.triedMs());
      planner.record(logProbs, budget, pathLen - 1, probe);
    }
    else if (fromLast !== undefined) {
      if (timed) policy!.updateDraftMs(this.triedMs());
      policy!.record(treeLogProbs!, budget, pathLen - 1);
    } else if (sticky !== undefined) policy!.recordSticky(pathLen - 1, treeLogProbs);
    return { emitted, trace: trace ? { draftTop1, treeSize: n, accepted: pathLen - 1, budget } : undefined };
  }

  /** The best tree of `budget` nodes under the draft, built for its nodes' cumulative log-probabilities (root excluded), read back. */
  private buildForLogProbs(draftLogits: DeviceTensor, budget: number): Float32Array {
    const b = this.backend;
    const r = this.runner;
    const t = this.tree;
    const nodes = (x: DeviceTensor) => view(x, [budget + 1]);
    b.native.ddtreeBuild({
      draftLogits, rootOnDevice: r.token, budget, startOnDevice: r.cache.length[0],
      tokens: nodes(t.tokens), parents: nodes(t.parents), depths: nodes(t.depths), positions: nodes(t.positions), mask: view(t.mask, [budget + 1, budget + 1]), size: t.size, logProbs: nodes(t.logProbs),
    });
    return (b.toArray(t.logProbs) as Float32Array).subarray(1, budget + 1);
  }

  /**
   * The budget of auto's first build at `depth`: the largest bucket up to `largest` that the cuda
   * backend builds in one launch (dispatchPolicy's cluster or fused build; the same rule on the cpu twin, so
   * both run the same steps), or `largest` itself.
   */
  private firstBuild(depth: number, largest: number): number {
    const key = `${depth} ${largest}`;
    let first = this.firstBuilds.get(key);
    if (first !== undefined) return first;
    const V = this.config.vocabSize;
    // the build's rule reads no device property (sms and sm90a are the query's fields for GEMMs)
    const one = (k: number) => this.backend.loaded.module.dispatchPolicy({ op: 'ddtreeBuild', m: depth, n: V, k, sms: 1, sm90a: false }).form !== 'passes';
    first = largest;
    if (!one(largest)) for (const k of BUDGET_BUCKETS) if (k < largest && one(k)) first = k;
    this.firstBuilds.set(key, first);
    return first;
  }

  /** Device milliseconds from before `fn`'s work to after it, on stream 0 (the engine's two try events). */
  private timeTry(fn: () => void): number {
    this.markTry(fn);
    return this.triedMs();
  }

  /** Records the try events around `fn`'s work on stream 0; triedMs reads them (waiting for the second). */
  private markTry(fn: () => void): void {
    const n = this.backend.native;
    this.tryEvents ??= [n.createEvent(), n.createEvent()];
    n.recordEvent(this.tryEvents[0], 0);
    fn();
    n.recordEvent(this.tryEvents[1], 0);
  }

  private triedMs(): number {
    const [start, end] = this.tryEvents!;
    return this.backend.native.elapsedMs(start, end);
  }

  /**
   * The policy budget 'auto' keeps for `drafter` at `depth` (its calibration over the cost curve),
   * undefined before the drafter's first auto generation at that depth.
   */
  autoPolicy(drafter: Drafter, depth: number): BudgetPolicy | undefined {
    return this.autoPolicies.get(drafter)?.get(depth);
  }

  /**
   * The verify cost curve on this backend at this depth (measured once: each bucket's captured tree
   * step timed on a scratch sequence, before the generation's prefill overwrites it) and the
   * drafter's policy over it (made at its first auto generation at this depth, then kept).
   */
  private async budgetPolicy(state: SpecState): Promise<BudgetPolicy> {
    let byDepth = this.autoPolicies.get(state.drafter);
    if (byDepth === undefined) this.autoPolicies.set(state.drafter, (byDepth = new Map()));
    const kept = byDepth.get(state.depth);
    if (kept !== undefined) return kept;
    let curve = this.costs.get(state.depth);
    if (curve === undefined) {
      curve = this.measureCosts(state.depth);
      this.costs.set(state.depth, curve);
    }
    const policy = new BudgetPolicy(curve, 0, state.depth);
    byDepth.set(state.depth, policy);
    return policy;
  }

  /** Median device milliseconds of `launch` over a few runs, each on a fresh scratch sequence of 64 tokens. */
  private timeStep(launch: () => void): number {
    const r = this.runner;
    const times: number[] = [];
    // cuda: a warm-up, then four timed runs; the cpu twin has nothing to warm and one run is steady
    const cuda = this.backend.kind === 'cuda';
    for (let rep = 0; rep < (cuda ? 5 : 1); rep++) {
      r.committed = Math.min(64, this.options.cacheTokens - this.options.maxBudget - 2);
      const ms = this.backend.time(launch);
      if (rep > 0 || !cuda) times.push(ms);
    }
    return times.sort((a, b) => a - b)[Math.floor(times.length / 2)];
  }

  measureCosts(depth: number): CostCurve {
    const r = this.runner;
    const V = this.config.vocabSize;
    // draft logits that spread the tree over many tokens, as a real draft's alternatives do
    const noise = new Float32Array(depth * V);
    let x = 0x2545f491;
    for (let i = 0; i < noise.length; i++) {
      x ^= x << 13;
      x ^= x >>> 17;
      x ^= x << 5;
      noise[i] = ((x >>> 0) / 2 ** 32) * 4;
    }
    this.backend.native.upload(this.draftLogits.buffer, noise);
    const decodeMs = this.timeStep(() => r.run({ kind: 'decode' }));
    const verifyMs = new Map<number, number>();
    const buckets = bucketsUpTo(Math.min(this.options.maxBudget, treeCapacity(this.config.vocabSize, depth)));
    // the cpu twin's steps are compute-bound, nearly linear in the nodes: every third bucket and
    // the last are timed, the others interpolated (a verify of 65 nodes there takes most of a second)
    const timed = this.backend.kind === 'cuda' ? buckets : buckets.filter((_, i) => i % 3 === 0 || i === buckets.length - 1);
    for (const budget of timed) verifyMs.set(budget, this.timeStep(() => r.run({ kind: 'tree', budget, depth })));
    for (const budget of buckets) {
      if (verifyMs.has(budget)) continue;
      const lo = Math.max(...timed.filter((t) => t < budget));
      const hi = Math.min(...timed.filter((t) => t > budget));
      verifyMs.set(budget, verifyMs.get(lo)! + ((verifyMs.get(hi)! - verifyMs.get(lo)!) * (budget - lo)) / (hi - lo));
    }
    r.committed = 0;
    return { decodeMs, verifyMs };
  }

  /**
   * Ends the engine: queued generations reject with KDTREE_ENGINE_DISPOSED at once, a running one
   * at its next step (an iterator its consumer has paused ends when it is resumed or closed, and
   * the engine waits for that), then the device memory is freed. Idempotent.
   */
  dispose(): Promise<void> {
    this.closing.abort();
    this.disposal ??= this.close();
    return this.disposal;
  }

  private async close(): Promise<void> {
    const release = await this.lock();
    try {
      for (const d of this.drafters.values()) {
        try {
          (await d).dispose();
        } catch {
          // a drafter that failed to load holds nothing
        }
      }
      this.drafters.clear();
      // a rank's failure (recorded before the close, or by it: a rank that had to be killed) means
      // a peer may be gone, and NCCL's destroy could wait on it: the communicator is aborted then
      const peerFailed = this.group?.failure() !== undefined;
      await this.group?.close();
      if (this.tryEvents !== undefined) for (const e of this.tryEvents) this.backend.native.destroyEvent(e);
      this.tryEvents = undefined;
      this.runner.dispose();
      this.model.dispose();
      if (this.model.collective instanceof NcclCollective) this.model.collective.close(peerFailed || this.group?.failure() !== undefined);
    } finally {
      release();
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.dispose();
  }
}

/** A drafter object as the engine needs it: the interface's members, its sizes positive integers. */
function checkDrafter(d: Drafter): Drafter {
  if (typeof d !== 'object' || d === null || typeof d.draft !== 'function') {
    throw argumentError('drafter', `expected 'ngram', 'model:PATH', 'dflash:PATH' or a Drafter (an object with draft()), got ${d === null ? 'null' : typeof d}`);
  }
  const missing = ['begin', 'dispose', ...(d.targetLayers !== undefined ? ['commit'] : []), ...('treeLogProbs' in d ? ['treeLogProbs'] : [])].filter((m) => typeof (d as unknown as Record<string, unknown>)[m] !== 'function');
  if (missing.length > 0) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${String(d.name)}: ${missing.join(', ')} must be ${missing.length > 1 ? 'methods' : 'a method'}`, 'drafter');
  for (const key of ['vocabSize', 'maxDepth'] as const) {
    const v = d[key] as unknown;
    if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 1) throw new EngineError('KDTREE_ENGINE_DRAFTER', `drafter ${String(d.name)}: ${key} must be a positive integer, got ${String(v)}`, 'drafter');
  }
  return d;
}

const exists = (path: string) => stat(path).then(() => true, () => false);

/** The most nodes a tree of `depth` levels over `vocab` tokens holds: vocab + vocab^2 + ... (capped at 2^31). */
function treeCapacity(vocab: number, depth: number): number {
  let total = 0;
  let level = 1;
  for (let d = 0; d < depth && total < 2 ** 31; d++) {
    level *= vocab;
    total += level;
  }
  return Math.min(total, 2 ** 31);
}

/** Resolves with `wait`, or rejects as soon as one of `signals` aborts; its listeners are removed either way. */
function untilAborted(wait: Promise<void>, signals: readonly AbortSignal[]): Promise<void> {
  if (signals.length === 0) return wait;
  if (signals.some((s) => s.aborted)) return Promise.reject(new Error('aborted while queued'));
  return new Promise((resolve, reject) => {
    const detach = () => signals.forEach((s) => s.removeEventListener('abort', stop));
    const stop = () => {
      detach();
      reject(new Error('aborted while queued'));
    };
    signals.forEach((s) => s.addEventListener('abort', stop));
    void wait.then(() => {
      detach();
      resolve();
    });
  });
}

/** Opens the model, checks it fits, loads it on the chosen backend (on `tp` ranks when asked). */
export async function createEngine(options: EngineOptions): Promise<Engine> {
  const given = options?.model;
  if (!(typeof given === 'string' && given !== '') && !(typeof given === 'object' && given !== null && 'config' in given)) {
    throw argumentError('model', 'expected the path of a bundle or checkpoint, or a WeightReader');
  }
  const tp = checkInt('tp', options.tp ?? 1, 1, 64);
  const timeoutMs = checkInt('tpTimeoutMs', options.tpTimeoutMs ?? TP_TIMEOUT_MS, 100, 3_600_000);
  const localRanks = checkInt('tpLocalRanks', options.tpLocalRanks ?? tp, 1, tp);
  const master = options.tpMaster;
  if (master !== undefined && (typeof master !== 'object' || typeof master.host !== 'string' || master.host === '' || !Number.isSafeInteger(master.port) || master.port < 0 || master.port > 65535)) {
    throw argumentError('tpMaster', `expected { host, port } with a TCP port in [0, 65535], got ${JSON.stringify(master)}`);
  }
  const spread = localRanks < tp || master !== undefined;
  if (options.tpRanks !== undefined && options.tpRanks !== 'threads' && options.tpRanks !== 'processes') throw argumentError('tpRanks', `expected 'threads' or 'processes', got '${String(options.tpRanks)}'`);
  if (spread && options.tpRanks === 'threads') throw argumentError('tpRanks', 'ranks that join from other nodes (tpLocalRanks < tp, or tpMaster) run as processes; use tpRanks: processes');
  const faultText = options.tpFault ?? process.env.KDTREE_TP_FAULT;
  const fault: TpFault | undefined = tp > 1 && faultText ? parseTpFault(faultText, tp) : undefined;
  if (tp > 1 && typeof given !== 'string') throw argumentError('model', 'tensor parallelism (tp > 1) needs the path of a bundle or checkpoint, which every rank reads its shard of');
  if (options.device !== undefined) checkInt('device', options.device, 0, 2 ** 31 - 1);
  const backend = options.backend instanceof KdtreeBackend ? options.backend : createBackend({ backend: options.backend, device: options.device, log: options.log });
  const cuda = tp > 1 && backend.kind === 'cuda';
  if (cuda && options.tpRanks === 'threads') throw argumentError('tpRanks', 'ranks on the cuda backend are processes, one per device; use tpRanks: processes');
  // one process per device: rank 0 is local rank 0 on device 0 (CUDA_VISIBLE_DEVICES picks the devices)
  if (cuda && (options.device ?? 0) !== 0) throw argumentError('device', `under tp > 1 each rank runs on the device of its local rank (rank 0 on device 0), got device ${options.device}; pick the devices with CUDA_VISIBLE_DEVICES`);
  if (cuda) rankDevice(0, localRanks, backend.loaded.probe?.deviceCount ?? 0);
  const ranks: TpRanks = options.tpRanks ?? (spread || cuda ? 'processes' : 'threads');
  const shard: Shard = { rank: 0, world: tp };
  const source = typeof given === 'string' ? await openModelAt(given, { config: options.config, shard }) : given;
  let group: TpGroup | undefined;
  let collective: Collective | undefined;
  try {
    const c = source.config;
    if (c.maxPositionEmbeddings < 2) throw modelError('max_position_embeddings', `must be at least 2 (a prompt token and the next), got ${c.maxPositionEmbeddings}`, typeof given === 'string' ? given : 'the model');
    const cacheTokens = checkInt('cacheTokens', options.cacheTokens ?? Math.min(4096, c.maxPositionEmbeddings), 2, c.maxPositionEmbeddings, "the model's max_position_embeddings");
    // f32 on the cpu twin, where memory is plentiful and the cache then matches the f32 reference
    const cacheDtype = options.cacheDtype ?? (backend.kind === 'cuda' ? 'bf16' : 'f32');
    if (cacheDtype !== 'bf16' && cacheDtype !== 'f32') throw argumentError('cacheDtype', `expected 'bf16' or 'f32', got '${String(cacheDtype)}'`);
    const activations = options.activations ?? (backend.kind === 'cuda' ? 'bf16' : 'f32');
    if (activations !== 'bf16' && activations !== 'f32') throw argumentError('activations', `expected 'bf16' or 'f32', got '${String(activations)}'`);
    const prefillChunk = checkInt('prefillChunk', options.prefillChunk ?? Math.min(cacheTokens, backend.kind === 'cuda' ? 2048 : 64), 1, 8192);
    const maxBudget = checkInt('maxBudget', options.maxBudget ?? 64, 1, 1024);
    const maxDepth = checkInt('maxDepth', options.maxDepth ?? 16, 1, 64);
    const nodes = Math.max(maxBudget, maxDepth) + 1;
    const rows = Math.max(prefillChunk, nodes);
    const memory = estimateMemory(source, { capacity: cacheTokens, cacheDtype, rows, nodes, depth: maxDepth, shard });
    // the cpu ranks share this host's memory: its ranks' shards must fit together (a GPU rank has a device of its own)
    checkFits(backend, tp > 1 && !cuda ? scaleEstimate(memory, localRanks) : memory, tp > 1 ? `${source.path} on ${tp} ranks` : source.path);
    if (tp > 1) {
      const gatherFloats = rows * Math.ceil(c.vocabSize / tp);
      // the collectives of cuda ranks go over NCCL: their relays carry only commands and reports
      const slotFloats = cuda ? 1 : Math.max(rows * c.hiddenSize, gatherFloats, Math.ceil((nodes * (nodes + 16) + 4) / 4));
      const ncclId = cuda ? ncclIdHex(backend.ncclUniqueId()) : undefined;
      const setup = { model: given as string, config: options.config, rows, activations, cacheTokens, cacheDtype, prefillChunk, nodes, maxDepth, backend: backend.kind };
      group = await TpGroup.start(tp, setup, { slotFloats, timeoutMs, fault, ranks, localRanks, master, ncclId });
      if (cuda) {
        // ncclCommInitRank blocks this thread until every rank has called it: only once every rank
        // has connected (the relay thread, which serves them, does not wait on this one), and
        // bounded by that relay, which ends this process if a rank fails meanwhile
        await group.joined();
        const g = group;
        collective = g.blocking(() => new NcclCollective(backend, { rank: 0, world: tp, id: ncclIdBytes(ncclId), timeoutMs, gatherFloats }));
        g.guardSteps();
      } else collective = new HostCollective(backend, group.transport);
    }
    const model = await loadRank0(backend, source, { rows, activations, shard, collective, onProgress: options.onLoadProgress, signal: options.signal }, group);
    try {
      return new Engine(backend, model, { path: source.path, configJson: source.configJson }, { cacheTokens, cacheDtype, activations, prefillChunk, maxBudget, maxDepth }, memory, group);
    } catch (error) {
      model.dispose();
      throw error;
    }
  } catch (error) {
    await group?.close();
    // the run failed with its ranks: the communicator is aborted, not destroyed (a peer may be gone)
    if (collective instanceof NcclCollective) collective.close(true);
    // a load stopped through its signal (wherever the abort surfaced) is the engine's typed abort
    if (!(error instanceof EngineError && error.code === 'KDTREE_ENGINE_ABORTED')) throwIfAborted(options.signal, 'loading the model');
    throw error;
  } finally {
    await source.close();
  }
}

/** What the file system says of a model path the engine cannot open, by error code. */
const PATH_ERRORS: Record<string, string> = { ENOENT: 'no such file or directory', EACCES: 'permission denied', ENOTDIR: 'a path component is not a directory', ELOOP: 'too many symbolic links' };

/** openModel, with a model (or config) path that is not there or not readable as the engine's argument error naming it. */
async function openModelAt(path: string, options: { config?: string; shard?: Shard }): ReturnType<typeof openModel> {
  try {
    return await openModel(path, options);
  } catch (error) {
    const errno = error as NodeJS.ErrnoException;
    const what = typeof errno?.code === 'string' ? PATH_ERRORS[errno.code] : undefined;
    if (what === undefined) throw error;
    const field = options.config !== undefined && errno.path === options.config ? 'config' : 'model';
    throw new EngineError('KDTREE_ENGINE_ARGUMENT', `${field}: ${errno.path ?? path}: ${what}`, field, { cause: error });
  }
}

/** `estimate` for `ranks` ranks of about the same shard. */
function scaleEstimate(estimate: MemoryEstimate, ranks: number): MemoryEstimate {
  return { weights: estimate.weights * ranks, cache: estimate.cache * ranks, workspace: estimate.workspace * ranks, staging: estimate.staging * ranks, total: estimate.total * ranks };
}

/**
 * Loads rank 0's model while the worker ranks load theirs; a worker's failure stops rank 0's
 * load at its next part and is what is thrown.
 */
async function loadRank0(b: KdtreeBackend, source: WeightReader, options: Parameters<typeof DeviceModel.load>[2], group: TpGroup | undefined): Promise<DeviceModel> {
  if (group === undefined) return DeviceModel.load(b, source, options);
  const stop = new AbortController();
  const outer = options.signal;
  const onOuter = () => stop.abort(outer!.reason);
  outer?.addEventListener('abort', onOuter);
  const ready = group.ready(stop.signal).catch((error: unknown) => {
    stop.abort(error);
    throw error;
  });
  // awaited below, after rank 0's own load: handled, not an unhandled rejection meanwhile
  ready.catch(() => undefined);
  try {
    const model = await DeviceModel.load(b, source, { ...options, signal: stop.signal }).catch(async (error: unknown) => {
      // stopped because a worker failed: that failure; else rank 0's own error (the workers stop)
      const workerFailure = stop.signal.aborted ? group.failure() : undefined;
      stop.abort(error);
      await ready.catch(() => undefined);
      throw workerFailure ?? error;
    });
    try {
      await ready;
    } catch (error) {
      model.dispose();
      throw group.failure() ?? error;
    }
    return model;
  } finally {
    outer?.removeEventListener('abort', onOuter);
  }
}
