// Which kernel form runs a GEMM call: the dispatch rules of the cuda GEMMs (w4a16_gemm.cu and its
// warpgroup kernels, gemm.cu) as plain C++, a function of the call's shape, the device and the
// forced forms only. The cuda backend launches what a plan says; the addon's dispatchPolicy()
// returns the same plan on every variant, so a table test on the cpu build pins the forms chosen
// for the Kimi K2 shapes (packages/cuda/src/dispatch-policy.test.ts): a change of rule is a
// change of that table.
//
// Every rule here is a function of N, K, the group and the device for the stream-K ranges (never
// of M: rows stay batch-invariant), and of M as well for the form; all forms of one family compute
// every output in the same order, so the rules choose speed, never bits. The measurements behind
// each threshold are in docs/gpu/notes.md; docs/benchmarks/cuda.md has the resulting figures.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kdtree/status.h"
#include "kdtree/tensor.h"

namespace kdtree {
namespace policy {

// What of the device the rules read.
struct Device {
  int sms = 0;         // multiprocessors
  bool sm90a = false;  // the binary's sm_90a kernels (warpgroup MMA) run on it
};

// Forced forms (KDTREE_W4A16_PREFILL, KDTREE_GEMM_FORM), parsed once per backend.
enum class PrefillOverride { kRule, kAlways, kNever };
enum class GemmForm { kRule, kSplit, kRows, kTiled, kTiledSplit, kWgmma };
struct ForcedForms {
  PrefillOverride w4a16_prefill = PrefillOverride::kRule;
  GemmForm gemm = GemmForm::kRule;
};
// `value` unset (nullptr) or empty: the rule; an unknown value is an error naming the setting.
Status ParsePrefillOverride(const char* value, PrefillOverride* out);
Status ParseGemmForm(const char* value, GemmForm* out);
const char* PrefillOverrideName(PrefillOverride o);  // "always", "never", "" (the rule)
const char* GemmFormName(GemmForm f);                // "split" ... "wgmma", "" (the rule)

// ---- W4A16 (w4a16Gemm, moeGemm) ----

// Geometry the rules and the kernels share (w4a16_wgmma.cu, w4a16_prefill.cu static_assert it).
constexpr int kW4A16WarpsPerBlock = 8;
constexpr int kW4A16WarpsPerSm = 16;         // stream-K ranges per SM and weight matrix
constexpr int kW4A16EvenColumnTokens = 4;    // tokens per tile of the even-column form
constexpr int kW4A16PiecesMax = 4;
constexpr int kW4A16PiecesMinSteps = 16;
constexpr int kW4A16RoutePairsMax = 32;      // pairs a MoE decode launch routes inside the GEMM
constexpr int kWgmmaTileTokens = 32;         // the warpgroup kernel's token tile
constexpr int kWgmmaTileGroup = 4;           // 16-row tiles per warpgroup
constexpr int kWgmmaXStepBytes = 8 * 1024;   // one step's staged x (128 k x 32 tokens, bf16)
constexpr int kWgmmaMaxXCopies = 8;
constexpr int kPrefillTileTokens = 128;      // the prefill kernel's token tile
constexpr size_t kWgmmaStagedBytesMax = size_t{128} << 20;  // staged x per launch of either

// The stream-K kernel's forms besides its token groups (w4a16_gemm.cu's Form says what each is).
enum class W4A16Form { kStandard, kOneToken, kEvenColumns, kXInPlace };
enum class W4A16Kernel { kStreamK, kWgmma, kPrefill };

struct W4A16Ranges {
  int steps_per_block = 0, steps_per_warp = 0, blocks = 0;
};
W4A16Ranges W4A16ChooseRanges(int64_t total_steps, int tile_steps, int matrices, int64_t min_warp_steps, int sms);
// Token groups of 8 per tile (NT) for `rows` rows.
int W4A16ChooseNt(int rows, DType x, int k);
int WgmmaTileGroups(int tiles);
int WgmmaXCopies(int tile_groups);
size_t WgmmaStagedBytes(int steps, int tiles);
// Token tiles per launch of the warpgroup kernel.
int WgmmaChunk(int m, int steps, int tiles);
// The prefill kernel's groups: 32 with bf16 scales, 64.
bool PrefillSupports(int group, bool sc_f32);

// One W4A16 launch as the rules see it: the dense GEMM (moe = false, rows = M) or the grouped
// MoE GEMM (rows = tokens x top-k pairs).
struct W4A16Call {
  int tokens = 0;       // M of w4a16Gemm, the tokens of moeGemm
  int n = 0, k = 0, group = 32;
  DType x = DType::kBF16;
  bool sc_f32 = false;  // f32 scales (bf16 otherwise)
  bool moe = false;
  int experts = 0, topk = 1;     // moe only
  int64_t min_warp_steps = 0;    // moe only (MoeGemmArgs::min_warp_steps)
};
struct W4A16Plan {
  W4A16Kernel kernel = W4A16Kernel::kStreamK;
  W4A16Form form = W4A16Form::kStandard;  // the stream-K kernel's
  int nt = 1;            // token groups of 8 per tile (stream-K)
  int tile_tokens = 1;   // rows per token tile (stream-K)
  int rows = 0;          // rows of the launch: M, or the pairs of a MoE call
  bool route = false;    // MoE: routed inside the GEMM (one token group, few pairs)
  int pieces = 1;        // ranges per warp (PiecesPerWarp)
  bool stages_x = false; // x staged in fragment order before the stream-K kernel
  W4A16Ranges ranges;
};
// The plan of a call, or the Unsupported error of a forced form that cannot run it.
Status PlanW4A16(const W4A16Call& c, const Device& d, PrefillOverride o, W4A16Plan* plan);
// The name a call reports (lastForm()): "wgmma", "prefill", or the stream-K form: "one-token",
// "even-columns", "x-in-place", "standard"; a MoE verify launch in pieces adds "-pieces".
const char* W4A16FormName(const W4A16Plan& p);

// ---- gemm (16-bit weights as stored) ----

constexpr int kGemmBlockWarps = 8;
constexpr int kGemmMinRangeChunks = 4;
constexpr int kGemmChunkK = 32;
constexpr int kGemmTileRows = 16;
constexpr int kGemmTiledWarps = 4;
constexpr int kGemmTiledSplitMinChunks = 16;
constexpr int kGemmWgmmaRows = 128;
constexpr int kGemmWgmmaTokens = 128;
constexpr int kMaxGridY = 65535;
// Chunks of 32 k a warp of the split and rows forms loads before it uses the first: 4 (4 KB of
// weights in flight at one token), fewer as x's fragments grow; 8 for one token tile of 16-bit x.
constexpr int kGemmLoadAhead = 4;
constexpr int kGemmDeepLoadAhead = 8;
constexpr int kGemmDeepMinRangeChunks = 32;  // the deep depth needs ranges at least this long
// The depth of every token tile but the deep one: a warp's x fragments (nt token groups of `planes`
// bf16 planes) stay within 32 registers. gemm.cu instantiates its kernels with it.
constexpr int GemmShallowLoadAhead(int nt, int planes) {
  const int fit = 8 / (nt * planes);
  return fit < 1 ? 1 : fit < kGemmLoadAhead ? fit : kGemmLoadAhead;
}

struct GemmCall {
  int m = 0, n = 0, k = 0;
  DType x = DType::kBF16;
  int warps_per_sm = 32;  // what the split aims to fill at M <= 8 (gemm.cu's KDTREE_GEMM_WARPS_PER_SM)
};
struct GemmPlan {
  GemmForm form = GemmForm::kSplit;
  int nt = 1;            // token groups of 8 per tile: 1, 2, 4 or 8 (4 at most for f32 x)
  int chunks = 0, tiles = 0;
  int ranges = 0, range_chunks = 0;
  int load_ahead = kGemmLoadAhead;  // the split and rows forms' chunks in flight per warp
};
// The K split and the form of a call, or the error of a forced form that cannot run it.
Status PlanGemm(const GemmCall& c, const Device& d, GemmForm forced, GemmPlan* plan);

// ---- ddtree_build ----

// Trees of up to kDdtreeFusedMaxBudget nodes over up to kDdtreeFusedMaxDepth depths are built in
// one launch, the rest in four passes. The fused build (ddtree.cu): blocks of (depth, slice),
// kDdtreeFusedSlices slices a row, 32 warps a block, each lane holding up to
// kDdtreeFusedValuesPerLane of a slice's values.
constexpr int kDdtreeFusedMaxBudget = 32;
constexpr int kDdtreeFusedMaxDepth = 32;
constexpr int kDdtreeFusedSlices = 16;
constexpr int kDdtreeFusedValuesPerLane = 16;
constexpr int64_t kDdtreeFusedMaxVocab = int64_t{kDdtreeFusedSlices} * 32 * 32 * kDdtreeFusedValuesPerLane;
// Of those, up to kDdtreeClusterMaxBlocks depths over up to kDdtreeClusterMaxVocab tokens take the
// cluster build (ddtree.cu): a row in the registers of one block of 1024 threads
// (kDdtreeClusterValuesPerThread values a thread), or of two blocks for rows past
// kDdtreeClusterHalfVocab tokens ('cluster-halves': a cluster of 2 x depth blocks, past the
// portable size of 8 from 5 rows, where the device holds one; else a block a row), the blocks one
// thread-block cluster whose block 0 merges the rows' parts from the others' writes and builds
// the tree.
constexpr int kDdtreeClusterValuesPerThread = 8;
constexpr int kDdtreeClusterMaxBlocks = 8;  // rows: the portable cluster size
constexpr int64_t kDdtreeClusterMaxVocab = int64_t{1024} * kDdtreeClusterValuesPerThread;
constexpr int64_t kDdtreeClusterHalfVocab = kDdtreeClusterMaxVocab / 2;
enum class DdtreeBuildForm { kCluster, kClusterHalves, kFused, kPasses };
DdtreeBuildForm PlanDdtreeBuild(int64_t budget, int64_t depth, int64_t vocab);
const char* DdtreeBuildFormName(DdtreeBuildForm form);

}  // namespace policy
}  // namespace kdtree
