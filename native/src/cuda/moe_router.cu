// The MoE router (DeepSeek-V3's noaux_tc): per token, sigmoid scores of the router logits; the
// top-k experts by score + e_score_correction_bias, limited to the topk_group best expert groups
// when n_group > 1 (a group's score: the sum of its two largest biased scores); their unbiased
// scores as weights, normalized when norm_topk_prob, times routed_scaling_factor. The ids come out
// ascending, the order the MoE GEMM sums their outputs in. Deterministic: ties go to the lower
// index, as in the reference (@kdtree/reference route).
//
// With x and w the same launch computes the logits first (the router's GEMM, f32 x times bf16 w):
// in a decode step the GEMM, split across blocks, and the picks as a kernel of their own cost two
// launches, a cross-block sum and a round trip through memory for 5.5 MB of weights (Kimi K2); here
// every block sums whole rows and the last block of a token tile routes its tokens, a warp each.
#include <cstdint>

#include "../common/dispatch_policy.h"
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kThreads = policy::kRouterThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kTileTokens = policy::kRouterTokensPerBlock;
static_assert(kTileTokens <= kWarps, "the last block of a token tile routes a token per warp");
constexpr int kChunk = 8;  // k per chunk: one 16-byte load of bf16 weights, two of f32 x

struct RouteParams {
  const float* bias;
  int E, topk, n_group, topk_group;
  bool norm;
  float scaling;
  int32_t* ids;
  float* weights;
};

// The warp's best (value, index) pair, by value and then by the lower index (the order of the
// router's picks), as every lane sees it; index -1 where no lane has one. Two redux.sync: the largest
// value as an order-preserving key (-0 counted as +0, as a float compare does), then the lowest index
// among the lanes that hold it (10 shuffles and compares instead cost ~0.8 us per pick).
__device__ __forceinline__ int WarpBestIndex(float v, int i) {
  const uint32_t key = i < 0 ? 0u : OrderKey(v + 0.f);
  const uint32_t best_key = __reduce_max_sync(0xffffffffu, key);
  const uint32_t index = i >= 0 && key == best_key ? static_cast<uint32_t>(i) : 0xffffffffu;
  return static_cast<int>(__reduce_min_sync(0xffffffffu, index));
}

__device__ __forceinline__ float Score(float logit) { return 1.f / (1.f + expf(-logit)); }

// Routes token t (its logits f32 [E], written by this kernel's other blocks or an earlier kernel:
// read from L2) on one warp. Lane l holds experts l + 32 i (i < 32: E <= 1024) in registers, so
// the warp needs no shared memory and a block routes a token per warp. Each pick is the best of
// every lane's best; after a pick only the lane that held it looks for its next best (8 picks of
// 384 experts on one thread take ~130 us a token).
__device__ void RouteToken(const float* logits, const RouteParams& p, int t, int lane) {
  float cand[32];  // score + bias
  uint32_t live = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = lane + 32 * i;
    cand[i] = e < p.E ? Score(__ldcg(logits + e)) + p.bias[e] : 0.f;
    if (e < p.E) live |= 1u << i;
  }
  if (p.n_group > 1) {
    const int per = p.E / p.n_group;
    // group g's score (lane g % 32 keeps it, in gs0 for g < 32, gs1 above): its two largest choices
    // (a repeated largest counts twice), lane by lane, then merged across the warp
    float gs0 = -INFINITY, gs1 = -INFINITY;
    for (int g = 0; g < p.n_group; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int e = lane + 32 * i;
        if ((live >> i & 1u) && e / per == g) {
          const float c = cand[i];
          if (c > b1) {
            b2 = b1;
            b1 = c;
          } else if (c > b2) {
            b2 = c;
          }
        }
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float o1 = __shfl_xor_sync(0xffffffffu, b1, off), o2 = __shfl_xor_sync(0xffffffffu, b2, off);
        if (b1 >= o1) {
          b2 = fmaxf(b2, o1);
        } else {
          b2 = fmaxf(b1, o2);
          b1 = o1;
        }
      }
      if (lane == g % 32) (g < 32 ? gs0 : gs1) = b1 + b2;
    }
    uint64_t picked = 0;  // the same in every lane
    for (int pick = 0; pick < p.topk_group; ++pick) {
      float v = -INFINITY;
      int best = -1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int g = lane + 32 * h;
        const float score = h == 0 ? gs0 : gs1;
        if (g < p.n_group && !(picked >> g & 1u) && score != -INFINITY && (best < 0 || score > v)) {
          v = score;
          best = g;
        }
      }
      best = WarpBestIndex(v, best);
      if (best < 0) break;
      picked |= uint64_t{1} << best;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (!(picked >> ((lane + 32 * i) / per) & 1u)) live &= ~(1u << i);
    }
  }
  // this lane's best: a tree over its 32 slots, each level merging neighbouring runs of slots (the
  // left run holds the lower experts, so a tie keeps it): depth 5 instead of a chain of 32 compares
  const auto lane_best = [&](float* v) {
    float bv[32];
    int bi[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      bv[i] = cand[i];
      bi[i] = live >> i & 1u ? lane + 32 * i : -1;
    }
#pragma unroll
    for (int run = 1; run < 32; run *= 2) {
#pragma unroll
      for (int i = 0; i < 32; i += 2 * run) {
        if (bi[i + run] >= 0 && (bi[i] < 0 || bv[i + run] > bv[i])) {
          bv[i] = bv[i + run];
          bi[i] = bi[i + run];
        }
      }
    }
    *v = bv[0];
    return bi[0];
  };
  float v = -INFINITY;
  int mine = lane_best(&v);
  int picked = -1;  // lane j: the j-th pick
  for (int pick = 0; pick < p.topk; ++pick) {
    const int best = WarpBestIndex(v, mine);
    if (lane == pick) picked = best;
    if (best >= 0 && best % 32 == lane) {  // taken: this lane's next best
      live &= ~(1u << (best / 32));
      v = -INFINITY;
      mine = lane_best(&v);
    }
  }
  // ascending expert ids (the order their outputs are summed in): lane j takes the pick of rank j;
  // the normalizer sums the scores in that order. Each pick's score is read once, by its lane, all
  // in parallel (a read per pick in the summing loop put topk L2 round trips in a row).
  int rank = 0;
  for (int j = 0; j < p.topk; ++j) rank += __shfl_sync(0xffffffffu, picked, j) < picked;
  const float score = picked >= 0 ? Score(__ldcg(logits + picked)) : 0.f;
  int sorted = -1;
  float sorted_score = 0.f, sum = 0.f;
  for (int j = 0; j < p.topk; ++j) {
    const uint32_t holder = __ballot_sync(0xffffffffu, lane < p.topk && rank == j);
    const int from = __ffs(holder) - 1;
    const int e = __shfl_sync(0xffffffffu, picked, from);
    const float sc = __shfl_sync(0xffffffffu, score, from);
    if (lane == j) {
      sorted = e;
      sorted_score = sc;
    }
    if (e >= 0) sum += sc;
  }
  if (lane < p.topk && sorted >= 0) {
    float w = sorted_score;
    if (p.norm) w = w / (sum + 1e-20f);
    p.ids[static_cast<int64_t>(t) * p.topk + lane] = sorted;
    p.weights[static_cast<int64_t>(t) * p.topk + lane] = w * p.scaling;
  }
}

// Logits given: a warp per token.
__global__ void __launch_bounds__(kThreads) RouterKernel(const float* logits, int T, RouteParams p) {
  PdlWait();
  PdlLaunchDependents();
  const int t = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (t < T) RouteToken(logits + static_cast<int64_t>(t) * p.E, p, t, threadIdx.x & 31);
}

// logits [T, E] = x [T, K] w^T, then the picks. Block (b, y): rows b * rows .. of w for the tokens
// of tile y. Thread j sums chunks j, j + 256, j + 512, ... of K in that order, each chunk's 8
// products in k order (fmaf), then the 256 sums are added by a fixed tree (a warp's butterfly,
// then the 8 warps pairwise): a logit's bits are a function of K only, whatever T, E or the plan.
// The first pass's weights are loaded before the wait for x (weights never change during a step).
// The last block of a token tile to finish routes its tokens.
template <int kRows, int kAhead>
__global__ void __launch_bounds__(kThreads) RouterGemmKernel(const float* x, const uint4* w, int T, int K, int rows_per_block, float* logits, int* counters,
                                                             RouteParams p) {
  PdlLaunchDependents();
  const int chunks = K / kChunk;
  const int row0 = blockIdx.x * rows_per_block, t0 = blockIdx.y * kTileTokens;
  const int rows = min(rows_per_block, p.E - row0), tokens = min(kTileTokens, T - t0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[kRows][kTileTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTileTokens; ++t) acc[r][t] = 0.f;
  }
  for (int base = 0; base < chunks; base += kThreads * kAhead) {
    uint4 wv[kRows][kAhead];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        const int c = base + threadIdx.x + kThreads * a;
        wv[r][a] = r < rows && c < chunks ? LoadStream(w + static_cast<int64_t>(row0 + r) * chunks + c) : make_uint4(0, 0, 0, 0);
      }
    }
    if (base == 0) PdlWait();
#pragma unroll
    for (int a = 0; a < kAhead; ++a) {
      const int c = base + threadIdx.x + kThreads * a;
      if (c >= chunks) break;
#pragma unroll
      for (int t = 0; t < kTileTokens; ++t) {
        if (t >= tokens) break;
        const float4* xp = reinterpret_cast<const float4*>(x + static_cast<int64_t>(t0 + t) * K) + 2 * c;
        const float4 lo = LoadActivation(xp), hi = LoadActivation(xp + 1);
        const float xs[kChunk] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const uint32_t pairs[4] = {wv[r][a].x, wv[r][a].y, wv[r][a].z, wv[r][a].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 wf = Bf16PairToF32(pairs[q]);
            acc[r][t] = fmaf(xs[2 * q], wf.x, acc[r][t]);
            acc[r][t] = fmaf(xs[2 * q + 1], wf.y, acc[r][t]);
          }
        }
      }
    }
  }
  __shared__ float part[kWarps][kRows * kTileTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTileTokens; ++t) {
      if (r < rows && t < tokens) {  // the same in every lane: no shuffles for sums nobody reads
        float v = acc[r][t];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) part[warp][r * kTileTokens + t] = v;
      }
    }
  }
  __syncthreads();
  static_assert(kWarps == 8, "the warps' sums are added as a tree of 8");
  for (int i = threadIdx.x; i < kRows * kTileTokens; i += kThreads) {
    const int r = i / kTileTokens, t = i % kTileTokens;
    if (r < rows && t < tokens) {
      const float s = ((part[0][i] + part[1][i]) + (part[2][i] + part[3][i])) + ((part[4][i] + part[5][i]) + (part[6][i] + part[7][i]));
      logits[static_cast<int64_t>(t0 + t) * p.E + row0 + r] = s;
    }
  }
  __shared__ bool last;
  if (!LastOfBlocks(counters + blockIdx.y, gridDim.x, &last)) return;
  if (warp < tokens) RouteToken(logits + static_cast<int64_t>(t0 + warp) * p.E, p, t0 + warp, lane);
}

}  // namespace

Status LaunchRouter(const RouterArgs& a, cudaStream_t s, Scratch& scratch, int sms) {
  const int T = static_cast<int>(a.logits.dim(0)), E = static_cast<int>(a.logits.dim(1));
  if (T == 0) return Status::Ok();
  if (a.n_group > 64) return Unsupported("router: up to 64 expert groups are supported, got ", a.n_group);
  const RouteParams route{a.bias.as<const float>(), E, a.topk, a.n_group, a.topk_group, a.norm_topk_prob, static_cast<float>(a.scaling), a.ids.as<int32_t>(),
                          a.weights.as<float>()};
  if (!a.x.present()) return LaunchPdl("router", RouterKernel, dim3(static_cast<unsigned>((T + kWarps - 1) / kWarps)), dim3(kThreads), 0, s, a.logits.as<const float>(), T, route);
  const policy::RouterPlan plan = policy::PlanRouter(T, E, policy::Device{sms, false});
  const int K = static_cast<int>(a.x.dim(1));
  const int tiles_per_launch = std::min(plan.token_tiles, policy::kMaxGridY);
  void* counters = nullptr;
  KDTREE_RETURN_IF_ERROR(scratch.Zeroed(static_cast<size_t>(tiles_per_launch) * sizeof(int), s, &counters));
  const auto kernel = plan.wide ? RouterGemmKernel<policy::kRouterWideRows, 1> : RouterGemmKernel<policy::kRouterDecodeRows, 4>;
  if ((plan.wide ? 1 : 4) != plan.chunks_ahead || plan.rows_per_block > (plan.wide ? policy::kRouterWideRows : policy::kRouterDecodeRows)) {
    return Unsupported("router: no kernel instance holds ", plan.rows_per_block, " rows a block at ", plan.chunks_ahead, " chunks ahead");
  }
  for (int first = 0; first < plan.token_tiles; first += tiles_per_launch) {
    const int64_t t0 = static_cast<int64_t>(first) * kTileTokens;
    const int tiles = std::min(tiles_per_launch, plan.token_tiles - first);
    RouteParams r = route;
    r.ids += t0 * a.topk;
    r.weights += t0 * a.topk;
    KDTREE_RETURN_IF_ERROR(LaunchPdl("router (with its GEMM)", kernel, dim3(static_cast<unsigned>(plan.blocks), static_cast<unsigned>(tiles)), dim3(kThreads), 0, s,
                                     a.x.as<const float>() + t0 * K, a.w.as<const uint4>(), static_cast<int>(std::min<int64_t>(T - t0, int64_t{tiles} * kTileTokens)), K,
                                     plan.rows_per_block, a.logits.as<float>() + t0 * E, static_cast<int*>(counters), r));
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace kdtree
