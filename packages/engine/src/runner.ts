/**
 * The steps of decoding one sequence on a DeviceModel, as the device runs them. The committed
 * length L and the last emitted token live on the device, so a decode step, a tree verify and a
 * drafter's chain are fixed lists of ops: each is captured once (per size) as a graph and replayed
 * with one host call per step. Prefill runs its ops directly, chunk by chunk.
 *
 * Every step runs on the default stream (graphs are captured on a stream of their own and launched
 * onto it), so steps, uploads and downloads are ordered without events.
 *
 *   decode      token -> forward(1) at position L -> argmax -> token; L += 1
 *   tree verify build(draft logits, root = token, start = L) -> forward(n nodes, tree mask, tree
 *               positions, slots L..L+n) -> argmax -> accept -> commit the path's KV; L += path
 *   chain       the same with the drafter's argmax at each depth as a chain (causal mask)
 *
 * Under tensor parallelism every rank has a Runner over its shard. Rank 0's (the engine's) sends
 * each state-changing call to the other ranks as a RankCommand (`peers`) before running it; they
 * run the same call (execute), so every rank queues the same ops and collectives in the same
 * order. Rank 0 alone drafts and builds a step's tree, and broadcasts it inside the step.
 */
import type { DeviceTensor, KdtreeBackend } from '@kdtree/cuda';
import { captureStep, HostCollective, type StepGraph } from './collective.js';
import { KvCache, type CacheDtype } from './kv-cache.js';
import type { Pass } from './layers.js';
import { view } from './linear.js';
import type { DeviceModel } from './model.js';

/** The device arrays of a draft tree of up to `nodes` nodes (DDTree's build and accept outputs). */
export interface TreeBuffers {
  tokens: DeviceTensor;
  parents: DeviceTensor;
  depths: DeviceTensor;
  positions: DeviceTensor;
  mask: DeviceTensor;
  size: DeviceTensor;
  /** Views of readBack: the accepted path (node indices) and its length. */
  path: DeviceTensor;
  pathLen: DeviceTensor;
  /**
   * i32 [2 + 3 nodes] = [pathLen, bonus, path (nodes), tokens (nodes), logProbs (nodes, f32 bits)]:
   * all a step's host needs back, in one buffer, so a speculative step reads once (each read waits
   * for the stream and costs the host a native call); `tokens`, `path`, `pathLen` and `logProbs`
   * are views of it.
   */
  readBack: DeviceTensor;
  /** f32 [nodes, vocab] and i32 [nodes]: the verify's logits and argmax. */
  logits: DeviceTensor;
  argmax: DeviceTensor;
  /**
   * f32 [nodes]: the tree's nodes' cumulative draft log-probabilities, root first (what budget
   * 'auto' plans from: a tree step writes its tree's, beside the path it reads back).
   */
  logProbs: DeviceTensor;
}

/** The captured steps a generation launches. */
export type StepKey = { kind: 'decode'; held?: boolean } | { kind: 'tree'; budget: number; depth: number } | { kind: 'chain'; length: number };

/** What rank 0's Runner asks the other ranks' Runners to do (see execute). */
export type RankCommand =
  | { op: 'prefill'; tokens: number[]; start: number; logits: boolean }
  | { op: 'teacherForced'; tokens: number[]; start: number }
  | { op: 'committed'; length: number }
  | { op: 'advance'; count: number }
  | { op: 'step'; step: StepKey };

/** The other ranks, as rank 0 sees them: each command reaches every one, in order. */
export interface RankPeers {
  send(command: RankCommand): void;
}

export class Runner {
  readonly cache: KvCache;
  /** i32 [1]: the last emitted token, not yet in the cache (the next step's input or tree root). */
  readonly token: DeviceTensor;
  /** i32 [rows] each: prefill ids, positions and slots. */
  private readonly ids: DeviceTensor;
  private readonly positions: DeviceTensor;
  private readonly prefillLogits: DeviceTensor;
  private readonly graphs = new Map<string, StepGraph>();
  private readonly owned: DeviceTensor[] = [];
  private captureStream = -1;
  /** Decoding a step ahead (launchDecode, readDecoded): the ring, events and read stream, made on first use. */
  private ahead: { ring: DeviceTensor; events: [number, number]; stream: number; host: Int32Array } | undefined;
  /** Steps launchDecode queued, and those readDecoded read. */
  private launched = 0;
  private read = 0;
  /** Rank 0's peers under tensor parallelism: they mirror every state-changing call. */
  peers: RankPeers | undefined;
  /**
   * Layer -> f32 [rows, hidden]: when set, every prefill chunk, decode, chain and tree step also
   * writes the residual stream after those layers of each of its rows there (a drafter that reads
   * the target's hidden states, DFlash). Steps captured with taps are other graphs than those
   * without (tapKey), so setting and clearing it between generations is safe.
   */
  taps: ReadonlyMap<number, DeviceTensor> | undefined;

  /**
   * Where a held decode step (`{ kind: 'decode', held: true }`: one of auto's plain decode steps
   * while a tapping drafter waits) also puts its row of each tap: layer -> f32 [rows, hidden], at
   * the row `next` (i32 [1]) holds, which the step then moves on. On the device, inside the step:
   * a copy by the host after the step would be a native call per tapped layer (six for Kimi
   * K2.5-DFlash) while the device waits for the next step.
   */
  held: { rows: ReadonlyMap<number, DeviceTensor>; next: DeviceTensor } | undefined;

  private get tapKey(): string {
    return this.taps === undefined ? '' : ` taps ${[...this.taps.keys()].join(',')}`;
  }

  /** The tree and draft logits the keyed steps (step()) use. */
  private stepBuffers: { tree: TreeBuffers; draftLogits: DeviceTensor } | undefined;

  constructor(
    readonly b: KdtreeBackend,
    readonly model: DeviceModel,
    capacity: number,
    cacheDtype: CacheDtype,
    /** Tokens per prefill pass (at most the workspace's rows). */
    readonly prefillRows = model.workspace.rows,
  ) {
    this.cache = new KvCache(b, model.config, capacity, cacheDtype);
    const rows = model.workspace.rows;
    try {
      this.token = this.own(b.zeros('i32', [1]));
      this.ids = this.own(b.zeros('i32', [rows]));
      this.positions = this.own(b.zeros('i32', [rows]));
      this.prefillLogits = this.own(b.empty('f32', [1, model.config.vocabSize]));
    } catch (error) {
      this.dispose();
      throw error;
    }
  }

  own<T extends DeviceTensor>(t: T): T {
    this.owned.push(t);
    return t;
  }

  get capacity(): number {
    return this.cache.capacity;
  }

  /** Committed tokens (host mirror of the device's L). */
  get committed(): number {
    return this.cache.committed[0];
  }

  set committed(length: number) {
    this.peers?.send({ op: 'committed', length });
    this.cache.setLength(0, length);
  }

  /** Moves the host mirror along after a step that advanced L on the device. */
  advance(count: number): void {
    this.peers?.send({ op: 'advance', count });
    this.cache.committed[0] += count;
  }

  /** `work` (`passes` forward passes) under the collective's watchdog (Collective.guard), or as it is without one. */
  guarded<T>(work: () => T, passes = 1): T {
    const c = this.model.collective;
    return c?.guard ? c.guard(work, passes) : work();
  }

  /** The forward passes a prefill of `tokens` runs: one per chunk of the workspace's rows. */
  prefillPasses(tokens: number): number {
    return Math.ceil(tokens / this.prefillRows);
  }

  /** The forward passes `command` runs (what its guard's deadline scales with); 0: none, only host state. */
  passes(command: RankCommand): number {
    switch (command.op) {
      case 'prefill':
        return this.prefillPasses(command.tokens.length);
      case 'teacherForced':
      case 'step':
        return 1;
      default:
        return 0;
    }
  }

  /** Runs a command of rank 0's Runner on this rank (a tensor-parallel peer). */
  execute(command: RankCommand): void {
    switch (command.op) {
      case 'prefill':
        this.prefill(command.tokens, command.start, command.logits ? this.prefillLogits : undefined);
        return;
      case 'teacherForced': {
        const logits = this.b.empty('f32', [command.tokens.length, this.model.config.vocabSize]);
        try {
          this.teacherForced(command.tokens, command.start, logits, new Map());
        } finally {
          this.b.free(logits);
        }
        return;
      }
      case 'committed':
        this.committed = command.length;
        return;
      case 'advance':
        this.advance(command.count);
        return;
      case 'step':
        this.run(command.step);
    }
  }

  private pass(t: number, positions: DeviceTensor, slots: DeviceTensor, base: number, stream: number, extra: Partial<Pass> = {}): Pass {
    return { t, stream, positions, slots, base, cache: (l) => this.cache.layer(l), ...extra };
  }

  /**
   * Runs `tokens` at slots [start, start + n) in chunks of the workspace's rows (causal), committing
   * them (L = start + n). With `logits` ([1, vocab] f32), the last token's logits go there and their
   * argmax to `token`. `onChunk(rows)`: called after each chunk's pass, while `taps` hold its rows.
   */
  prefill(tokens: readonly number[], start: number, logits: DeviceTensor | undefined = this.prefillLogits, onChunk?: (rows: number) => void): void {
    if (this.peers) {
      if (logits !== undefined && logits !== this.prefillLogits) throw new Error('prefill: under tensor parallelism the logits go to the runner\'s own buffer');
      this.peers.send({ op: 'prefill', tokens: [...tokens], start, logits: logits !== undefined });
    }
    const b = this.b;
    const rows = this.prefillRows;
    for (let at = 0; at < tokens.length; at += rows) {
      const t = Math.min(rows, tokens.length - at);
      const ids = view(this.ids, [t]);
      const positions = view(this.positions, [t]);
      b.native.upload(this.ids.buffer, Int32Array.from(tokens.slice(at, at + t)));
      b.native.arange({ out: positions, start: start + at, stream: 0 });
      const last = at + t === tokens.length;
      this.model.forward(this.pass(t, positions, positions, start + at, 0), ids, last && logits ? { first: t - 1, count: 1, out: logits } : undefined, this.taps);
      if (last && logits) b.native.argmax({ x: view(logits, [1, this.model.config.vocabSize]), out: this.token, stream: 0 });
      onChunk?.(t);
    }
    this.committed = start + tokens.length;
  }

  /**
   * One direct pass over `tokens` at slots [start, start + n) (n at most the workspace's rows),
   * committing them, with logits of every row into `logits` [n, vocab] and the residual stream
   * after each layer of `taps` into its tensor [n, hidden].
   */
  teacherForced(tokens: readonly number[], start: number, logits: DeviceTensor, taps: ReadonlyMap<number, DeviceTensor>): void {
    this.peers?.send({ op: 'teacherForced', tokens: [...tokens], start });
    const t = tokens.length;
    const ids = view(this.ids, [t]);
    const positions = view(this.positions, [t]);
    this.b.native.upload(this.ids.buffer, Int32Array.from(tokens));
    this.b.native.arange({ out: positions, start, stream: 0 });
    this.model.forward(this.pass(t, positions, positions, start, 0), ids, { first: 0, count: t, out: logits }, taps);
    this.committed = start + t;
  }

  /** Reads the device's last emitted token. */
  readToken(): number {
    return (this.b.toArray(this.token) as Int32Array)[0];
  }

  /**
   * The cache slots a pass's attention is sized for (its grid and work space over the committed
   * length L, which the kernels read on the device): the whole cache outside a captured step.
   */
  private slotBound = Infinity;

  /**
   * The step `key`, captured by `queue(stream)` on first use: one graph, or under tensor
   * parallelism on host collectives the graphs between them (see HostCollective). `slots`: how
   * far past the host's committed length the step writes by the time it ends. A graph is captured
   * per power-of-two bound (from 512 slots) on L + slots: a decode step at L = 100 of a 4096-slot
   * cache then launches attention blocks and work space for 512 slots, not 4096 (past L the
   * blocks find no keys, but they are still launched).
   */
  graph(key: string, queue: (stream: number) => void, slots = 1): StepGraph {
    let bound = 512;
    while (bound < this.committed + slots) bound *= 2;
    bound = Math.min(bound, this.capacity);
    const full = `${key} @${bound}`;
    let g = this.graphs.get(full);
    if (g === undefined) {
      if (this.captureStream < 0) this.captureStream = this.b.native.createStream();
      const collective = this.model.collective;
      this.slotBound = bound;
      try {
        g = captureStep(this.b, this.captureStream, queue, collective instanceof HostCollective ? collective : undefined);
      } finally {
        this.slotBound = Infinity;
      }
      this.graphs.set(full, g);
    }
    return g;
  }

  /** The `base` bound of a pass of t tokens at L on the device: the slots before the last t of the bound. */
  private baseBound(t: number): number {
    return Math.min(this.slotBound, this.capacity) - t;
  }

  /** Launches a captured step on this rank only. */
  launch(graph: StepGraph): void {
    graph.launch(this.b, 0);
  }

  /** The tree and draft logits (f32 [maxDepth, vocab]) the keyed steps run on. */
  useStepBuffers(tree: TreeBuffers, draftLogits: DeviceTensor): void {
    this.stepBuffers = { tree, draftLogits };
  }

  /** The captured step `key` (decode, a tree verify of a budget and depth, a chain of a length). */
  step(key: StepKey): StepGraph {
    if (key.kind === 'decode') return this.decodeGraph(key.held ?? false);
    if (this.stepBuffers === undefined) throw new Error('step: useStepBuffers first');
    const { tree, draftLogits } = this.stepBuffers;
    const V = this.model.config.vocabSize;
    if (key.kind === 'tree') return this.graph(`tree ${key.budget} ${key.depth}${this.tapKey}`, (s) => this.queueTreeStep(tree, view(draftLogits, [key.depth, V]), key.budget, s), key.budget + 1);
    return this.graph(`chain ${key.length}${this.tapKey}`, (s) => this.queueChainStep(tree, view(draftLogits, [key.length, V]), key.length, s), key.length + 1);
  }

  /** Runs the step `key` (on every rank, under tensor parallelism). */
  run(key: StepKey): void {
    this.peers?.send({ op: 'step', step: key });
    this.launch(this.step(key));
  }

  /**
   * Queues `t` tokens (`ids`, i32 [t]) at positions and slots L.. (L on the device), their last
   * row's logits into `logits` [1, vocab] and its argmax into `token`, then L += t.
   */
  queueAppend(t: number, ids: DeviceTensor, logits: DeviceTensor, stream: number, logitRow = t - 1, mark?: (part: string) => void): void {
    const b = this.b;
    const L = this.cache.length[0];
    const positions = view(this.positions, [t]);
    b.native.arange({ out: positions, startOnDevice: L, stream });
    this.model.forward(this.pass(t, positions, positions, this.baseBound(t), stream, { baseOnDevice: L }), ids, { first: logitRow, count: 1, out: logits }, this.taps, mark);
    b.native.argmax({ x: view(logits, [1, this.model.config.vocabSize]), out: this.token, stream });
    b.native.arange({ out: L, startOnDevice: L, start: t, stream });
  }

  /**
   * One decode step's ops called directly, with an event recorded after each part of the forward:
   * the device milliseconds of each part (the stream is held while the step queues, so the times
   * are the device's, not the host's launch rate).
   */
  profileDecode(): { part: string; ms: number }[] {
    const b = this.b;
    const events: { part: string; event: number }[] = [{ part: 'start', event: b.native.createEvent() }];
    try {
      b.native.hold(20_000, 0);
      b.native.recordEvent(events[0].event, 0);
      this.queueAppend(1, this.token, this.prefillLogits, 0, 0, (part) => {
        const event = b.native.createEvent();
        b.native.recordEvent(event, 0);
        events.push({ part, event });
      });
      b.synchronize();
      return events.slice(1).map((e, i) => ({ part: e.part, ms: b.native.elapsedMs(events[i].event, e.event) }));
    } finally {
      for (const e of events) b.native.destroyEvent(e.event);
    }
  }

  /**
   * Queues a greedy decode step (its graph on stream 0, L += 1; `held`: decodeGraph's held form)
   * and a copy of its token into slot (step % 2) of a ring, with an event after it. With one step
   * queued ahead of the one being read, the device runs the next step while the host reads,
   * checks and hands out this one: the host's share of a step (its reads, the generator's turn,
   * the next launch: ~60 us on the H200) no longer leaves the device idle. One device only (the
   * ranks of tensor parallelism mirror every step as it is read).
   */
  launchDecode(held = false): void {
    if (this.peers !== undefined || this.model.collective !== undefined) throw new Error('launchDecode: one device only');
    const b = this.b;
    // the read's destination is pinned: a copy into pageable memory goes through the driver's
    // staging, which CUDA does not promise to keep off the legacy stream the steps run on
    this.ahead ??= { ring: this.own(b.zeros('i32', [2])), events: [b.native.createEvent(), b.native.createEvent()], stream: b.native.createStream(), host: new Int32Array(b.native.allocHost(4)) };
    const slot = this.launched % 2;
    this.launch(this.decodeGraph(held));
    b.native.copy({ dst: this.ahead.ring.buffer, dstOffset: (this.ahead.ring.offset ?? 0) + slot * 4, src: this.token.buffer, srcOffset: this.token.offset ?? 0, bytes: 4, stream: 0 });
    b.native.recordEvent(this.ahead.events[slot], 0);
    this.advance(1);
    this.launched++;
  }

  /** Steps launchDecode queued that readDecoded has not read. */
  get decodesAhead(): number {
    return this.launched - this.read;
  }

  /**
   * The token of the oldest step launchDecode queued that was not read yet: waits for that step's
   * event only (a read on stream 0 would wait for the step queued after it too). Its ring slot is
   * written again two launches later, which the caller queues only after this read.
   */
  readDecoded(): number {
    const a = this.ahead;
    if (a === undefined || this.read >= this.launched) throw new Error('readDecoded: no decode step queued');
    const slot = this.read % 2;
    this.b.native.waitEvent(a.events[slot], a.stream);
    this.b.native.download(a.ring.buffer, a.host, (a.ring.offset ?? 0) + slot * 4, a.stream);
    this.read++;
    return a.host[0];
  }

  /**
   * Ends decoding ahead: the steps queued but not read (the one after an eos, or after an abort)
   * are taken back, L moving back past them once they ran (their cache rows past L are never
   * read). `quiet`: a failure here is not thrown (the error that ended the generation is the one
   * to report).
   */
  dropDecodesAhead(quiet = false): void {
    const unread = this.launched - this.read;
    this.launched = this.read = 0;
    if (unread === 0) return;
    try {
      this.committed = this.committed - unread;
    } catch (error) {
      if (!quiet) throw error;
    }
  }

  /**
   * One greedy decode step as a graph: the token at L -> its successor in `token`, L += 1; `held`:
   * its taps' row also into the held rows (see `held`).
   */
  decodeGraph(held = false): StepGraph {
    if (!held) return this.graph(`decode${this.tapKey}`, (s) => this.queueAppend(1, this.token, this.prefillLogits, s));
    const { taps, held: rows } = this;
    if (taps === undefined || rows === undefined) throw new Error('a held decode step needs taps and held rows');
    return this.graph(`decode${this.tapKey} held`, (s) => {
      this.queueAppend(1, this.token, this.prefillLogits, s);
      queueHoldRows(this.b, taps, rows, s);
    });
  }

  /** Allocates the arrays of trees of up to `nodes` nodes. */
  treeBuffers(nodes: number): TreeBuffers {
    const b = this.b;
    const i32 = () => this.own(b.zeros('i32', [nodes]));
    const readBack = this.own(b.zeros('i32', [2 + 3 * nodes]));
    return {
      tokens: view(readBack, [nodes], 2 + nodes),
      parents: i32(),
      depths: i32(),
      positions: i32(),
      mask: this.own(b.zeros('u8', [nodes, nodes])),
      size: this.own(b.zeros('i32', [1])),
      path: view(readBack, [nodes], 2),
      pathLen: view(readBack, [1]),
      readBack,
      logits: this.own(b.empty('f32', [nodes, this.model.config.vocabSize])),
      argmax: i32(),
      logProbs: { ...view(readBack, [nodes], 2 + 2 * nodes), dtype: 'f32' },
    };
  }

  /**
   * Queues the verify of a tree of `n` nodes already in `tree` (tokens, positions, mask, parents,
   * size), then greedy acceptance (bonus into `token`) and the commit of the accepted path's KV,
   * which moves L past it.
   */
  queueVerify(tree: TreeBuffers, n: number, stream: number, causal = false): void {
    const b = this.b;
    const L = this.cache.length[0];
    const V = this.model.config.vocabSize;
    const slots = view(tree.path, [n]); // the path buffer is free until accept writes it
    const positions = view(tree.positions, [n]);
    b.native.arange({ out: slots, startOnDevice: L, stream });
    const mask = causal ? undefined : view(tree.mask, [n, n]);
    this.model.forward(this.pass(n, positions, slots, this.baseBound(n), stream, { baseOnDevice: L, mask }), view(tree.tokens, [n]), { first: 0, count: n, out: tree.logits }, this.taps);
    b.native.argmax({ x: view(tree.logits, [n, V]), out: view(tree.argmax, [n]), stream });
    b.native.ddtreeAccept({ tokens: view(tree.tokens, [n]), parents: view(tree.parents, [n]), size: tree.size, targetArgmax: view(tree.argmax, [n]), path: view(tree.path, [n]), pathLen: tree.pathLen, bonus: this.token, stream });
    b.native.kvCommit({ caches: this.cache.all(), path: view(tree.path, [n]), pathLen: tree.pathLen, startOnDevice: L, nextStart: L, stream });
    // the bonus beside the path, for the step's one read back
    b.native.copy({ dst: tree.readBack.buffer, dstOffset: (tree.readBack.offset ?? 0) + 4, src: this.token.buffer, srcOffset: this.token.offset ?? 0, bytes: 4, stream });
  }

  /**
   * A DDTree step on the device: the best tree of `budget` nodes under `draftLogits` [depth,
   * vocab], rooted at `token` at position L, built into `tree` (its nodes' log-probabilities too),
   * then verified, accepted and committed (queueVerify). Under tensor parallelism rank 0 builds the
   * tree and broadcasts it.
   */
  queueTreeStep(tree: TreeBuffers, draftLogits: DeviceTensor, budget: number, stream: number): void {
    const n = budget + 1;
    const nodes = (x: DeviceTensor) => view(x, [n]);
    const collective = this.model.collective;
    if (collective !== undefined && collective.rank !== 0) {
      collective.broadcast([nodes(tree.tokens), nodes(tree.parents), nodes(tree.depths), nodes(tree.positions), view(tree.mask, [n, n]), tree.size], 0, stream);
      this.queueVerify(tree, n, stream);
      return;
    }
    this.b.native.ddtreeBuild({
      draftLogits,
      rootOnDevice: this.token,
      budget,
      startOnDevice: this.cache.length[0],
      tokens: nodes(tree.tokens),
      parents: nodes(tree.parents),
      depths: nodes(tree.depths),
      positions: nodes(tree.positions),
      mask: view(tree.mask, [n, n]),
      size: tree.size,
      logProbs: nodes(tree.logProbs),
      stream,
    });
    collective?.broadcast([nodes(tree.tokens), nodes(tree.parents), nodes(tree.depths), nodes(tree.positions), view(tree.mask, [n, n]), tree.size], 0, stream);
    this.queueVerify(tree, n, stream);
  }

  /** i32 [nodes]: a chain's parents (-1, 0, 1, ...); i32 [1] per length: its node count. */
  private chainParents: DeviceTensor | undefined;
  private readonly chainSizes = new Map<number, DeviceTensor>();

  /**
   * A chain step (DFlash's verification): the root `token` and the argmax of each of the
   * `length` rows of `draftLogits`, verified causally at positions L.., accepted and committed.
   */
  queueChainStep(tree: TreeBuffers, draftLogits: DeviceTensor, length: number, stream: number): void {
    const b = this.b;
    const n = length + 1;
    const nodes = tree.tokens.shape[0];
    this.chainParents ??= this.own(b.fromArray('i32', [nodes], Int32Array.from({ length: nodes }, (_, i) => i - 1)));
    let size = this.chainSizes.get(n);
    if (size === undefined) {
      size = this.own(b.fromArray('i32', [1], Int32Array.of(n)));
      this.chainSizes.set(n, size);
    }
    const chain = { ...tree, parents: this.chainParents, size };
    // rank 0 (or the only rank) drafts the chain; the others receive its tokens
    const collective = this.model.collective;
    if (collective === undefined || collective.rank === 0) {
      b.native.copy({ dst: chain.tokens.buffer, dstOffset: chain.tokens.offset ?? 0, src: this.token.buffer, srcOffset: this.token.offset ?? 0, bytes: 4, stream });
      b.native.argmax({ x: view(draftLogits, [length, this.model.config.vocabSize]), out: view(chain.tokens, [length], 1), stream });
    }
    collective?.broadcast([view(chain.tokens, [n])], 0, stream);
    b.native.arange({ out: view(chain.positions, [n]), startOnDevice: this.cache.length[0], stream });
    this.queueVerify(chain, n, stream, true);
  }

  dispose(): void {
    for (const g of this.graphs.values()) g.free(this.b);
    this.graphs.clear();
    if (this.captureStream >= 0) this.b.native.destroyStream(this.captureStream);
    this.captureStream = -1;
    if (this.ahead !== undefined) {
      this.b.native.destroyStream(this.ahead.stream);
      for (const e of this.ahead.events) this.b.native.destroyEvent(e);
      this.b.native.freeHost(this.ahead.host);
      this.ahead = undefined;
    }
    this.b.free(...this.owned);
    this.owned.length = 0;
    this.cache.dispose();
  }
}

/**
 * Row 0 of each tap into its held rows at the row `held.next` holds, then next += 1. kv_write puts
 * f32 rows into f32 buffers at a slot read on the device, two rows a launch (its c and kpe): the
 * taps go in pairs, an odd last one paired with itself (the same row written twice).
 */
function queueHoldRows(b: KdtreeBackend, taps: ReadonlyMap<number, DeviceTensor>, held: { rows: ReadonlyMap<number, DeviceTensor>; next: DeviceTensor }, stream: number): void {
  const layers = [...taps.keys()];
  const row = (l: number) => view(taps.get(l)!, [1, taps.get(l)!.shape[1]]);
  const into = (l: number) => {
    const rows = held.rows.get(l);
    if (rows === undefined) throw new Error(`no held rows for the tap of layer ${l}`);
    return rows;
  };
  for (let i = 0; i < layers.length; i += 2) {
    const first = layers[i];
    const second = layers[Math.min(i + 1, layers.length - 1)];
    b.native.kvWrite({ c: row(first), kpe: row(second), cacheC: into(first), cacheKpe: into(second), slots: held.next, stream });
  }
  b.native.arange({ out: held.next, start: 1, startOnDevice: held.next, stream });
}
