/**
 * Seeded random calls to every native op: "a native call never crashes the process on bad
 * arguments". Each call is built well-formed for its op (random sizes), then has a few things made
 * wrong at random: a dimension, a dtype, an offset, a scalar, or the contents of a tensor (ids past
 * a table, slots past a cache, a tree size past its nodes). Contents stay in range often enough for
 * the calls to get past validation into the kernels. Every call must run or throw a KDTREE_ error
 * (never a crash, a plain Error, or a device fault), and a final call on known data must still get
 * the right answer: on the cuda variant a kernel's out-of-bounds access would leave the context
 * broken and fail it.
 */
import type { KdtreeBackend } from '../backend.js';
import { isNativeError } from '../errors.js';
import type { NativeBackend, NativeBuffer, NativeDtype, NativeGraph, TensorArg } from '../native-types.js';
import { childCheck, type ChildCase } from './child.js';
import { CheckFailure, expectEqual, fail, rng, type KernelCheck } from './harness.js';

type Random = ReturnType<typeof rng>;
const BYTES: Record<NativeDtype, number> = { f32: 4, bf16: 2, f16: 2, i32: 4, u8: 1, f64: 8 };
/** How tensor contents are drawn: indices below a bound, wild 32-bit values, floats, or raw bits. */
type Fill = number | 'wild' | 'float' | 'bits';

/** Calls per run: about a second on the cpu variant. */
const CALLS = 5000;
/** Chance that any one dimension, dtype, offset or scalar of a call is made wrong. */
const WRONG = 0.06;
/** Integers that break sizes and indices: negatives, the i32 edges, 2^32 + 1, fractions, NaN. */
const WILD_NUMBERS = [-1, 0, 1, 3, 0.5, -(2 ** 31), 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 53, Number.NaN, Number.POSITIVE_INFINITY];
const WILD_I32 = [-1, -7, 0, 1, 2, 5, 1000, 2 ** 31 - 1, -(2 ** 31), 65536];

class CallBuilder {
  readonly buffers: NativeBuffer[] = [];
  /** Why the call being built must be rejected (a non-finite float, a flag that is not a boolean), if it must. */
  mustReject: string | undefined;
  /** The argument value that makes it so (shapelessArgs may replace it with junk). */
  mustRejectValue: unknown;
  constructor(
    private readonly native: NativeBackend,
    readonly r: Random,
  ) {}

  pick<T>(values: readonly T[]): T {
    return values[Math.floor(this.r.uniform() * values.length)];
  }
  chance(p: number): boolean {
    return this.r.uniform() < p;
  }
  /** A size from the small ones kernels special-case (1, tails) and a few larger. */
  size(): number {
    return this.pick([1, 2, 3, 5, 8, 16, 17]);
  }
  /** `v`, or now and then a wrong number. */
  num(v: number): number {
    return this.chance(WRONG) ? this.pick(WILD_NUMBERS) : v;
  }

  /** A float scalar `v`, or now and then a non-finite one, which the call must reject. */
  real(v: number): number {
    if (!this.chance(WRONG)) return v;
    const bad = this.pick([Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]);
    this.mustReject = `a float scalar of ${bad}`;
    this.mustRejectValue = bad;
    return bad;
  }
  /** A flag: true with probability p, or now and then a value of another type, which the call must reject. */
  flag(p: number): boolean {
    if (!this.chance(WRONG)) return this.chance(p);
    const bad = this.pick<unknown>([0, 1, 'true', '', null, {}, []]);
    this.mustReject = `a flag of ${JSON.stringify(bad)}`;
    this.mustRejectValue = bad;
    return bad as boolean;
  }

  /** A tensor for `shape`, sometimes with a wrong dtype, dimension or offset; `fill` draws its contents. */
  tensor(dtype: NativeDtype, shape: number[], fill?: Fill): TensorArg {
    if (this.chance(WRONG / 2)) dtype = this.pick(['f32', 'bf16', 'f16', 'i32', 'u8', 'f64'] as const);
    const dims = shape.map((d) => (this.chance(WRONG / 2) ? this.pick([0, 1, d - 1, d + 1, 2 * d, 2 ** 31]) : d));
    const elements = dims.reduce((a, d) => a * (Number.isInteger(d) && d >= 0 && d < 4096 ? d : 1), 1);
    const bytes = elements * BYTES[dtype];
    const buffer = this.native.alloc(bytes);
    this.buffers.push(buffer);
    if (bytes > 0) this.native.upload(buffer, this.contents(bytes, fill ?? this.pick<Fill>([24, 24, 'wild', 'float', 'bits'])));
    const t: TensorArg = { buffer, dtype, shape: dims };
    if (this.chance(WRONG / 2)) t.offset = this.pick([4, 16, 48, bytes, bytes + 16]);
    return t;
  }

  private contents(bytes: number, fill: Fill): Uint8Array {
    const words = new Int32Array(Math.ceil(bytes / 4));
    const floats = new Float32Array(words.buffer);
    const special = [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, 0, 1e30, -1e-40];
    for (let i = 0; i < words.length; i++) {
      if (typeof fill === 'number') words[i] = this.chance(0.02) ? this.pick(WILD_I32) : Math.floor(this.r.uniform() * fill);
      else if (fill === 'wild') words[i] = this.pick(WILD_I32);
      else if (fill === 'float') floats[i] = this.chance(0.05) ? this.pick(special) : 4 * this.r.uniform() - 2;
      else words[i] = Math.floor(this.r.uniform() * 2 ** 32) | 0;
    }
    return new Uint8Array(words.buffer, 0, bytes);
  }
}

type CallMaker = (c: CallBuilder) => Record<string, unknown>;
const floatDtype = (c: CallBuilder): NativeDtype => c.pick(['f32', 'bf16']);

/** One maker per op: the arguments of a well-formed call of random size, with CallBuilder's mistakes. */
const CALLS_BY_OP: Record<string, CallMaker> = {
  w4a16Pack: (c) => {
    const n = 16 * c.pick([1, 2]), group = c.pick([32, 64, 128]), k = group * c.pick([1, 4]), sc = floatDtype(c);
    return { qw: c.tensor('i32', [n, k / 8], 'bits'), sc: c.tensor(sc, [n, k / group], 'float'), qwPacked: c.tensor('i32', [n / 16, Math.ceil(k / 128), 256]), scPacked: c.tensor(sc, [n / 16, Math.ceil((Math.ceil(k / 128) * 128) / group / 4), 64]), group: c.num(group), interleaveGateUp: c.flag(0.3) };
  },
  w4a16Gemm: (c) => {
    const m = c.size(), n = 16 * c.pick([1, 2, 3]), group = c.pick([32, 64, 128]), k = 4 * group * c.pick([1, 2]), silu = c.chance(0.2);
    return { x: c.tensor(c.pick(['bf16', 'f32', 'f16']), [m, k], 'float'), qw: c.tensor('i32', [n / 16, k / 128, 256], 'bits'), sc: c.tensor(floatDtype(c), [n / 16, k / (4 * group), 64], 'float'), y: c.tensor('f32', [m, silu ? n / 2 : n]), group: c.num(group), epilogue: silu ? 'siluMul' : undefined };
  },
  gemm: (c) => {
    const m = c.size(), n = c.size(), k = 8 * c.pick([1, 2, 5]);
    return { x: c.tensor('bf16', [m, k], 'float'), w: c.tensor('bf16', [n, k], 'float'), y: c.tensor('f32', [m, n]) };
  },
  moeGemm: (c) => {
    const t = c.size(), topk = c.pick([1, 2]), experts = c.pick([2, 3, 5]), n = 16 * c.pick([1, 2]), k = 128, gather = c.chance(0.5);
    return {
      x: c.tensor('bf16', [gather ? t : t * topk, k], 'float'),
      qw: c.tensor('i32', [experts, n / 16, k / 128, 256], 'bits'),
      sc: c.tensor('bf16', [experts, n / 16, 1, 64], 'float'),
      ids: c.tensor('i32', [t, topk], c.chance(0.8) ? experts : undefined),
      weights: gather ? undefined : c.tensor('f32', [t, topk], 'float'),
      y: c.tensor('f32', gather ? [t * topk, n] : [t, n]),
      mode: gather ? 'gather' : 'sum',
      minWarpSteps: c.chance(0.2) ? c.num(2) : undefined,
    };
  },
  // moeGemm over bf16 experts as stored (the maker's name ends in Bf16; the op is moeGemm)
  moeGemmBf16: (c) => {
    const t = c.size(), topk = c.pick([1, 2]), experts = c.pick([2, 3]), n = c.pick([5, 8, 16]), k = 8 * c.pick([1, 4, 33]), gather = c.chance(0.5), silu = gather && c.chance(0.3);
    return {
      x: c.tensor(floatDtype(c), [gather ? t : t * topk, k], 'float'),
      w: c.tensor('bf16', [experts, silu ? 2 * n : n, k], 'float'),
      ids: c.tensor('i32', [t, topk], c.chance(0.8) ? experts : undefined),
      weights: gather ? undefined : c.tensor('f32', [t, topk], 'float'),
      y: c.tensor(floatDtype(c), gather ? [t * topk, n] : [t, n]),
      mode: gather ? 'gather' : 'sum',
      epilogue: silu ? 'siluMul' : undefined,
    };
  },
  mlaAttention: (c) => {
    const t = c.size(), h = c.pick([1, 2]), slots = t + c.pick([0, 3, 9]), cache = floatDtype(c);
    return {
      qNope: c.tensor('f32', [t, h, 8], 'float'),
      qPe: c.tensor('f32', [t, h, 8], 'float'),
      kvB: c.tensor(floatDtype(c), [h * 16, 16], 'float'),
      cacheC: c.tensor(cache, [slots, 16], 'float'),
      cacheKpe: c.tensor(cache, [slots, 8], 'float'),
      mask: c.chance(0.5) ? c.tensor('u8', [t, t], 2) : undefined,
      out: c.tensor('f32', [t, h, 8]),
      base: c.num(slots - t),
      baseOnDevice: c.chance(0.4) ? c.tensor('i32', [1], slots) : undefined,
      scale: c.real(0.1),
    };
  },
  embedding: (c) => {
    const t = c.size(), h = c.pick([7, 8, 16]), rows = c.size();
    return { table: c.tensor(floatDtype(c), [rows, h], 'float'), ids: c.tensor('i32', [t], rows + 1), out: c.tensor('f32', [t, h]) };
  },
  rmsNorm: (c) => {
    const t = c.size(), h = c.pick([4, 7, 64]), fused = c.chance(0.4);
    const bf16Out = c.chance(0.3), copy = !bf16Out && c.chance(0.3);
    return {
      x: c.tensor('f32', [t, h], 'float'), weight: c.tensor(floatDtype(c), [h], 'float'), out: c.tensor(bf16Out ? 'bf16' : 'f32', [t, h]), eps: c.real(1e-6),
      residual: fused ? c.tensor('f32', [t, h], 'float') : undefined, sum: fused ? c.tensor('f32', [t, h]) : undefined, outBf16: copy ? c.tensor('bf16', [t, h]) : undefined,
    };
  },
  rope: (c) => {
    const t = c.size(), heads = c.size(), dim = c.pick([8, 16, 64]);
    return { x: c.tensor('f32', [t, heads, dim], 'float'), positions: c.tensor('i32', [t], 4096), invFreq: c.tensor('f64', [dim / 4], 'float'), offset: c.num(c.pick([0, dim / 2])), attentionFactor: c.real(1), interleave: c.flag(0.5) };
  },
  siluMul: (c) => {
    const t = c.size(), i = c.size();
    return { x: c.tensor('f32', [t, 2 * i], 'float'), out: c.tensor('f32', [t, i]) };
  },
  add: (c) => {
    const shape = [c.size(), c.size()];
    return { a: c.tensor('f32', shape, 'float'), b: c.tensor('f32', shape, 'float'), out: c.tensor('f32', shape) };
  },
  router: (c) => {
    const t = c.size(), groups = c.pick([1, 2, 4]), experts = groups * c.pick([2, 4, 8]), topk = Math.min(4, experts);
    return { logits: c.tensor('f32', [t, experts], 'float'), bias: c.tensor('f32', [experts], 'float'), ids: c.tensor('i32', [t, topk]), weights: c.tensor('f32', [t, topk]), topk: c.num(topk), nGroup: c.num(groups), topkGroup: c.num(Math.max(1, groups >> 1)), normTopkProb: c.flag(0.5), scaling: c.real(2.5) };
  },
  argmax: (c) => {
    const t = c.size();
    return { x: c.tensor('f32', [t, c.size()], 'float'), out: c.tensor('i32', [t]) };
  },
  topk: (c) => {
    const t = c.size(), k = c.pick([1, 2, 4]);
    return { x: c.tensor('f32', [t, c.pick([4, 16, 33])], 'float'), values: c.tensor('f32', [t, k]), ids: c.tensor('i32', [t, k]), k: c.num(k) };
  },
  kvWrite: (c) => {
    const t = c.size(), slots = t + c.pick([0, 4]), cache = floatDtype(c);
    return { c: c.tensor('f32', [t, 16], 'float'), kpe: c.tensor('f32', [t, 8], 'float'), cacheC: c.tensor(cache, [slots, 16]), cacheKpe: c.tensor(cache, [slots, 8]), slots: c.tensor('i32', [t], slots + 1) };
  },
  mlaInputs: (c) => {
    const t = c.size(), slots = t + c.pick([0, 4]), cache = floatDtype(c), q = c.pick([0, 8]), w = q + 16 + 8 + c.pick([0, 3]);
    return {
      x: c.tensor('f32', [t, w], 'float'), qANorm: q > 0 ? c.tensor(floatDtype(c), [q], 'float') : undefined, qAOut: q > 0 ? c.tensor(floatDtype(c), [t, q]) : undefined,
      kvANorm: c.tensor(floatDtype(c), [16], 'float'), cacheC: c.tensor(cache, [slots, 16]), cacheKpe: c.tensor(cache, [slots, 8]), slots: c.tensor('i32', [t], slots + 1),
      positions: c.tensor('i32', [t], 4096), invFreq: c.tensor('f64', [4], 'float'), eps: c.real(1e-6), attentionFactor: c.real(1), interleave: c.flag(0.5),
    };
  },
  mlaQuery: (c) => {
    const t = c.size(), heads = c.size(), w = heads * (8 + 4) + c.pick([0, 5]);
    return { x: c.tensor('f32', [t, w], 'float'), qNope: c.tensor('f32', [t, heads, 8]), qPe: c.tensor('f32', [t, heads, 4]), positions: c.tensor('i32', [t], 4096), invFreq: c.tensor('f64', [2], 'float'), attentionFactor: c.real(1), interleave: c.flag(0.5) };
  },
  ddtreeBuild: (c) => {
    const depth = c.size(), vocab = c.pick([4, 16, 50]), budget = c.pick([0, 1, 4, 16, 64]), nodes = budget + 1;
    return {
      draftLogits: c.tensor('f32', [depth, vocab], 'float'),
      root: c.num(1),
      rootOnDevice: c.chance(0.3) ? c.tensor('i32', [1], vocab + 1) : undefined,
      budget: c.num(budget),
      start: c.num(0),
      startOnDevice: c.chance(0.3) ? c.tensor('i32', [1], 64) : undefined,
      tokens: c.tensor('i32', [nodes]),
      parents: c.tensor('i32', [nodes]),
      depths: c.tensor('i32', [nodes]),
      positions: c.tensor('i32', [nodes]),
      mask: c.tensor('u8', [nodes, nodes]),
      size: c.tensor('i32', [1]),
    };
  },
  ddtreeAccept: (c) => {
    const n = c.size();
    return { tokens: c.tensor('i32', [n], 4), parents: c.tensor('i32', [n], n), size: c.tensor('i32', [1], n + 1), targetArgmax: c.tensor('i32', [n], 4), path: c.tensor('i32', [n]), pathLen: c.tensor('i32', [1]), bonus: c.tensor('i32', [1]) };
  },
  kvCommit: (c) => {
    const n = c.size(), slots = n + c.pick([0, 8]), start = c.tensor('i32', [1], 4);
    return {
      caches: Array.from({ length: c.pick([1, 2]) }, () => c.tensor(floatDtype(c), [slots, c.pick([4, 16])], 'float')),
      path: c.tensor('i32', [n], slots),
      pathLen: c.tensor('i32', [1], n + 1),
      start: c.num(c.pick([0, 2])),
      startOnDevice: c.chance(0.4) ? start : undefined,
      nextStart: c.chance(0.3) ? (c.chance(0.5) ? start : c.tensor('i32', [1])) : undefined,
    };
  },
  arange: (c) => ({ out: c.tensor('i32', [c.size()]), start: c.num(c.pick([0, 5])), startOnDevice: c.chance(0.5) ? c.tensor('i32', [1], 64) : undefined }),
};

/** Device memory calls with random offsets and sizes (host arrays included). */
function memoryCall(native: NativeBackend, c: CallBuilder): void {
  const a = native.alloc(c.pick([0, 16, 64]));
  const b = c.chance(0.3) ? a : native.alloc(c.pick([16, 64]));
  c.buffers.push(a, b);
  const offset = () => (c.chance(0.5) ? undefined : c.pick([0, 8, 16, 48, 64, 65, 2 ** 53, -1, 0.5]));
  switch (c.pick(['copy', 'upload', 'download', 'fill'])) {
    case 'copy':
      native.copy({ dst: a, src: b, bytes: offset(), dstOffset: offset(), srcOffset: offset() });
      break;
    case 'upload':
      native.upload(a, new Uint8Array(c.pick([0, 8, 16, 64, 65])), offset());
      break;
    case 'download':
      native.download(a, new Float32Array(c.pick([0, 2, 16, 17])), offset());
      break;
    default:
      native.fill(a, c.num(7));
  }
}

/** Every op sometimes gets something that is not an argument object or not a tensor at all. */
function shapelessArgs(c: CallBuilder, args: Record<string, unknown>): unknown {
  const junk = [undefined, null, 5, 'x', [], {}, { buffer: {}, dtype: 'f32', shape: [4] }];
  if (c.chance(0.01)) return c.pick(junk);
  if (c.chance(0.03)) {
    const key = c.pick(Object.keys(args));
    // the value that had to be rejected is gone: whatever the junk does, nothing is owed
    if (c.mustReject !== undefined && Object.is(args[key], c.mustRejectValue)) c.mustReject = undefined;
    return { ...args, [key]: c.pick(junk) };
  }
  return args;
}

function run(b: KdtreeBackend, seed: number): string {
  const native = b.native;
  const ops = Object.keys(CALLS_BY_OP);
  const counts = { ran: 0, threw: 0, refused: 0 };
  const c = new CallBuilder(native, rng(seed));
  for (let i = 0; i < CALLS; i++) {
    const op = c.chance(0.05) ? 'memory' : c.pick(ops);
    let described = op;
    c.mustReject = undefined;
    try {
      if (op === 'memory') {
        memoryCall(native, c);
      } else {
        const args = shapelessArgs(c, CALLS_BY_OP[op](c));
        described = `${op}(${JSON.stringify(args, (key, v) => (key === 'buffer' ? undefined : v))})`;
        (native as unknown as Record<string, (a: unknown) => void>)[op.replace(/Bf16$/, '')](args);
        if (c.mustReject) fail(`call ${i} of seed ${seed}, ${described}: ran with ${c.mustReject}`);
      }
      native.synchronize();
      counts.ran++;
    } catch (error) {
      if (error instanceof CheckFailure) throw error;
      const code = (error as { code?: unknown }).code;
      if (!(error instanceof Error) || (code !== 'KDTREE_INVALID_ARGUMENT' && code !== 'KDTREE_UNSUPPORTED')) {
        fail(`call ${i} of seed ${seed}, ${described}: threw ${String(code)} ${error instanceof Error ? error.message : String(error)}`);
      }
      counts.threw++;
      if (c.mustReject) counts.refused++;
    } finally {
      for (const buffer of c.buffers.splice(0)) if (!buffer.freed) native.free(buffer);
    }
  }
  expectBackendWorks(b, 'add after the fuzzed calls');
  if (counts.ran < CALLS / 5) fail(`only ${counts.ran} of ${CALLS} calls got past validation: the makers no longer build well-formed calls`);
  if (counts.refused === 0) fail('no call had a non-finite float or a flag of another type: the makers no longer draw them');
  return `${counts.ran} calls ran, ${counts.threw} threw KDTREE_ errors (${counts.refused} for a non-finite float or a flag that is not a boolean)`;
}

/**
 * Streams, events, captures, graphs and pinned host memory in random order: created, destroyed, captured into,
 * launched and freed while the buffers they use come and go. Every step runs or throws a KDTREE_
 * error; afterwards the captures still open are ended and everything is released.
 */
function runLifetimes(b: KdtreeBackend, seed: number, steps: number): string {
  const native = b.native;
  const c = new CallBuilder(native, rng(seed));
  // live handles, and released ones (kept so that a step sometimes uses one after its release)
  const streams = { live: [0], gone: [] as number[] };
  const buffers = { live: [native.alloc(16)], gone: [] as NativeBuffer[] };
  const events: number[] = [];
  const hosts = { live: [] as Float32Array[], gone: [] as Float32Array[] }; // views of allocHost memory (empty once freed)
  const graphs = { live: [] as NativeGraph[], gone: [] as NativeGraph[] };
  const pickFrom = <T,>(pool: { live: T[]; gone: T[] }): T => (pool.gone.length > 0 && (pool.live.length === 0 || c.chance(0.1)) ? c.pick(pool.gone) : c.pick(pool.live));
  const release = <T,>(pool: { live: T[]; gone: T[] }, item: T, free: (item: T) => void) => {
    free(item);  // throws for a released one, which then stays where it is
    const i = pool.live.indexOf(item);
    if (i >= 0) pool.gone.push(...pool.live.splice(i, 1));
  };
  const buffer = () => pickFrom(buffers);
  const tensor = (): TensorArg => ({ buffer: buffer(), dtype: 'f32', shape: [4] });
  const stream = () => pickFrom(streams);
  const event = () => c.pick([...events, 12345]);
  let replayedCalls = 0; // captured calls replayed by a launch that ran
  const actions: Record<string, () => unknown> = {
    alloc: () => buffers.live.push(native.alloc(16)),
    free: () => release(buffers, buffer(), (x) => native.free(x)),
    createStream: () => streams.live.push(native.createStream()),
    destroyStream: () => release(streams, stream(), (x) => native.destroyStream(x)),
    createEvent: () => events.push(native.createEvent()),
    destroyEvent: () => native.destroyEvent(event()),
    recordEvent: () => native.recordEvent(event(), stream()),
    waitEvent: () => native.waitEvent(event(), stream()),
    allocHost: () => hosts.live.push(new Float32Array(native.allocHost(16))),
    freeHost: () => hosts.live.length + hosts.gone.length > 0 && release(hosts, pickFrom(hosts), (x) => native.freeHost(x)),
    uploadHost: () => hosts.live.length + hosts.gone.length > 0 && native.upload(buffer(), pickFrom(hosts), 0, stream()),
    memoryInfo: () => native.memoryInfo(),
    elapsedMs: () => native.elapsedMs(event(), event()),
    synchronize: () => native.synchronize(c.pick([...streams.live, -1])),
    beginCapture: () => native.beginCapture(stream()),
    endCapture: () => graphs.live.push(native.endCapture(stream())),
    launchGraph: () => {
      if (graphs.live.length + graphs.gone.length === 0) return;
      const graph = pickFrom(graphs);
      native.launchGraph(graph, stream());
      replayedCalls += graph.calls;
    },
    freeGraph: () => graphs.live.length + graphs.gone.length > 0 && release(graphs, pickFrom(graphs), (x) => native.freeGraph(x)),
    add: () => native.add({ a: tensor(), b: tensor(), out: tensor(), stream: stream() }),
    copy: () => native.copy({ dst: buffer(), src: buffer(), stream: stream() }),
    fill: () => native.fill(buffer(), 1, stream()),
    hold: () => native.hold(5, stream()),
    upload: () => native.upload(buffer(), new Float32Array(4)),
    download: () => native.download(buffer(), new Float32Array(4)),
  };
  // ops, captures and launches more often than the rest, so that graphs of calls get captured and replayed
  const names = [...Object.keys(actions), 'add', 'add', 'add', 'beginCapture', 'endCapture', 'launchGraph', 'launchGraph'];
  const counts = { ran: 0, threw: 0 };
  const attempt = (what: string, step: () => unknown) => {
    try {
      step();
      counts.ran++;
    } catch (error) {
      const code = (error as { code?: unknown }).code;
      if (!isNativeError(error)) fail(`${what}: threw ${String(code)} ${String(error)}`);
      counts.threw++;
    }
  };
  for (let i = 0; i < steps; i++) {
    const name = c.pick(names);
    attempt(`step ${i} (${name}) of seed ${seed}`, actions[name]);
  }
  // a sequence that never gets a graph of captured calls launched would test only the rejections
  if (replayedCalls === 0) fail(`seed ${seed}: no launched graph held a captured call in ${steps} steps`);
  const tally = `${counts.ran} steps ran, ${counts.threw} threw KDTREE_ errors, launches replayed ${replayedCalls} captured calls`;
  for (const s of streams.live) if (s !== 0) attempt(`ending stream ${s}'s capture`, () => graphs.live.push(native.endCapture(s)));
  for (const g of graphs.live) native.freeGraph(g);
  native.synchronize();
  for (const s of streams.live) if (s !== 0) native.destroyStream(s);
  for (const e of events) attempt(`destroying event ${e}`, () => native.destroyEvent(e));
  for (const x of buffers.live) native.free(x);
  for (const x of hosts.live) native.freeHost(x);
  return tally;
}

/** The backend still computes: a device fault or a capture left open would fail this on cuda. */
function expectBackendWorks(b: KdtreeBackend, what: string): void {
  const x = b.fromArray('f32', [3], Float32Array.of(1, 2, 3));
  const y = b.empty('f32', [3]);
  b.native.add({ a: x, b: x, out: y });
  expectEqual(what, b.toArray(y) as Float32Array, Float32Array.of(2, 4, 6));
  b.free(x, y);
}

const fuzz: KernelCheck = {
  name: `fuzz: ${CALLS} seeded random calls to every op run or throw a KDTREE_ error, and the backend still works after`,
  run: (b) => ({ detail: run(b, 20261201) }),
};

const lifetimes: KernelCheck = {
  name: 'fuzz: 3000 seeded random steps of streams, events (waits included), captures, graphs, buffers and pinned host memory run or throw a KDTREE_ error, and the backend still works after',
  run(b) {
    const detail = runLifetimes(b, 20261202, 3000);
    expectBackendWorks(b, 'add after the fuzzed lifetimes');
    return { detail };
  },
};

/**
 * Hostile JavaScript, in a child process (a crash is a failed check, not the end of the run): ops
 * whose argument objects and tensors have getters that free buffers, allocate, fill, call other
 * ops, begin and end captures or launch graphs (propagating their errors or swallowing them);
 * methods called on foreign receivers; non-finite floats and flags of other types. Dropped buffers
 * are left to the GC, which runs every 100 steps before every graph is launched. Every call runs
 * or throws a KDTREE_ error (or V8's "Illegal invocation" for a foreign receiver); a call that
 * ran had none of its buffers freed under it, and none that had to be rejected ran. Self-contained
 * (child.ts runs its source text): it has its own random numbers and uses only `native` and `h`.
 */
const hostile: ChildCase = {
  name: 'hostile calls (getters that free buffers or make native calls, captures, GC, foreign receivers, non-finite floats, wrong-type flags)',
  async run(native, h) {
    const STEPS = 2000;
    let state = 20261203;
    const rand = () => {
      state = (state + 0x6d2b79f5) | 0;
      let t = Math.imul(state ^ (state >>> 15), 1 | state);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
    const pick = <T,>(xs: readonly T[]): T => xs[Math.floor(rand() * xs.length)];
    const chance = (p: number) => rand() < p;
    const other = h.addon.createBackend(h.kind, h.device);
    const stream = native.createStream();
    let capturing = false;
    const graphs: NativeGraph[] = [];
    const pool: NativeBuffer[] = []; // recent steps' buffers: some freed, some only dropped later
    const counts = { ran: 0, threw: 0, refused: 0, getters: 0, launches: 0 };
    const alloc = (bytes: number, zero = false) => {
      const b = native.alloc(bytes);
      if (zero) native.fill(b, 0);
      pool.push(b);
      return b;
    };
    const t = (buffer: NativeBuffer, dtype: NativeDtype, shape: number[]): TensorArg => ({ buffer, dtype, shape });
    const sideEffects: (() => unknown)[] = [
      () => native.free(pick(pool)),
      () => alloc(64),
      () => native.synchronize(0),
      () => native.fill(pick(pool), 0),
      () => native.add({ a: t(pick(pool), 'f32', [4]), b: t(pick(pool), 'f32', [4]), out: t(pick(pool), 'f32', [4]), stream: pick([0, stream]) }),
      () => {
        native.beginCapture(stream);
        capturing = true;
      },
      () => {
        graphs.push(native.endCapture(stream));
        capturing = false;
      },
      () => native.launchGraph(pick(graphs), 0),
      () => (Object.getPrototypeOf(native).free as (b: unknown) => void).call(pick(pool), pick(pool)),
    ];
    /** Makes some properties of `o` getters that run a side effect first. */
    const hostileProps = (o: Record<string, unknown> | unknown[]) => {
      for (const key of Object.keys(o)) {
        if (!chance(0.12)) continue;
        const value = (o as Record<string, unknown>)[key];
        const swallow = chance(0.5);
        Object.defineProperty(o, key, {
          enumerable: true,
          get() {
            counts.getters++;
            const act = pick(sideEffects);
            if (!swallow) act();
            else {
              try {
                act();
              } catch {
                // a getter that goes on after its side effect failed
              }
            }
            return value;
          },
        });
      }
    };
    let bad: string | undefined;
    const real = (v: number) => {
      if (!chance(0.05)) return v;
      const x = pick([Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY]);
      bad = `a float of ${x}`;
      return x;
    };
    const flag = (v: boolean) => {
      if (!chance(0.05)) return v;
      const x = pick<unknown>([0, 1, 'yes', null, {}]);
      bad = `a flag of ${JSON.stringify(x)}`;
      return x as boolean;
    };
    type Made = { op: string; args: Record<string, unknown>; named: NativeBuffer[] };
    const makers: (() => Made)[] = [
      () => {
        const n = pick([4, 16, 1 << 16]);
        const [a, b, out] = [alloc(4 * n, true), alloc(4 * n, true), alloc(4 * n)];
        return { op: 'add', args: { a: t(a, 'f32', [n]), b: t(b, 'f32', [n]), out: t(out, 'f32', [n]), stream: pick([0, stream]) }, named: [a, b, out] };
      },
      () => {
        const n = pick([16, 1 << 18]);
        const [src, dst] = [alloc(n, true), alloc(n)];
        return { op: 'copy', args: { dst, src, bytes: n, dstOffset: 0, srcOffset: 0, stream: pick([0, stream]) }, named: [src, dst] };
      },
      () => {
        const [x, w, out] = [alloc(4 * 64, true), alloc(4 * 16, true), alloc(4 * 64)];
        return { op: 'rmsNorm', args: { x: t(x, 'f32', [4, 16]), weight: t(w, 'f32', [16]), out: t(out, 'f32', [4, 16]), eps: real(1e-6), stream: pick([0, stream]) }, named: [x, w, out] };
      },
      () => {
        const [x, pos, inv] = [alloc(4 * 16, true), alloc(4 * 2, true), alloc(8 * 2, true)];
        return { op: 'rope', args: { x: t(x, 'f32', [2, 1, 8]), positions: t(pos, 'i32', [2]), invFreq: t(inv, 'f64', [2]), attentionFactor: real(1), interleave: flag(chance(0.5)) }, named: [x, pos, inv] };
      },
      () => {
        const [logits, bias, ids, weights] = [alloc(4 * 8, true), alloc(4 * 4, true), alloc(4 * 4), alloc(4 * 4)];
        return { op: 'router', args: { logits: t(logits, 'f32', [2, 4]), bias: t(bias, 'f32', [4]), ids: t(ids, 'i32', [2, 2]), weights: t(weights, 'f32', [2, 2]), topk: 2, normTopkProb: flag(chance(0.5)), scaling: real(2.5) }, named: [logits, bias, ids, weights] };
      },
      () => {
        const [qw, sc, qp, sp] = [alloc(4 * 256, true), alloc(2 * 64, true), alloc(4 * 256), alloc(2 * 64)];
        return { op: 'w4a16Pack', args: { qw: t(qw, 'i32', [16, 16]), sc: t(sc, 'bf16', [16, 4]), qwPacked: t(qp, 'i32', [1, 1, 256]), scPacked: t(sp, 'bf16', [1, 1, 64]), group: 32, interleaveGateUp: flag(chance(0.5)) }, named: [qw, sc, qp, sp] };
      },
      () => {
        const caches = [alloc(4 * 64, true), alloc(4 * 64, true)];
        const [path, len] = [alloc(4 * 4, true), alloc(4, true)];
        return { op: 'kvCommit', args: { caches: caches.map((c) => t(c, 'f32', [16, 4])), path: t(path, 'i32', [4]), pathLen: t(len, 'i32', [1]), start: 0 }, named: [...caches, path, len] };
      },
    ];
    const launchAll = async () => {
      if (capturing) {
        graphs.push(native.endCapture(stream));
        capturing = false;
      }
      await h.collect(); // dropped buffers go; those a graph holds must stay
      for (const g of graphs) {
        try {
          native.launchGraph(g, stream);
          counts.launches++;
        } catch (error) {
          // a graph whose buffer was freed explicitly is refused; nothing else may fail
          h.assert(/was freed after the capture/.test(String((error as Error).message)), `launchGraph: ${String(error)}`);
        }
      }
      native.synchronize();
      while (graphs.length > 4) native.freeGraph(graphs.shift()!);
    };
    for (let i = 0; i < STEPS; i++) {
      bad = undefined;
      const made = pick(makers)();
      const { args } = made;
      // tensors (and the caches array) first: once args has getters, reading it runs them
      for (const v of Object.values(args)) if (v !== null && typeof v === 'object' && !('bytes' in v)) hostileProps(v as Record<string, unknown>);
      hostileProps(args);
      let receiver: unknown = native;
      if (chance(0.04)) {
        receiver = pick<unknown>([other, pool[0], graphs[0], {}, undefined]);
        bad = 'a foreign receiver';
      }
      const method = (Object.getPrototypeOf(native) as Record<string, (a: unknown) => void>)[made.op];
      try {
        method.call(receiver, args);
        counts.ran++;
        h.assert(bad === undefined, `step ${i}: ${made.op} ran with ${bad}`);
        for (const b of made.named) h.assert(!b.freed, `step ${i}: ${made.op} ran, but one of its buffers was freed during the call`);
      } catch (error) {
        if (String((error as Error).message).startsWith('check failed')) throw error;
        const code = (error as { code?: unknown }).code;
        const ok = error instanceof Error && ((typeof code === 'string' && code.startsWith('KDTREE_')) || (error instanceof TypeError && /Illegal invocation/.test(error.message)));
        h.assert(ok, `step ${i}: ${made.op} threw ${String(code)} ${String(error)}`);
        counts.threw++;
        if (bad !== undefined) counts.refused++;
      }
      // buffers leave the pool freed or merely dropped (then the GC, or a graph, decides)
      while (pool.length > 48) {
        const b = pool.shift()!;
        if (chance(0.5) && !b.freed) native.free(b);
      }
      if (i % 100 === 99) await launchAll();
    }
    await launchAll();
    for (const g of graphs) native.freeGraph(g);
    const x = h.upload(Float32Array.of(1, 2, 3));
    const y = native.alloc(12);
    native.add({ a: t(x, 'f32', [3]), b: t(x, 'f32', [3]), out: t(y, 'f32', [3]) });
    const got = h.download(y);
    h.assert(got[0] === 2 && got[1] === 4 && got[2] === 6, `add after the hostile calls: ${Array.from(got).join(', ')}`);
    h.assert(counts.ran > STEPS / 10 && counts.getters > 200 && counts.refused > 10 && counts.launches > 10, `too little was exercised: ${JSON.stringify(counts)}`);
  },
};

export const FUZZ_CHECKS: KernelCheck[] = [fuzz, lifetimes, childCheck('fuzz: 2000 seeded hostile calls in a child process run or throw a KDTREE_ error, never use a buffer freed during them, and the backend still works after', [hostile])];
