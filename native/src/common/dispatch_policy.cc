// The GEMM dispatch rules (dispatch_policy.h). Each rule's reason is beside it; the kernels they
// choose between are described in w4a16_gemm.cu, w4a16_wgmma.cu, w4a16_prefill.cu and gemm.cu.
#include "dispatch_policy.h"

#include <algorithm>
#include <cstring>

#include "kdtree/w4a16_layout.h"

namespace kdtree {
namespace policy {

Status ParsePrefillOverride(const char* v, PrefillOverride* out) {
  if (v == nullptr || v[0] == '\0') *out = PrefillOverride::kRule;
  else if (std::strcmp(v, "always") == 0) *out = PrefillOverride::kAlways;
  else if (std::strcmp(v, "never") == 0) *out = PrefillOverride::kNever;
  else return Invalid("w4a16: KDTREE_W4A16_PREFILL must be always or never, got '", v, "'");
  return Status::Ok();
}

Status ParseGemmForm(const char* v, GemmForm* out) {
  if (v == nullptr || v[0] == '\0') *out = GemmForm::kRule;
  else if (std::strcmp(v, "split") == 0) *out = GemmForm::kSplit;
  else if (std::strcmp(v, "rows") == 0) *out = GemmForm::kRows;
  else if (std::strcmp(v, "tiled") == 0) *out = GemmForm::kTiled;
  else if (std::strcmp(v, "tiled-split") == 0) *out = GemmForm::kTiledSplit;
  else if (std::strcmp(v, "wgmma") == 0) *out = GemmForm::kWgmma;
  else return Invalid("gemm: KDTREE_GEMM_FORM must be split, rows, tiled, tiled-split or wgmma, got '", v, "'");
  return Status::Ok();
}

const char* PrefillOverrideName(PrefillOverride o) {
  switch (o) {
    case PrefillOverride::kAlways: return "always";
    case PrefillOverride::kNever: return "never";
    default: return "";
  }
}

const char* GemmFormName(GemmForm f) {
  switch (f) {
    case GemmForm::kSplit: return "split";
    case GemmForm::kRows: return "rows";
    case GemmForm::kTiled: return "tiled";
    case GemmForm::kTiledSplit: return "tiled-split";
    case GemmForm::kWgmma: return "wgmma";
    default: return "";
  }
}

// ---- W4A16 ----

// Stream-K ranges from the shape and the device only (never from M or the token tile size, so rows
// stay batch-invariant): kW4A16WarpsPerSm warps per SM for one matrix, or shared by the `matrices`
// a decode launch streams (top-k experts of a token), in blocks of 8 warps; a block's range is at
// least one tile, so a tile spans at most two blocks. A caller may ask for longer warp ranges
// (MoeGemmArgs::min_warp_steps): fewer blocks per expert, which a verify that uses most experts
// could run faster and a decode step runs slower (docs/benchmarks/cuda.md, the MoE table).
W4A16Ranges W4A16ChooseRanges(int64_t total_steps, int tile_steps, int matrices, int64_t min_warp_steps, int sms) {
  constexpr int kWarps = kW4A16WarpsPerBlock;
  const int64_t target = std::max<int64_t>(1, static_cast<int64_t>(sms) * (kW4A16WarpsPerSm / kWarps) / std::max(1, matrices));
  const int64_t per_block = std::min(total_steps, std::max({(total_steps + target - 1) / target, int64_t{tile_steps}, min_warp_steps * kWarps}));
  W4A16Ranges r;
  r.steps_per_warp = static_cast<int>((per_block + kWarps - 1) / kWarps);
  r.steps_per_block = r.steps_per_warp * kWarps;
  r.blocks = static_cast<int>((total_steps + r.steps_per_block - 1) / r.steps_per_block);
  return r;
}

// Token tiles of 8 x NT tokens: NT 1, 2 and 4 cover decode and tree verify, 8 the rest (f16 and
// f32 x, test and reference paths: 1 or 8). 16-bit x is read in place (NT 1, and NT 2 in the
// in-place form) only when K is whole steps: its loads then need no K-tail predicate (~15
// instructions per step); other K stage it.
int W4A16ChooseNt(int rows, DType x, int k) {
  if (rows <= 8 && (k % w4::kStepK == 0 || x == DType::kF32)) return 1;
  if (x != DType::kBF16) return 8;
  return rows <= 16 ? 2 : rows <= 32 ? 4 : 8;
}

int WgmmaTileGroups(int tiles) { return (tiles + kWgmmaTileGroup - 1) / kWgmmaTileGroup; }

// Copies of the staged x, warpgroup i reading copy i % copies. All warpgroups of a token tile walk
// K in step together, so with one copy every x line of a step is read by all of them at once:
// about one copy per 32 of them spreads those reads (288 warpgroups: 8 copies ~7% faster than 1).
int WgmmaXCopies(int tile_groups) { return std::max(1, std::min(kWgmmaMaxXCopies, tile_groups / 32)); }

size_t WgmmaStagedBytes(int steps, int tiles) { return static_cast<size_t>(steps) * kWgmmaXStepBytes * WgmmaXCopies(WgmmaTileGroups(tiles)); }

// Token tiles per launch of the warpgroup kernel: enough for kWgmmaLaunchGroups warpgroups (at
// least 16 token tiles, at most 64), and no more than kWgmmaStagedBytesMax of staged x. Prefill
// runs many chunks, and a launch of few warpgroups leaves SMs idle (4096x7168 at 4 token tiles:
// 256 warpgroups for 396 slots) and ends on a tail: at least 16 token tiles per launch made
// prefill of the expert shapes up to 1.6x faster, and up to 64 helps the expert shapes (64-112
// warpgroups per token tile) while the dense ones (112-288) do not care. M <= 512 has at most 16
// token tiles.
constexpr int kWgmmaLaunchGroups = 8192;
constexpr int kWgmmaChunkTilesMin = 16, kWgmmaChunkTilesMax = 64;
int WgmmaChunk(int m, int steps, int tiles) {
  const int token_tiles = (m + kWgmmaTileTokens - 1) / kWgmmaTileTokens;
  const int groups = WgmmaTileGroups(tiles);
  const int by_groups = std::clamp((kWgmmaLaunchGroups + groups - 1) / groups, kWgmmaChunkTilesMin, kWgmmaChunkTilesMax);
  const int by_bytes = static_cast<int>(std::max<size_t>(1, kWgmmaStagedBytesMax / WgmmaStagedBytes(steps, tiles)));
  return std::min({token_tiles, by_groups, by_bytes});
}

bool PrefillSupports(int group, bool sc_f32) { return group == 64 || (group == 32 && !sc_f32); }

namespace {

struct W4A16Shape {
  int m, n, k, tiles, steps, group;
  DType x;
  bool sc_f32, moe;
};

// Dense bf16 x of 17 or more tokens runs on the warpgroup kernel (w4a16_wgmma.cu) where the binary
// and the device have it: the same bits as the stream-K kernels (it replays their ranges), and the
// weights streamed once per 32 tokens with x read by the tensor cores from shared memory, instead
// of 8-16 KB of x per warp and KB of weights (at 32-128 tokens on the large shapes 1.6-2.2x
// faster). At 9-16 tokens its 16-token form is slower than the stream-K kernel, so those stay
// there. A warpgroup takes 4 whole tiles and one token tile, and a lone warpgroup per SM is
// latency-bound: a launch needs >= 1.5 warpgroups per SM from N and its token tiles together, or
// >= 0.75 from 2 token tiles on (its dequant-ahead form hides the latency there, where the
// stream-K kernel's 64-token tiles read 16 KB of x per warp), but not at one token tile.
bool UseWgmma(const W4A16Shape& s, const Device& d) {
  // warpgroups of the first launch, in quarters per SM: >= 1.5 per SM, or >= 0.75 from 2 token tiles on
  const int64_t quarters = 4 * static_cast<int64_t>(WgmmaTileGroups(s.tiles)) * WgmmaChunk(s.m, s.steps, s.tiles);
  const bool enough = quarters >= 6 * d.sms || (s.m > kWgmmaTileTokens && quarters >= 3 * d.sms);
  return s.m > 16 && s.x == DType::kBF16 && !s.moe && enough && d.sm90a;
}

// Prefill sizes take w4a16_prefill.cu's kernel: a producer warpgroup dequantizes each weight once
// per 128 tokens into shared memory for two consumer warpgroups. Each of its blocks walks all of K
// for 64 rows, so it needs most SMs busy in its first wave (>= 3/4 of a block per SM). Against the
// 32-token kernel it is faster or even on every Kimi K2 shape from 256 tokens. Below that, one
// token tile of the prefill kernel costs about what 4 of the 32-token kernel's tiles do where its
// blocks make one wave, mostly full (the 7168-row shapes' 112 blocks at 97-128 tokens, where it is
// ~1.35x faster), and loses with half a wave (4096x7168: 64 blocks), two and a bit (18432x7168:
// 288), or a second, half-empty tile (129-255 tokens).
constexpr int kPrefillMinTokens = 256;
constexpr int kPrefillMinBlocksPerFourSms = 3;
bool PrefillRule(const W4A16Shape& s, int sms) {
  if (!PrefillSupports(s.group, s.sc_f32)) return false;
  const int64_t blocks = (s.tiles + 3) / 4 * static_cast<int64_t>((s.m + kPrefillTileTokens - 1) / kPrefillTileTokens);
  const bool wave_mostly_full = 4 * blocks >= kPrefillMinBlocksPerFourSms * static_cast<int64_t>(sms);
  // one token tile whose 32-token tiles would be 4 (97-128 tokens), in one wave
  const bool one_wave_tile = s.m > 3 * kWgmmaTileTokens && s.m <= kPrefillTileTokens && blocks <= sms;
  return wave_mostly_full && (s.m >= kPrefillMinTokens || one_wave_tile);
}

// Why the prefill kernel cannot run a call, or nullptr: it is sm_90a code for dense bf16 x of
// 17+ tokens (the warpgroup kernels' calls), groups 32 (bf16 scales) and 64.
const char* PrefillCannotRun(const W4A16Shape& s, const Device& d) {
  if (s.x != DType::kBF16) return "it takes bf16 x";
  if (s.moe) return "MoE calls run the stream-K kernel";
  if (s.m <= 16) return "it takes 17 or more tokens";
  if (!PrefillSupports(s.group, s.sc_f32)) return "it takes group 32 with bf16 scales or group 64";
  if (!d.sm90a) return "it is sm_90a code, which this device does not run";
  return nullptr;
}

// The stream-K kernel's form for a launch (see w4a16_gemm.cu's Form). Up to 4 tokens per tile:
// the one-token and even-column forms drop half of the 16 scale FMAs per step and half of a tile's
// parks, which makes 1-4 tokens cost about what one does. Two token groups of bf16 x read in place
// on matrices of up to 8192 x 8192 (the expert shapes): no staging launch and no per-warp copy; on
// the dense shapes, whose 16 rows of x are 590 KB, in place is slower, so they stay staged. In
// place needs whole steps of K (no K-tail predicates on the x loads).
W4A16Form ChooseForm(const W4A16Shape& s, int nt, int tile_tokens) {
  if (nt == 1 && tile_tokens == 1) return W4A16Form::kOneToken;
  if (nt == 1 && tile_tokens <= kW4A16EvenColumnTokens) return W4A16Form::kEvenColumns;
  if (nt == 2 && s.x == DType::kBF16 && s.k % w4::kStepK == 0 && s.n <= 8192 && s.k <= 8192) return W4A16Form::kXInPlace;
  return W4A16Form::kStandard;
}

// Pieces per warp (the stream-K kernel's kPieces): a MoE launch of the sorted path (a verify step)
// whose split gives each warp fewer than kW4A16PiecesMinSteps steps lets each warp stream
// kW4A16PiecesMax consecutive warps' ranges instead, in blocks of 8 / kW4A16PiecesMax warps. The
// split and its rounding stay those of the decode step, which needs the short ranges to fill the
// GPU with 8 experts, while a warp's weight stream gets 4 times longer, so its ring fills and
// drains once per 4 ranges instead of once per range of 4-7 KB (a tensor-parallel rank's 65-token
// verify step, 7 and 4 steps per range, runs ~1.3x faster; decode is unchanged). `minWarpSteps:
// 16`, which lengthens the ranges themselves, is no faster there and slows the decode step.
int PiecesPerWarp(const W4A16Shape& s, int nt, W4A16Form form, bool route, const W4A16Ranges& r) {
  const bool eligible = s.x == DType::kBF16 && nt == 1 && form != W4A16Form::kXInPlace && s.moe && !route;
  return eligible && r.steps_per_warp < kW4A16PiecesMinSteps ? kW4A16PiecesMax : 1;
}

}  // namespace

Status PlanW4A16(const W4A16Call& c, const Device& d, PrefillOverride o, W4A16Plan* plan) {
  W4A16Plan p;
  W4A16Shape s{};
  s.n = c.n;
  s.k = c.k;
  s.tiles = static_cast<int>(w4::Tiles(c.n));
  s.steps = static_cast<int>(w4::Steps(c.k));
  s.group = c.group;
  s.x = c.x;
  s.sc_f32 = c.sc_f32;
  s.moe = c.moe;
  int matrices = 1;
  if (!c.moe) {
    const int m = c.tokens;
    p.nt = W4A16ChooseNt(m, c.x, c.k);
    // one token, even columns, 8 x NT (ChooseForm)
    p.tile_tokens = p.nt > 1 ? 8 * p.nt : m == 1 ? 1 : m <= kW4A16EvenColumnTokens ? kW4A16EvenColumnTokens : 8;
    p.rows = m;
  } else {
    const int pairs = c.tokens * c.topk;
    // Token tiles sized for the rows an expert can expect (the pairs spread over the experts), not
    // for all the pairs: at a 65-token verify most of 384 experts get one or two rows, and tiles of
    // 64 ran them through the 64-token kernel, ~6x the time per weight byte of the 8-token one. An
    // expert with more rows than a tile gets several tiles.
    const int expected_rows = std::min(64, (pairs + c.experts - 1) / std::max(1, c.experts));
    p.nt = W4A16ChooseNt(expected_rows, c.x, c.k);
    p.route = p.nt == 1 && pairs <= kW4A16RoutePairsMax;  // routed inside the GEMM (RouteTile)
    // One token routed in the GEMM (a decode step): a tile per pair, in the one-token form. At most
    // 2 rows expected per expert, routed (a decode batch of 2-4 tokens) or sorted (a verify step):
    // tiles of up to 4 rows in the even-column form (ChooseForm). Both have half the scale FMAs of
    // an 8-row tile, which makes a verify step and a decode batch of 2-4 tokens 1-3% faster than
    // 8-row tiles.
    p.tile_tokens = p.route && c.tokens == 1 ? 1 : p.nt == 1 && expected_rows <= 2 ? kW4A16EvenColumnTokens : 8 * p.nt;
    p.rows = pairs;
    matrices = c.topk;
  }
  s.m = p.rows;
  const int64_t total = static_cast<int64_t>(s.tiles) * s.steps;
  p.ranges = W4A16ChooseRanges(total, s.steps, matrices, c.moe ? c.min_warp_steps : 0, d.sms);
  // `always` runs the prefill kernel on every W4A16 call or fails the call where that kernel
  // cannot run it, never falling back: a check named for the prefill kernel must have run it.
  if (o == PrefillOverride::kAlways) {
    if (const char* why = PrefillCannotRun(s, d)) {
      return Unsupported("w4a16: KDTREE_W4A16_PREFILL=always cannot run M = ", s.m, ", N = ", c.n, ", K = ", c.k, ", group ", c.group, " on the prefill kernel: ", why);
    }
    p.kernel = W4A16Kernel::kPrefill;
  } else if (UseWgmma(s, d)) {
    p.kernel = o == PrefillOverride::kRule && PrefillRule(s, d.sms) ? W4A16Kernel::kPrefill : W4A16Kernel::kWgmma;
  } else {
    p.form = ChooseForm(s, p.nt, p.tile_tokens);
    p.pieces = PiecesPerWarp(s, p.nt, p.form, p.route, p.ranges);
    // 16-bit x with more than one group of 8 tokens in the standard form (w4a16_gemm.cu's StagesX)
    p.stages_x = p.nt > 1 && c.x != DType::kF32 && p.form != W4A16Form::kXInPlace;
  }
  *plan = p;
  return Status::Ok();
}

const char* W4A16FormName(const W4A16Plan& p) {
  if (p.kernel == W4A16Kernel::kWgmma) return "wgmma";
  if (p.kernel == W4A16Kernel::kPrefill) return "prefill";
  const bool pieces = p.pieces > 1;
  switch (p.form) {
    case W4A16Form::kOneToken: return pieces ? "one-token-pieces" : "one-token";
    case W4A16Form::kEvenColumns: return pieces ? "even-columns-pieces" : "even-columns";
    case W4A16Form::kXInPlace: return pieces ? "x-in-place-pieces" : "x-in-place";
    default: return pieces ? "standard-pieces" : "standard";
  }
}

// ---- gemm ----

namespace {

// The K split: enough ranges that tiles x ranges fills warps_per_sm warps per SM, each at least
// kGemmMinRangeChunks chunks long, and at most one block's worth (8) unless the tiles cannot fill
// half the SMs: a range sum across blocks (work space, fences, a counter) costs more than the
// warps it adds on shapes with enough tiles (q_a_proj, layer 0's down), while shapes of few tiles
// (kv_a_proj_with_mqa, 36 tiles) need the extra ranges to fill the device. A function of N, K and
// the device only (batch invariance).
void GemmChooseRanges(GemmPlan* p, int sms, int warps_per_sm) {
  const int64_t want = (static_cast<int64_t>(sms) * warps_per_sm + p->tiles - 1) / p->tiles;
  const int64_t most = std::max<int64_t>(1, p->chunks / kGemmMinRangeChunks);
  const int64_t cap = 2 * static_cast<int64_t>(p->tiles) >= sms ? kGemmBlockWarps : most;
  const int64_t ranges = std::clamp<int64_t>(want, 1, std::min(most, cap));
  p->range_chunks = static_cast<int>((p->chunks + ranges - 1) / ranges);
  p->ranges = (p->chunks + p->range_chunks - 1) / p->range_chunks;
}

// The form the rule picks for a call (a function of its shape and the device only).
GemmForm PreferredForm(const GemmPlan& p, int m, int token_tiles, int sms, int64_t tiled_groups, bool tiled_fits, int64_t wgmma_blocks, bool wgmma_fits, int64_t groups) {
  const int64_t sm_count = sms;
  // The wgmma form: from 512 tokens on every shape with 17+ blocks (faster than every other form
  // there, also for kv_a_proj_with_mqa's 20-80 blocks); below 512 from one block per SM with one
  // token tile and from half of that with two or more (with fewer blocks, q_a_proj's 24 and
  // kv_a_proj_with_mqa's 10 at 256 tokens, it is 1.5-1.8x slower than the tiled forms).
  const bool wgmma_prefill = wgmma_fits && m >= kGemmWgmmaTokens;
  const bool several_token_tiles = (m + kGemmWgmmaTokens - 1) / kGemmWgmmaTokens >= 2;
  if (wgmma_prefill && m >= 512 && 8 * wgmma_blocks >= sm_count) return GemmForm::kWgmma;
  if (wgmma_prefill && (several_token_tiles ? 2 * wgmma_blocks : wgmma_blocks) >= sm_count) return GemmForm::kWgmma;
  // The tiled form once its blocks fill the device twice over: from 32 tokens on lm_head and the
  // dense MLP, 512+ tokens on 4608- and 7168-row shapes (faster than the rows form wherever it
  // fills the device; its blocks are 4 warps, so fewer blocks leave SMs idle).
  if (tiled_fits && tiled_groups * token_tiles >= 2 * sm_count) return GemmForm::kTiled;
  // With fewer groups, a block per range where the ranges are long enough to pay for the ring's
  // fill and the partials' round trip (16 chunks, 8 stages of the ring: ranges of 8 lose to the
  // split form at 32-64 tokens on layer 0's down, 7168 x 2304, those of 28 win on q_a_proj).
  if (tiled_fits && p.ranges > 1 && p.range_chunks >= kGemmTiledSplitMinChunks && tiled_groups * p.ranges * token_tiles >= sm_count) return GemmForm::kTiledSplit;
  // Below those, the wgmma form still beats the rows and split forms from 128 tokens once it has a
  // quarter of the SMs' worth of blocks (o_proj and layer 0's down at 128 tokens, 56 blocks; with
  // 12 or 5 blocks, q_b_proj and kv_a_proj, it is 2.5-3.6x slower).
  if (wgmma_prefill && 4 * wgmma_blocks >= sm_count) return GemmForm::kWgmma;
  // Then the rows form once its blocks fill the device twice over. Below that the split form is
  // faster even where its warps each read their own x (a form with the rows form's 8 tiles per
  // block and one range per block, summed across blocks, takes 1.1-5x as long at 32-128 tokens:
  // its last block per group sums 8 tiles' ranges alone).
  if (groups > kMaxGridY) return GemmForm::kSplit;
  return groups * token_tiles >= 2 * sm_count ? GemmForm::kRows : GemmForm::kSplit;
}

// How far ahead a warp of the split or rows form loads. At one token tile of 16-bit x a warp holds
// 4 KB of weights in flight at 4 chunks ahead; at 8 (no spills) the decode projections with long
// ranges stream faster (on an H200 at one token: lm_head 1.5%, o_proj 5% and layer 0's MLP 8% less
// time), while those with short ranges ([q_a; kv_a], q_b and the shared expert, 8-28 chunks) took
// about 1 us more each at 8, fewer warps fitting an SM: they keep 4. Wider token tiles and f32 x
// (three planes) take the shallow depth.
int GemmLoadAhead(int nt, DType x, int range_chunks) {
  const int planes = x == DType::kF32 ? 3 : 1;
  const bool deep = nt == 1 && planes == 1 && range_chunks >= kGemmDeepMinRangeChunks;
  return deep ? kGemmDeepLoadAhead : GemmShallowLoadAhead(nt, planes);
}

}  // namespace

Status PlanGemm(const GemmCall& c, const Device& d, GemmForm forced, GemmPlan* plan) {
  GemmPlan p;
  p.chunks = (c.k + kGemmChunkK - 1) / kGemmChunkK;
  p.tiles = (c.n + kGemmTileRows - 1) / kGemmTileRows;
  GemmChooseRanges(&p, d.sms, c.warps_per_sm);
  // Token tiles of 8, 16, 32 or 64 tokens (32 at most for f32 x, whose fragments are 3 planes).
  const int eights = (c.m + 7) / 8;
  p.nt = eights <= 1 ? 1 : eights <= 2 ? 2 : eights <= 4 || c.x == DType::kF32 ? 4 : 8;
  p.load_ahead = GemmLoadAhead(p.nt, c.x, p.range_chunks);
  const int token_tiles = (c.m + 8 * p.nt - 1) / (8 * p.nt);
  const int64_t tiled_groups = (p.tiles + kGemmTiledWarps - 1) / kGemmTiledWarps;
  const bool sixteen_bit = p.nt >= 4 && c.x != DType::kF32;
  // (a thread's copy offsets within 64 rows, or 128 for the wgmma form, are 32-bit)
  const bool tiled_fits = sixteen_bit && tiled_groups * p.ranges <= kMaxGridY && int64_t{kGemmTiledWarps * kGemmTileRows} * c.k * 2 < (int64_t{1} << 32);
  const int64_t wgmma_groups = (c.n + kGemmWgmmaRows - 1) / kGemmWgmmaRows;
  const int64_t wgmma_blocks = wgmma_groups * ((c.m + kGemmWgmmaTokens - 1) / kGemmWgmmaTokens);
  const bool wgmma_size_fits = sixteen_bit && wgmma_groups <= kMaxGridY && int64_t{kGemmWgmmaRows} * c.k * 2 < (int64_t{1} << 32);
  const int64_t groups = (p.tiles + kGemmBlockWarps - 1) / kGemmBlockWarps;
  if (forced == GemmForm::kRule) {
    p.form = PreferredForm(p, c.m, token_tiles, d.sms, tiled_groups, tiled_fits, wgmma_blocks, wgmma_size_fits && d.sm90a, groups);
    *plan = p;
    return Status::Ok();
  }
  // A forced form that cannot run the call is an error, not a fallback: a check or a benchmark
  // named for a form must have run that form. The tiled and wgmma forms take 16-bit x from 17
  // tokens (NT >= 4), the tiled forms in token tiles of 32 or 64, the wgmma form (sm_90a) in tiles
  // of 128.
  const char* name = GemmFormName(forced);
  const auto cannot = [&](const char* why) { return Unsupported("gemm: KDTREE_GEMM_FORM=", name, " cannot run M = ", c.m, ", N = ", c.n, ", K = ", c.k, ": ", why); };
  const char* sixteen_bit_only = "the tiled and wgmma forms take bf16 or f16 x of 17 or more tokens";
  switch (forced) {
    case GemmForm::kRows:
      if (groups > kMaxGridY) return cannot("its tile groups exceed a grid's 65535 rows");
      break;
    case GemmForm::kTiled:
    case GemmForm::kTiledSplit:
      if (!sixteen_bit) return cannot(sixteen_bit_only);
      if (!tiled_fits) return cannot("its tile groups exceed a grid or 64 rows of K exceed 32-bit offsets");
      break;
    case GemmForm::kWgmma:
      if (!sixteen_bit) return cannot(sixteen_bit_only);
      if (!d.sm90a) return cannot("the wgmma form is sm_90a code, which this device does not run");
      if (!wgmma_size_fits) return cannot("its 128-row groups exceed a grid or 128 rows of K exceed 32-bit offsets");
      break;
    default:
      break;
  }
  p.form = forced;
  *plan = p;
  return Status::Ok();
}

// ---- ddtree_build ----

// One launch where its layouts hold the call: k = budget <= 32 candidates a warp and at most 32
// depths; a row a block of a cluster where the rows fit one cluster and a row fits a block's
// registers at 8 values a thread (the cluster build), else each slice's values within its lanes'
// registers (the fused build). Larger budgets, depths or vocabularies run the four-launch build
// (radix-select top-k, log-sum-exp slices and merge, a one-block build). The cluster build's cost
// grows with the values a block (a part's pass is bound by its SM's issue rate): at 16 values a
// thread and two rows a block it lost to the fused build; at one row of up to 8192 values a block
// it wins, and rows past 4096 values over two blocks take ~1.2 us less again at budgets up to 16
// (docs/benchmarks/cuda.md).
DdtreeBuildForm PlanDdtreeBuild(int64_t budget, int64_t depth, int64_t vocab) {
  const bool one_launch = budget >= 1 && budget <= kDdtreeFusedMaxBudget && depth >= 1 && depth <= kDdtreeFusedMaxDepth && vocab >= 1 && vocab <= kDdtreeFusedMaxVocab;
  if (!one_launch) return DdtreeBuildForm::kPasses;
  if (depth > kDdtreeClusterMaxBlocks || vocab > kDdtreeClusterMaxVocab) return DdtreeBuildForm::kFused;
  return vocab > kDdtreeClusterHalfVocab ? DdtreeBuildForm::kClusterHalves : DdtreeBuildForm::kCluster;
}

const char* DdtreeBuildFormName(DdtreeBuildForm form) {
  switch (form) {
    case DdtreeBuildForm::kCluster: return "cluster";
    case DdtreeBuildForm::kClusterHalves: return "cluster-halves";
    case DdtreeBuildForm::kFused: return "fused";
    case DdtreeBuildForm::kPasses: return "passes";
  }
  return "passes";
}

}  // namespace policy
}  // namespace kdtree
