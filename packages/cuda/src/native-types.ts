/** The shape of the native module (native/src/binding/addon.cc). */
export type NativeDtype = 'f32' | 'f16' | 'bf16' | 'i32' | 'u8' | 'f64';

export interface NativeBuffer {
  readonly bytes: number;
  readonly freed: boolean;
  readonly backend: string;
}

/**
 * The ops one capture queued on a stream (beginCapture .. endCapture), replayed by launchGraph. The
 * buffers, shapes and host scalars of its ops are fixed at capture; buffer contents are read at each
 * launch. It keeps its buffers from being collected; launching it after one was freed throws.
 */
export interface NativeGraph {
  /** Op calls captured. */
  readonly calls: number;
  readonly freed: boolean;
  readonly backend: string;
}

export interface TensorArg {
  buffer: NativeBuffer;
  dtype: NativeDtype;
  shape: readonly number[];
  /** Byte offset into the buffer. */
  offset?: number;
}

export interface NativeDeviceInfo {
  kind: 'cpu' | 'cuda';
  name: string;
  computeCapability: string;
  multiprocessors: number;
  totalMemory: number;
  driverVersion: number;
  runtimeVersion: number;
}

/** The experts of a moeGemm: packed W4A16 (qw, sc) or bf16 as stored (w), one or the other. */
export type MoeExperts = { qw: TensorArg; sc: TensorArg; w?: undefined } | { w: TensorArg; qw?: undefined; sc?: undefined };

/** What a W4A16 GEMM applies to its output before storing it. */
export type W4A16Epilogue = 'none' | 'siluMul';

/**
 * A backend (createBackend). Every call reads all its arguments first (getters run only then),
 * validates them, then runs; a buffer it names is pinned from the moment it is read until the call
 * returns. Flags must be booleans, float scalars finite numbers, option strings strings; integers
 * are range-checked (positions within i32). The classes behind backends, buffers and graphs cannot
 * be constructed from JavaScript, and their methods and getters throw on a foreign `this`.
 */
export interface NativeBackend {
  readonly kind: 'cpu' | 'cuda';
  info(): NativeDeviceInfo;
  /**
   * Forces kernel forms of the cuda GEMMs (tests, tuning) and returns the previous setting. A key
   * absent or null is the rule. `gemm` is what KDTREE_GEMM_FORM takes, `w4a16Prefill` what
   * KDTREE_W4A16_PREFILL takes: createBackend reads those two variables once (an unknown value
   * makes it throw) and no op reads the environment after that. An unknown value throws
   * KDTREE_INVALID_ARGUMENT; a forced form that cannot run a call makes that call throw
   * KDTREE_UNSUPPORTED, never run another form. The cpu backend checks the values and runs its one
   * form.
   */
  setForcedForms(forms: ForcedForms): ForcedFormsSetting;
  /**
   * The kernel form the last gemm, w4a16Gemm, moeGemm or ddtreeBuild call of this backend ran (KernelForm):
   * null before the first, after a call that ran nothing (an empty shape) and after a call that
   * failed in the backend (a forced form that cannot run it); a call refused for its arguments
   * leaves it as it was. The cpu backend reports 'cpu'.
   */
  lastForm(): KernelForm | null;
  alloc(bytes: number): NativeBuffer;
  /**
   * Frees at once (a safe point, see memoryInfo). Throws for a buffer pinned by a call still
   * reading its arguments (a getter freeing it). A buffer the GC collects is not freed by its
   * finalizer, which may run in the middle of a step, but at the next safe point: an explicit
   * free, a synchronize or the next alloc / allocHost (graphs likewise).
   */
  free(buffer: NativeBuffer): void;
  /**
   * Pinned (page-locked) host memory of `bytes` bytes as an ArrayBuffer (cpu: ordinary aligned
   * memory): upload() from it (or a view of it) is asynchronous on its stream. Lifetime: it stays
   * valid until freeHost(array); one the GC collects without freeHost is freed at the next safe
   * point after the device finished with it. Pinned memory is a scarce resource: pin staging
   * buffers, not whole models.
   */
  allocHost(bytes: number): ArrayBuffer;
  /**
   * Frees allocHost memory now, after the device finished every copy (it waits for the whole
   * device; not during a capture), and detaches the ArrayBuffer: its views then have length 0.
   * Accepts the ArrayBuffer or a view of it; throws for any other memory, or freed twice.
   */
  freeHost(array: ArrayBuffer | ArrayBufferView): void;
  /**
   * Host -> device on `stream` (default 0). From allocHost memory the copy is queued and the call
   * returns at once: leave the data unchanged until the stream has passed it (synchronize, or an
   * event). From any other memory it is complete on return. Not on a capturing stream.
   */
  upload(buffer: NativeBuffer, data: ArrayBufferView, offset?: number, stream?: number): void;
  /** Device -> host after the work queued on `stream` (default 0); complete on return. */
  download(buffer: NativeBuffer, into: ArrayBufferView, offset?: number, stream?: number): void;
  /**
   * Free and total device memory in bytes (cudaMemGetInfo; cpu: the host's MemAvailable and
   * MemTotal). `collected`: bytes of buffers and pinned memory the GC collected that the next safe
   * point frees (not yet counted in `free`): synchronize() first for the figure after them.
   */
  memoryInfo(): { free: number; total: number; collected: number };
  copy(args: { dst: NativeBuffer; src: NativeBuffer; bytes?: number; dstOffset?: number; srcOffset?: number; stream?: number }): void;
  fill(buffer: NativeBuffer, value: number, stream?: number): void;
  /** Keeps the stream busy for about `microseconds` on the device (cuda); returns at once on cpu. */
  hold(microseconds: number, stream?: number): void;
  createStream(): number;
  destroyStream(stream: number): void;
  synchronize(stream?: number): void;
  createEvent(): number;
  /** Throws for an unknown (or already destroyed) event. */
  destroyEvent(event: number): void;
  /** Throws for an unknown event or stream. */
  recordEvent(event: number, stream?: number): void;
  /** Milliseconds between two recorded events (waits for `end`); throws if either was never recorded. */
  elapsedMs(start: number, end: number): number;
  /**
   * Work queued on `stream` (default 0) after this call waits for the work queued before the
   * event's last recordEvent, on the device (cudaStreamWaitEvent; the host does not wait): a
   * dependency between streams. An event never recorded is no wait. Not on a capturing stream.
   * The cpu backend runs every op synchronously, so it only checks the event and the stream.
   */
  waitEvent(event: number, stream?: number): void;
  /**
   * Ops queued on `stream` (a created stream, not 0) are captured into a graph instead of run, until
   * endCapture. Meanwhile synchronize, recordEvent and destroyStream on that stream throw.
   */
  beginCapture(stream: number): void;
  endCapture(stream: number): NativeGraph;
  /** Replays the graph's ops on `stream` (default 0), queued after its earlier work. */
  launchGraph(graph: NativeGraph, stream?: number): void;
  freeGraph(graph: NativeGraph): void;
  /**
   * interleaveGateUp: qw and sc hold an MLP's [gate; up] rows (N = 2I); packed as tiles of 8 gate rows
   * and the same 8 up rows, the layout the 'siluMul' epilogue reads (a GEMM without it then writes
   * the columns in that order). The packed buffers remember what they hold (E, N, K, the group,
   * interleaveGateUp) at the offsets written, until upload, copy or fill writes there: w4a16Gemm
   * and moeGemm then reject an x of another K, a y of another N, another group, a siluMul epilogue
   * on weights packed without interleaveGateUp, and qw and sc of different packs.
   */
  w4a16Pack(args: { qw: TensorArg; sc: TensorArg; qwPacked: TensorArg; scPacked: TensorArg; group?: number; interleaveGateUp?: boolean; stream?: number }): void;
  /**
   * epilogue 'siluMul' (weights packed with interleaveGateUp, 2I rows): y [M, I] = silu(gate) * up,
   * with gate and up rounded to y's dtype first, so the bits equal the plain GEMM's [M, 2I] output
   * followed by siluMul. Default 'none'.
   */
  w4a16Gemm(args: { x: TensorArg; qw: TensorArg; sc: TensorArg; y: TensorArg; group?: number; epilogue?: W4A16Epilogue; stream?: number }): void;
  /**
   * y [M, N] = x [M, K] . w^T with w [N, K] in 16-bit floats as the checkpoint stores it (no
   * packing): bf16 w with bf16 or f32 x, or f16 w with f16 x; f32 sums, y f32, bf16 or f16. K must be
   * a multiple of 8 and x, w must start 16-byte aligned. A row's bits do not depend on M (the K
   * split depends on N, K and the device only).
   */
  gemm(args: { x: TensorArg; w: TensorArg; y: TensorArg; stream?: number }): void;
  /**
   * The experts' weights are packed W4A16 (`qw`, `sc` from w4a16Pack, with a leading E), or bf16
   * as the checkpoint stores them (`w` [E, N, K], x f32 or bf16, K a multiple of 8, x and w 16-byte
   * aligned; with the siluMul epilogue its 2I rows are gate then up, in checkpoint order). On bf16
   * experts every value is one f32 dot product in a fixed order (the same sums on both backends)
   * and whatever else is in the call (batch-invariant); the cuda kernel is plain, not tuned.
   *
   * minWarpSteps (cuda, W4A16 experts; default 0): the least weight steps (16 rows x 128 k) in each
   * warp range of the split. Longer ranges mean fewer blocks per expert: slower for a decode step. A
   * row's bits depend on it, so use one value for every call on the same weights (decode and verify
   * then agree bit for bit). A verify with short ranges already streams several ranges per warp
   * (same bits), which is faster than 16 on one tensor-parallel rank's experts.
   */
  moeGemm(args: MoeExperts & {
    x: TensorArg;
    ids: TensorArg;
    weights?: TensorArg;
    y: TensorArg;
    group?: number;
    mode?: 'gather' | 'sum';
    /** 'siluMul' in gather mode: as w4a16Gemm's, y [T*topk, I] from gate_up weights of 2I rows. */
    epilogue?: W4A16Epilogue;
    minWarpSteps?: number;
    stream?: number;
  }): void;
  /**
   * cacheC [S, R] and cacheKpe [S, rope]: f32 or bf16, both the same; out [T, H, v] f32 or bf16 (the
   * o_proj GEMM's input, rounded to nearest even from the same f32 sums). `base`: the committed slots;
   * with `baseOnDevice` (i32 [1]) they are read on the device when the kernels run, so one captured
   * graph serves every step, and `base` bounds them (grid and work space are sized for it; a larger
   * value is clamped on the GPU and rejected by the cpu backend). The bits are those of the call
   * with that value as `base`.
   */
  mlaAttention(args: {
    qNope: TensorArg;
    qPe: TensorArg;
    kvB: TensorArg;
    cacheC: TensorArg;
    cacheKpe: TensorArg;
    mask?: TensorArg;
    out: TensorArg;
    base: number;
    baseOnDevice?: TensorArg;
    scale: number;
    stream?: number;
  }): void;
  embedding(args: { table: TensorArg; ids: TensorArg; out: TensorArg; stream?: number }): void;
  /**
   * out = x * rsqrt(mean(x^2) + eps) * weight, per row; out f32 or bf16 (rounded to nearest even: the
   * input of a GEMM, read as one bf16 plane). With `residual` (and `sum`, both f32 like x):
   * the norm of x + residual, which is also written to `sum` (which may be x or residual itself): a
   * residual add fused into the next norm, with the bits of add followed by rmsNorm. `outBf16` (bf16,
   * like x, with an f32 out): the same values rounded to nearest even as well, from the one pass (a
   * MoE layer's router reads the f32 norm, its experts the bf16 copy).
   */
  rmsNorm(args: { x: TensorArg; weight: TensorArg; out: TensorArg; eps: number; residual?: TensorArg; sum?: TensorArg; outBf16?: TensorArg; stream?: number }): void;
  rope(args: { x: TensorArg; positions: TensorArg; invFreq: TensorArg; offset?: number; attentionFactor?: number; interleave?: boolean; stream?: number }): void;
  siluMul(args: { x: TensorArg; out: TensorArg; stream?: number }): void;
  /**
   * Non-causal grouped-query attention of a block (a DFlash drafter's layer): q f32 [T, Hq, D]
   * (normed and rotated); keys and values are the first `contextLength` rows of kCache / vCache
   * (f32 or bf16 [S, Hkv, D], contextLength <= S) followed by the block's own k / v (f32 [T, Hkv,
   * D]). Every query sees every one of those keys; query head h reads KV head h / (Hq / Hkv) (Hq a
   * multiple of Hkv). out [T, Hq, D] f32 or bf16 = softmax(q . k^T * scale) . v, f32 sums. D is 1..256.
   * With `contextLengthOnDevice` (i32 [1]) the length is read on the device when the kernel runs,
   * so one captured step serves every length; `contextLength` is then its bound (<= S) and the
   * value read is clamped to [0, contextLength].
   */
  gqaAttention(args: { q: TensorArg; kCache: TensorArg; vCache: TensorArg; k: TensorArg; v: TensorArg; out: TensorArg; contextLength: number; contextLengthOnDevice?: TensorArg; scale: number; stream?: number }): void;
  add(args: { a: TensorArg; b: TensorArg; out: TensorArg; stream?: number }): void;
  router(args: { logits: TensorArg; bias: TensorArg; ids: TensorArg; weights: TensorArg; topk: number; nGroup?: number; topkGroup?: number; normTopkProb?: boolean; scaling?: number; stream?: number }): void;
  argmax(args: { x: TensorArg; out: TensorArg; stream?: number }): void;
  topk(args: { x: TensorArg; values: TensorArg; ids: TensorArg; k: number; stream?: number }): void;
  /** f32 rows into an f32 or bf16 cache (rounded to nearest even). */
  kvWrite(args: { c: TensorArg; kpe: TensorArg; cacheC: TensorArg; cacheKpe: TensorArg; slots: TensorArg; stream?: number }): void;
  /**
   * MLA's inputs from its fused down projection x f32 [T, W] = [q_a (Q) ... | c (R) | k_pe (rope)]
   * (the kv part in x's last R + rope columns): qAOut [T, Q] = rmsNorm(x[:, :Q], qANorm) when
   * qANorm is given, and token t's latent KV into slot slots[t] of the cache: rmsNorm(c, kvANorm)
   * and rope(k_pe). The bits of rmsNorm, rope and kvWrite on the same rows, in one launch.
   */
  mlaInputs(args: {
    x: TensorArg;
    qANorm?: TensorArg;
    qAOut?: TensorArg;
    kvANorm: TensorArg;
    cacheC: TensorArg;
    cacheKpe: TensorArg;
    slots: TensorArg;
    positions: TensorArg;
    invFreq: TensorArg;
    eps: number;
    attentionFactor?: number;
    interleave?: boolean;
    stream?: number;
  }): void;
  /**
   * MLA's query from q_b's output x f32 [T, W] = [nope parts of H heads (H * nope) | their rope
   * parts (H * rope)] (x's first columns): qNope [T, H, nope] copied, qPe [T, H, rope] = rope of
   * the rope parts (the bits of rope).
   */
  mlaQuery(args: { x: TensorArg; qNope: TensorArg; qPe: TensorArg; positions: TensorArg; invFreq: TensorArg; attentionFactor?: number; interleave?: boolean; stream?: number }): void;
  /** rootOnDevice / startOnDevice (i32 [1] each, e.g. the last accept's bonus and the committed length) replace root / start. */
  ddtreeBuild(args: {
    draftLogits: TensorArg;
    root?: number;
    rootOnDevice?: TensorArg;
    budget: number;
    start?: number;
    startOnDevice?: TensorArg;
    tokens: TensorArg;
    parents: TensorArg;
    depths: TensorArg;
    positions: TensorArg;
    mask: TensorArg;
    size: TensorArg;
    /** Optional f32 [B+1] output: each node's cumulative draft log-probability (0 at the root, -inf past size), best first. */
    logProbs?: TensorArg;
    stream?: number;
  }): void;
  ddtreeAccept(args: { tokens: TensorArg; parents: TensorArg; size: TensorArg; targetArgmax: TensorArg; path: TensorArg; pathLen: TensorArg; bonus: TensorArg; stream?: number }): void;
  /**
   * caches: f32 or bf16 [S, width] each. startOnDevice (i32 [1]) replaces start; nextStart (i32 [1],
   * which may be startOnDevice itself) receives start + pathLen, the next step's committed length.
   */
  kvCommit(args: { caches: TensorArg[]; path: TensorArg; pathLen: TensorArg; start?: number; startOnDevice?: TensorArg; nextStart?: TensorArg; stream?: number }): void;
  /**
   * out[i] = start + startOnDevice[0] + i (i32; start defaults to 0): a step's positions and cache
   * slots from the committed length on the device, or that length moved on (out may be startOnDevice).
   */
  arange(args: { out: TensorArg; start?: number; startOnDevice?: TensorArg; stream?: number }): void;
  /**
   * NCCL (cuda only; libnccl.so.2 is loaded on first use). Arguments are checked on every backend;
   * then the cpu backend, and the cpu variant, throw KDTREE_UNSUPPORTED. ncclInit is
   * ncclCommInitRank on this backend's device: it blocks until all `world` ranks have joined, with
   * `id` the 128 bytes of ncclUniqueId() from rank 0. Returns a communicator handle. A native
   * watchdog thread polls the communicator every `watchdogMs` (default 50): on an asynchronous
   * error, or an armed deadline passing (ncclArm), it aborts it, so a thread blocked waiting for a
   * dead rank returns; every later call on it throws the reason, which names the rank.
   */
  ncclInit(args: { world: number; rank: number; id: Uint8Array; watchdogMs?: number }): number;
  /** The watchdog aborts the communicator unless re-armed or disarmed (ms = 0) within `ms`. */
  ncclArm(comm: number, ms: number): void;
  /** recv = the sum over ranks of send (float dtypes; send may be recv), queued on the stream and captured with it. */
  ncclAllReduce(args: { comm: number; send: TensorArg; recv: TensorArg; stream?: number }): void;
  /** recv = every rank's send back to back, rank r's at r x numel(send). */
  ncclAllGather(args: { comm: number; send: TensorArg; recv: TensorArg; stream?: number }): void;
  /** recv on every rank = send on rank `root` (send is read on the root only). */
  ncclBroadcast(args: { comm: number; send: TensorArg; recv: TensorArg; root: number; stream?: number }): void;
  /** ncclCommGetAsyncError: result 0 ok, 7 in progress, anything else a failure that `message` describes; `aborted` when the watchdog ended it (`message` says why). */
  ncclAsyncError(comm: number): { result: number; message: string; aborted: boolean };
  /** ncclCommAbort: ends the communicator at once; collectives queued on it fail instead of waiting. */
  ncclAbort(comm: number): void;
  /** ncclCommDestroy: ends it after its queued work (every rank must reach it). */
  ncclDestroy(comm: number): void;
}

export interface CudaProbe {
  ok: boolean;
  error: string;
  driverVersion: number;
  runtimeVersion: number;
  deviceCount: number;
  devices: { name: string; computeCapability: string; multiprocessors: number; totalMemory: number }[];
}

/** A cuda GEMM form KDTREE_GEMM_FORM / setForcedForms({ gemm }) can force. */
export type GemmForm = 'split' | 'rows' | 'tiled' | 'tiled-split' | 'wgmma';
/** KDTREE_W4A16_PREFILL / setForcedForms({ w4a16Prefill }): the prefill kernel on every W4A16 call, or never. */
export type W4A16PrefillOverride = 'always' | 'never';
export interface ForcedForms {
  gemm?: GemmForm | null;
  w4a16Prefill?: W4A16PrefillOverride | null;
}
export interface ForcedFormsSetting {
  gemm: GemmForm | null;
  w4a16Prefill: W4A16PrefillOverride | null;
}
/**
 * The W4A16 forms (w4a16Gemm, moeGemm): the warpgroup kernel ('wgmma'), the prefill kernel, or a
 * form of the stream-K kernel ('one-token', 'even-columns', 'x-in-place', 'standard'; '-pieces'
 * where each warp streams several ranges, a MoE verify step).
 */
export type W4A16Form =
  | 'wgmma'
  | 'prefill'
  | 'one-token'
  | 'even-columns'
  | 'x-in-place'
  | 'standard'
  | 'one-token-pieces'
  | 'even-columns-pieces'
  | 'x-in-place-pieces'
  | 'standard-pieces';
/** The builds of ddtreeBuild on cuda (dispatchPolicy 'ddtreeBuild'). */
export type DdtreeBuildForm = 'cluster' | 'cluster-halves' | 'fused' | 'passes';

/** What lastForm() reports: a gemm form, a W4A16 form, moeGemm on bf16 experts, a DDTree build, or the cpu twin. */
export type KernelForm = GemmForm | W4A16Form | 'bf16-experts' | DdtreeBuildForm | 'cpu';

/** A GEMM call (or a DDTree build) as the cuda dispatch rules see it (dispatchPolicy). */
export interface DispatchQuery {
  op: 'gemm' | 'w4a16Gemm' | 'moeGemm' | 'ddtreeBuild';
  /** Tokens: M of gemm and w4a16Gemm, the tokens (ids rows) of moeGemm; the depth of ddtreeBuild. */
  m: number;
  /** Output rows of the weight (for a siluMul epilogue the gate_up rows, 2x y's columns; the vocabulary of ddtreeBuild). */
  n: number;
  /** The reduced dimension; the budget of ddtreeBuild. */
  k: number;
  /** The device: its multiprocessors, and whether it runs the sm_90a (warpgroup MMA) kernels. */
  sms: number;
  sm90a: boolean;
  xDtype?: 'bf16' | 'f16' | 'f32';
  /** W4A16: group size (32) and scale dtype (bf16). */
  group?: number;
  scales?: 'bf16' | 'f32';
  /** moeGemm: experts, top-k and minWarpSteps as the call passes them. */
  experts?: number;
  topk?: number;
  minWarpSteps?: number;
  /** Forced forms, as setForcedForms takes them. */
  gemmForm?: GemmForm;
  w4a16Prefill?: W4A16PrefillOverride;
  /** gemm: the warps per SM its K split aims for (a build option of the cuda variant; 32). */
  warpsPerSm?: number;
}
/** The plan of a gemm call: its form, token groups of 8 per tile, its K split, and how far ahead a warp loads. */
export interface GemmDispatch {
  form: GemmForm;
  nt: number;
  ranges: number;
  rangeChunks: number;
  /** Chunks of 32 k a warp of the split and rows forms loads before it uses the first (4 KB of weights each at one token). */
  loadAhead: number;
}
/** The plan of a W4A16 call: its form, tile shape, and stream-K ranges. */
export interface W4A16Dispatch {
  form: W4A16Form;
  nt: number;
  tileTokens: number;
  /** Rows of the launch: M, or tokens x top-k pairs. */
  rows: number;
  /** moeGemm: routed inside the GEMM (a decode step) instead of sorted first. */
  routed: boolean;
  stagesX: boolean;
  blocks: number;
  stepsPerWarp: number;
}

export interface NativeModule {
  createBackend(kind: 'cpu' | 'cuda', device?: number): NativeBackend;
  /**
   * The form and launch shape the cuda backend's GEMMs choose for a call on a device, from the
   * same C++ rules (native/src/common/dispatch_policy.cc), on either variant; throws as the call
   * would where a forced form cannot run it.
   */
  dispatchPolicy(query: DispatchQuery & { op: 'gemm' }): GemmDispatch;
  dispatchPolicy(query: DispatchQuery & { op: 'w4a16Gemm' | 'moeGemm' }): W4A16Dispatch;
  /**
   * Which build a ddtreeBuild call of that depth (m), vocabulary (n) and budget (k) runs on cuda:
   * one launch ('cluster': a row a block, the rows' blocks one cluster; 'cluster-halves': the same
   * with a row over two blocks, for rows past 4096 tokens, where the device holds a cluster of
   * 2 x depth blocks (else lastForm() reports 'cluster'); 'fused': slices of the rows over the
   * grid) or four ('passes').
   */
  dispatchPolicy(query: DispatchQuery & { op: 'ddtreeBuild' }): { form: DdtreeBuildForm };
  build: { version: string; variant: 'cpu' | 'cuda'; cudaArchitectures: string; napiVersion: number };
  cudaProbe?: () => CudaProbe;
  /** NCCL's version (22703 is 2.27.3); throws naming libnccl.so.2 where it cannot be loaded, and on the cpu variant. */
  ncclVersion(): number;
  /** A fresh ncclUniqueId (128 bytes) for rank 0 to hand to every rank's ncclInit. */
  ncclUniqueId(): Uint8Array;
}

export interface BuildMeta {
  name: string;
  version: string;
  variant: 'cpu' | 'cuda';
  platform: string;
  arch: string;
  napiVersion: number;
  cudaVersion: string | null;
  cudaArchitectures: string[];
  /** Hash of the native sources the binary was built from (build-native.mjs rebuilds when it changes). */
  sourceHash?: string;
  /** When it was built (ISO 8601). */
  built?: string;
}
