// The MoE router (DeepSeek-V3's noaux_tc): per token, sigmoid scores of the router logits; the
// top-k experts by score + e_score_correction_bias, limited to the topk_group best expert groups
// when n_group > 1 (a group's score: the sum of its two largest biased scores); their unbiased
// scores as weights, normalized when norm_topk_prob, times routed_scaling_factor. The ids come out
// ascending, the order the MoE GEMM sums their outputs in. Deterministic: ties go to the lower
// index, as in the reference (@kdtree/reference route).
#include <cstdint>

#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

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

// One block per token. Group scores a warp per group; the group and expert picks on warp 0, each
// pick the best of every lane's strided candidates (8 picks of 384 experts on one thread take
// ~130 us a token). Ties go to the lower index, as in the reference (@kdtree/reference route).
__global__ void RouterKernel(const float* logits, const float* bias, int E, int topk, int n_group, int topk_group, bool norm, float scaling,
                             int32_t* ids, float* weights) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float score[1024], choice[1024], group_score[64];
  __shared__ unsigned char allowed[1024], group_picked[64];
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    score[e] = 1.f / (1.f + expf(-logits[static_cast<int64_t>(t) * E + e]));
    choice[e] = score[e] + bias[e];
    allowed[e] = n_group == 1;
  }
  __syncthreads();
  if (n_group > 1) {
    const int per = E / n_group;
    for (int g = warp; g < n_group; g += warps) {
      // the two largest choices of the group (a repeated largest counts twice), lane by lane, then merged
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = g * per + lane; e < (g + 1) * per; e += 32) {
        const float c = choice[e];
        if (c > b1) {
          b2 = b1;
          b1 = c;
        } else if (c > b2) {
          b2 = c;
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
      if (lane == 0) group_score[g] = b1 + b2;
    }
    __syncthreads();
    if (warp == 0) {
      for (int g = lane; g < 64; g += 32) group_picked[g] = 0;
      __syncwarp();
      for (int pick = 0; pick < topk_group; ++pick) {
        float v = -INFINITY;
        int best = -1;
        for (int g = lane; g < n_group; g += 32) {
          if (!group_picked[g] && group_score[g] != -INFINITY && (best < 0 || group_score[g] > v)) {
            v = group_score[g];
            best = g;
          }
        }
        best = WarpBestIndex(v, best);
        if (best < 0) break;
        if (lane == 0) group_picked[best] = 1;
        __syncwarp();
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) allowed[e] = group_picked[e / per];
    __syncthreads();
  }
  if (warp != 0) return;
  // lane l holds experts l + 32 i (i < 32: E <= 1024) in registers; after a pick only the lane that
  // held it looks for its next best
  float cand[32];
  uint32_t live = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = lane + 32 * i;
    cand[i] = e < E ? choice[e] : 0.f;
    if (e < E && allowed[e] == 1) live |= 1u << i;
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
  int picked = -1;  // lane p: the p-th pick
  for (int pick = 0; pick < topk; ++pick) {
    const int best = WarpBestIndex(v, mine);
    if (lane == pick) picked = best;
    if (best >= 0 && best % 32 == lane) {  // taken: this lane's next best
      live &= ~(1u << (best / 32));
      v = -INFINITY;
      mine = lane_best(&v);
    }
  }
  // ascending expert ids (the order their outputs are summed in): lane p's pick goes to its rank
  int rank = 0;
  for (int j = 0; j < topk; ++j) rank += __shfl_sync(0xffffffffu, picked, j) < picked;
  __shared__ int sorted[32];
  if (lane < topk) sorted[rank] = picked;
  __syncwarp();
  float sum = 0.f;
  for (int i = 0; i < topk; ++i) sum += score[sorted[i]];
  if (lane < topk) {
    float w = score[sorted[lane]];
    if (norm) w = w / (sum + 1e-20f);
    ids[static_cast<int64_t>(t) * topk + lane] = sorted[lane];
    weights[static_cast<int64_t>(t) * topk + lane] = w * scaling;
  }
}

}  // namespace

Status LaunchRouter(const RouterArgs& a, cudaStream_t s) {
  if (a.logits.dim(0) == 0) return Status::Ok();
  if (a.n_group > 64) return Unsupported("router: up to 64 expert groups are supported, got ", a.n_group);
  return LaunchPdl("router", RouterKernel, dim3(static_cast<unsigned>(a.logits.dim(0))), dim3(256), 0, s, a.logits.as<const float>(), a.bias.as<const float>(),
                   static_cast<int>(a.logits.dim(1)), a.topk, a.n_group, a.topk_group, a.norm_topk_prob, static_cast<float>(a.scaling), a.ids.as<int32_t>(),
                   a.weights.as<float>());
}

}  // namespace cuda
}  // namespace kdtree
