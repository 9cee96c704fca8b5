// DDTree on the device (the reference is @kdtree/reference ddtree.ts):
//   build   per depth the top-K draft tokens and their log-softmax (log-sum-exp in f64), then the
//           best-first expansion into at most B nodes (one warp: frontier in its registers up to
//           32 pops, in shared memory beyond), then positions and the ancestor mask. Budgets up to
//           32 in one launch (policy::PlanDdtreeBuild): a row over one block of a cluster or,
//           past 4096 tokens, two (up to 8 rows of 8192), or slices of the rows over the grid
//           (up to 262144); the rest in four passes (radix select + bitonic sort, segments of a row then their
//           candidates; log-sum-exp slices and their merge; the expansion)
//   accept  the greedy walk from the root along children whose token is the target's argmax
//   commit  KV[start + k] = KV[start + path[k]] for k ascending, in every cache tensor
// Ties follow the reference: tokens by (logit desc, id asc); frontier entries by (log-prob desc, push order).
#include <algorithm>
#include <atomic>
#include <climits>

#include <cooperative_groups.h>

#include "../common/dispatch_policy.h"
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

// Block 0's clock at each phase of the cluster build, for tools/gpu/ddtree_phases.cu, which
// compiles this file with KDTREE_DDTREE_PHASES; the addon's build leaves the marks out.
#ifdef KDTREE_DDTREE_PHASES
__device__ long long g_ddtree_phases[8];
#define DDTREE_PHASE(i)                                                      \
  do {                                                                       \
    if (threadIdx.x == 0 && blockIdx.x == 0) g_ddtree_phases[i] = clock64(); \
  } while (0)
#else
#define DDTREE_PHASE(i) \
  do {                  \
  } while (0)
#endif

constexpr int kTopkThreads = 1024;
constexpr int kTopkWarps = kTopkThreads / 32;


// Block-wide bitonic sort of n (a power of two) pairs in shared memory: key descending, then index
// ascending. The caller has synchronized after writing them; returns synchronized.
__device__ void BitonicSort(uint32_t* keys, int* idx, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool first = keys[i] > keys[j] || (keys[i] == keys[j] && idx[i] < idx[j]);  // i before j?
          if (((i & size) == 0) != first) {
            const uint32_t tk = keys[i];
            keys[i] = keys[j];
            keys[j] = tk;
            const int ti = idx[i];
            idx[i] = idx[j];
            idx[j] = ti;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Keys of `steps` 32-element steps from i0 (lane-strided, coalesced), all loads issued before use.
template <int kSteps>
__device__ __forceinline__ void LoadKeys(const float* row, int64_t i0, int64_t end, int lane, uint32_t* keys) {
#pragma unroll
  for (int u = 0; u < kSteps; ++u) keys[u] = i0 + 32 * u + lane < end ? OrderKey(row[i0 + 32 * u + lane]) : 0;
}

// One block per segment of a row: the k largest (value desc, index asc), k <= 1024. Block b takes
// segment b % segments of row b / segments: `seg_len` values from row * stride + segment * seg_len
// (the last segment ends at `row_len`), and writes its k to values/ids[b * k ..], ids as the row's
// index (or id_map of it, when the row is a previous pass's candidates).
// Logits of one row share their top key bits, so a shared histogram would serialize every atomic
// on one bin: each warp adds into its own histogram, lanes sharing lane 0's bin as one atomic, and
// the 32 histograms are summed afterwards.
__global__ void __launch_bounds__(kTopkThreads) RowTopkKernel(const float* x, int64_t stride, int64_t seg_len, int segments, int64_t row_len, int k,
                                                              const int32_t* id_map, float* values, int32_t* ids) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ int warp_hist[kTopkWarps][256];
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int remaining_s;
  __shared__ int2 warp_sums[kTopkWarps];
  __shared__ uint32_t keys[kTopkThreads];
  __shared__ int idx[kTopkThreads];
  const int64_t row_index = blockIdx.x / segments, start = (blockIdx.x % segments) * seg_len;
  const int64_t cols = min(seg_len, row_len - start);  // this block's values
  const float* row = x + row_index * stride + start;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    prefix_s = 0;
    mask_s = 0;
    remaining_s = k;
  }
  // 1. radix select: the k-th largest key, 8 bits at a time from the top
  const int warp = threadIdx.x >> 5;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kTopkWarps * 256; b += blockDim.x) (&warp_hist[0][0])[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    // kUnroll loads in flight per thread before any is used: one block reads a whole row, and with
    // a single load per warp outstanding the pass would be bound by memory latency, not bandwidth
    constexpr int kUnroll = 8;
    for (int64_t base = 0; base < cols; base += static_cast<int64_t>(kUnroll) * blockDim.x) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * blockDim.x + threadIdx.x;
        v[u] = i < cols ? row[i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * blockDim.x + threadIdx.x;
        const uint32_t key = OrderKey(v[u]);
        const bool in = i < cols && (key & mask) == prefix;
        const int bin = in ? static_cast<int>((key >> shift) & 0xFF) : -1;
        // lanes in lane 0's bin (most of them in the top digits) add once; the rest add alone
        const bool with0 = bin == __shfl_sync(0xffffffffu, bin, 0);
        const unsigned group0 = __ballot_sync(0xffffffffu, with0);
        if (in && (with0 ? lane == 0 : true)) atomicAdd(&warp_hist[warp][bin], with0 ? __popc(group0) : 1);
      }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
      int sum = 0;
      for (int w = 0; w < kTopkWarps; ++w) sum += warp_hist[w][b];
      hist[b] = sum;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: which bin holds the k-th key; lane l owns bins 255-8l .. 248-8l
      const int remaining = remaining_s;
      __syncwarp();  // every lane has read remaining_s before the winner rewrites it
      int local[8], sum = 0;
      for (int j = 0; j < 8; ++j) sum += local[j] = hist[255 - 8 * lane - j];
      int incl = sum;
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += u;
      }
      const int before = incl - sum;
      if (before < remaining && remaining <= incl) {
        int r = remaining - before;
        for (int j = 0; j < 8; ++j) {
          if (local[j] >= r) {
            prefix_s = prefix | (static_cast<uint32_t>(255 - 8 * lane - j) << shift);
            mask_s = mask | (0xFFu << shift);
            remaining_s = r;  // how many keys equal to the threshold we still need
            break;
          }
          r -= local[j];
        }
      }
    }
    __syncthreads();
  }
  const uint32_t thr = prefix_s;
  const int need_eq = remaining_s;
  // 2. ordered compaction: each warp owns a contiguous index range and walks it 32 keys at a time
  //    (coalesced), placing keys with ballot prefix counts, so ties keep the lowest indices
  const int64_t seg = (cols + kTopkWarps * 32 - 1) / (kTopkWarps * 32) * 32;
  const int64_t w0 = min(cols, warp * seg), w1 = min(cols, w0 + seg);
  const unsigned lanes_before = (1u << lane) - 1;
  int pos_gt = 0, pos_eq = 0;
  constexpr int kSteps = 8;  // 32-key steps loaded at once (memory-level parallelism, as above)
  for (int64_t i0 = w0; i0 < w1; i0 += 32 * kSteps) {
    uint32_t key[kSteps];
    LoadKeys<kSteps>(row, i0, w1, lane, key);
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const bool ok = i0 + 32 * u + lane < w1;
      pos_gt += __popc(__ballot_sync(0xffffffffu, ok && key[u] > thr));
      pos_eq += __popc(__ballot_sync(0xffffffffu, ok && key[u] == thr));
    }
  }
  if (lane != 0) pos_gt = pos_eq = 0;  // one count per warp goes into the scan
  int2 totals;
  const int2 before = BlockExclusiveScan(make_int2(pos_gt, pos_eq), &totals, warp_sums);
  pos_gt = __shfl_sync(0xffffffffu, before.x, 0);
  pos_eq = __shfl_sync(0xffffffffu, before.y, 0);
  const int total_gt = k - need_eq;
  for (int64_t j0 = w0; j0 < w1; j0 += 32 * kSteps) {
    uint32_t keyv[kSteps];
    LoadKeys<kSteps>(row, j0, w1, lane, keyv);
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t i = j0 + 32 * u + lane;
      const uint32_t key = keyv[u];
      const bool gt = i < w1 && key > thr, eq = i < w1 && key == thr;
      const unsigned bgt = __ballot_sync(0xffffffffu, gt), beq = __ballot_sync(0xffffffffu, eq);
      if (gt) {
        const int at = pos_gt + __popc(bgt & lanes_before);
        keys[at] = key;
        idx[at] = static_cast<int>(i);
      } else if (eq) {
        const int e = pos_eq + __popc(beq & lanes_before);
        if (e < need_eq) {
          keys[total_gt + e] = key;
          idx[total_gt + e] = static_cast<int>(i);
        }
      }
      pos_gt += __popc(bgt);
      pos_eq += __popc(beq);
    }
  }
  // pad to a power of two for the bitonic sort
  int n = 1;
  while (n < k) n <<= 1;
  for (int i = k + threadIdx.x; i < n; i += blockDim.x) {
    keys[i] = 0;
    idx[i] = 0x7FFFFFFF;
  }
  __syncthreads();
  // 3. bitonic sort: key descending, index ascending
  BitonicSort(keys, idx, n);
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    values[static_cast<int64_t>(blockIdx.x) * k + i] = row[idx[i]];
    ids[static_cast<int64_t>(blockIdx.x) * k + i] = id_map ? id_map[row_index * stride + start + idx[i]] : static_cast<int32_t>(start + idx[i]);
  }
}

// The k best of a row's segment candidates when they are few (<= kSortCandidatesMax): one block
// sorts all of them in shared memory (bitonic, key descending, id ascending) and keeps the first k.
// The radix select above costs the same four passes for 160 candidates as for a segment of 8192
// values: at k = 8 (160 candidates) the sort is ~4 us faster, but at k = 64 (1280 candidates)
// ~18 us slower, hence the bound. A block of n / 2 threads instead of 1024 is slower at k = 8.
constexpr int kSortCandidatesMax = 512;
__global__ void __launch_bounds__(kTopkThreads) SortCandidatesKernel(const float* cand_values, const int32_t* cand_ids, int candidates, int k, float* values, int32_t* ids) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ uint32_t keys[kSortCandidatesMax];
  __shared__ int id[kSortCandidatesMax];
  const int64_t row = blockIdx.x;
  int n = 1;
  while (n < candidates) n <<= 1;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const bool real = i < candidates;
    keys[i] = real ? OrderKey(cand_values[row * candidates + i]) : 0u;
    id[i] = real ? cand_ids[row * candidates + i] : INT32_MAX;
  }
  __syncthreads();
  BitonicSort(keys, id, n);
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    const uint32_t key = keys[i];
    values[row * k + i] = FromOrderKey(key);
    ids[row * k + i] = id[i];
  }
}

// log-sum-exp per row in f64, as the reference's log-softmax normalizer: kLseSlices blocks per
// row each reduce a slice to (max, sum of exp(x - max)) with a fixed-order tree; a second kernel
// merges the slices in order (a row is 160k logits: one block per row would leave the GPU idle).
constexpr int kLseSlices = 16;
// The block's values combined in the fixed tree red[i] = op(red[i], red[i + s]) for s = 512, 256,
// ..., 1 (1024 threads): the steps down to s = 32 in shared memory, the last five by shuffles in
// warp 0 (lane i takes lane i + s: the same pairs in the same order, so the same bits); every
// thread gets the result, and `red` is free again on return.
template <typename Op>
__device__ __forceinline__ double BlockTree(double v, double* red, Op op) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s >= 32; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = op(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    double x = red[threadIdx.x];
    for (int s = 16; s > 0; s >>= 1) x = op(x, __shfl_down_sync(0xffffffffu, x, s));
    if (threadIdx.x == 0) red[0] = x;
  }
  __syncthreads();
  const double out = red[0];
  __syncthreads();
  return out;
}

// Slice `slice` of a row's log-sum-exp: (max, sum of exp(x - max)) over values [slice * per, ..)
// with per = ceil(cols / kLseSlices), by a 1024-thread block (`red`: its 1024 doubles of shared
// memory); every thread gets the pair.
__device__ __forceinline__ double2 LseSlice(const float* row, int64_t cols, int slice, double* red) {
  const int64_t per = (cols + kLseSlices - 1) / kLseSlices;
  const int64_t lo = slice * per, hi = min(cols, lo + per);
  float mx = -INFINITY;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) mx = fmaxf(mx, row[i]);
  const double m = BlockTree(static_cast<double>(mx), red, [](double a, double b) { return fmax(a, b); });
  double sum = 0;
  if (m != -INFINITY) for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) sum += exp(static_cast<double>(row[i]) - m);
  return make_double2(m, BlockTree(sum, red, [](double a, double b) { return a + b; }));
}
__global__ void __launch_bounds__(1024) LogSumExpSliceKernel(const float* x, int64_t cols, double2* partial) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ double red[1024];
  const double2 p = LseSlice(x + static_cast<int64_t>(blockIdx.x) * cols, cols, blockIdx.y, red);
  if (threadIdx.x == 0) partial[blockIdx.x * kLseSlices + blockIdx.y] = p;
}
// A row's log-sum-exp from its kLseSlices partials, by a warp: lane i computes slice i's
// exponential, lane 0 takes the terms in slice order, one FMA each (a skipped slice's y x 0 + sum
// leaves the sum as it is), so the four-launch and fused builds give the same bits (the cluster
// build sums in its own order).
__device__ __forceinline__ double MergeLseWarp(const double2* partial) {
  const int lane = threadIdx.x & 31;
  const double x = lane < kLseSlices ? partial[lane].x : -INFINITY, y = lane < kLseSlices ? partial[lane].y : 0.0;
  double m = x;
  for (int off = 16; off > 0; off >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, off));
  const double e = x != -INFINITY ? exp(x - m) : 0.0;
  double sum = 0;
  for (int i = 0; i < kLseSlices; ++i) sum = __fma_rn(__shfl_sync(0xffffffffu, y, i), __shfl_sync(0xffffffffu, e, i), sum);
  return m + log(sum);
}
// A warp per row.
__global__ void LogSumExpMergeKernel(const double2* partial, double* out) {
  PdlWait();
  PdlLaunchDependents();
  const double logz = MergeLseWarp(partial + blockIdx.x * kLseSlices);
  if (threadIdx.x == 0) out[blockIdx.x] = logz;
}

struct FrontierEntry {
  double w;
  int parent, depth, rank, seq;
};

// Whether the entry (w, seq) pops before (w2, seq2): larger log-prob first, then earlier push.
__device__ __forceinline__ bool PopsBefore(double w, int seq, double w2, int seq2) { return w > w2 || (w == w2 && seq < seq2); }

constexpr int kMaxNodes = static_cast<int>(kMaxDdtreeBudget) + 1;

// The expansion of a small tree (at most kListPops pops) by warp 0 with the frontier in registers:
// lane i holds the entry that pops i-th, so a pop is lane 0's entry and a shift down, and a push
// an insertion at the count of entries that pop before it (a ballot) and a shift up; a pop's
// dependent chain is a few shuffles instead of the pool's scan, reductions and shared-memory
// round trips. Entries past lane 31 are dropped: at most kListPops - 1 pops follow
// the first, and an entry behind that many others never pops (pushes only go ahead of it or
// behind). A new entry has the largest push order yet, so it goes behind entries of equal w.
constexpr int kListPops = 32;
__device__ void ExpandWarpList(const double* lp_table, const float* values, const double* logz, int depth, int k, int n, int* at_s, int* parents_s, int* depths_s,
                               int* size_s, int32_t* size_out, float* log_probs) {
  const int lane = threadIdx.x & 31;
  auto lp = [&](int d, int r) { return lp_table != nullptr ? lp_table[d * k + r] : static_cast<double>(values[d * k + r]) - logz[d]; };
  // this lane's entry: w, and (parent, rank, depth) packed 8, 8 and 16 bits (parent and rank <= 32)
  double w = -INFINITY;
  int meta = 0;
  int len = 0, size = 1;
  if (k > 0) {
    if (lane == 0) w = lp(0, 0), meta = 1 << 16;  // the root's first child: parent 0, rank 0, depth 1
    len = 1;
  }
  // inserts (nw, nmeta) behind every entry with w >= nw
  auto insert = [&](double nw, int nmeta) {
    const int at = __popc(__ballot_sync(0xffffffffu, lane < len && w >= nw));
    const double up_w = __shfl_up_sync(0xffffffffu, w, 1);
    const int up_meta = __shfl_up_sync(0xffffffffu, meta, 1);
    if (lane == at) w = nw, meta = nmeta;
    else if (lane > at) w = up_w, meta = up_meta;
    len = min(len + 1, 32);
  };
  while (len > 0 && size < n) {
    const double ew = __shfl_sync(0xffffffffu, w, 0);
    const int em = __shfl_sync(0xffffffffu, meta, 0);
    const double down_w = __shfl_down_sync(0xffffffffu, w, 1);
    const int down_meta = __shfl_down_sync(0xffffffffu, meta, 1);
    w = lane < 31 ? down_w : -INFINITY;
    meta = lane < 31 ? down_meta : 0;
    --len;
    const int parent = em & 0xFF, rank = em >> 8 & 0xFF, d = em >> 16;
    const int node = size++;
    if (lane == 0) {
      at_s[node] = (d - 1) * k + rank;
      parents_s[node] = parent;
      depths_s[node] = d;
      if (log_probs != nullptr) log_probs[node] = static_cast<float>(ew);
    }
    if (rank + 1 < k) insert(ew - lp(d - 1, rank) + lp(d - 1, rank + 1), parent | (rank + 1) << 8 | d << 16);
    if (d < depth) insert(ew + lp(d, 0), node | (d + 1) << 16);
  }
  if (lane == 0) {
    *size_s = size;
    *size_out = size;
  }
}

// The expansion is inherently serial (each pop decides the next pushes), so warp 0 runs it out of
// shared memory: the frontier (at most budget + 1 live entries, since a pop pushes at most two) as
// an unordered pool whose best entry the warp finds together, each lane scanning every 32nd entry,
// and, when it fits, the log-prob table, which the rest of the block fills first. Entries are
// totally ordered by (w, seq), so this pops the same sequence as the reference's heap; a binary
// heap walked by one thread spent a chain of dependent shared-memory reads on every pop and push
// (global memory on every sift step made the first version take milliseconds).
// Then one warp per row writes the ancestor mask: coalesced zeroing, lane 0 sets the ancestors.
// BuildTree: the tree of at most kNodes nodes (budget + 1 <= kNodes) from the [depth, k] top-k
// `values` / `tok` and the rows' log-sum-exp `logz`, by a block of 1024 threads (`pool`: budget + 2
// frontier entries; `lp_table`: the [depth, k] log-probs when lp_in_smem).
template <int kNodes>
__device__ void BuildTree(const float* values, const int32_t* tok, const double* logz, int depth, int k, int root, int budget, int64_t start, bool lp_in_smem,
                          FrontierEntry* pool, double* lp_table, int32_t* tokens, int32_t* parents, int32_t* depths, int32_t* positions, uint8_t* mask, int32_t* size_out,
                          float* log_probs) {
  __shared__ int parents_s[kNodes], depths_s[kNodes], at_s[kNodes];  // at: index into the [depth, k] top-k
  __shared__ int size_s;
  const int n = budget + 1;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    parents_s[i] = -1;
    depths_s[i] = 0;
    tokens[i] = i == 0 ? root : -1;
  }
  if (lp_in_smem) {
    for (int i = threadIdx.x; i < depth * k; i += blockDim.x) lp_table[i] = static_cast<double>(values[i]) - logz[i / k];
  }
  __syncthreads();
  DDTREE_PHASE(4);
  if (threadIdx.x < 32 && budget <= kListPops) {
    ExpandWarpList(lp_in_smem ? lp_table : nullptr, values, logz, depth, k, n, at_s, parents_s, depths_s, &size_s, size_out, log_probs);
  } else if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int size = 1, len = 0, seq = 0;  // the same in every lane
    auto lp = [&](int d, int r) { return lp_in_smem ? lp_table[d * k + r] : static_cast<double>(values[d * k + r]) - logz[d]; };
    auto push = [&](const FrontierEntry& e) {
      if (lane == 0) pool[len] = e;
      ++len;
    };
    if (k > 0) push(FrontierEntry{lp(0, 0), 0, 1, 0, seq++});
    __syncwarp();
    while (len > 0 && size < n) {
      int best = -1;
      double best_w = 0.0;
      int best_seq = 0;
      for (int i = lane; i < len; i += 32) {
        const double w = pool[i].w;
        const int q = pool[i].seq;
        if (best < 0 || PopsBefore(w, q, best_w, best_seq)) best = i, best_w = w, best_seq = q;
      }
      {
        // the warp's best: the largest w (as an ordered 64-bit key; +0 for -0, which PopsBefore
        // ranks equal), then the earliest push, by reductions instead of a shuffle butterfly
        const uint64_t u = static_cast<uint64_t>(__double_as_longlong(best_w + 0.0));
        const uint64_t key = best < 0 ? 0 : (u >> 63 ? ~u : u | (uint64_t{1} << 63));
        const uint32_t hi = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(key >> 32));
        const uint32_t lo = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(key >> 32) == hi ? static_cast<uint32_t>(key) : 0u);
        const bool top = best >= 0 && key == (static_cast<uint64_t>(hi) << 32 | lo);
        const uint32_t first = __reduce_min_sync(0xffffffffu, top ? static_cast<uint32_t>(best_seq) : 0xffffffffu);
        const int from = __ffs(__ballot_sync(0xffffffffu, top && static_cast<uint32_t>(best_seq) == first)) - 1;
        best = __shfl_sync(0xffffffffu, best, from);
      }
      const FrontierEntry e = pool[best];
      __syncwarp();  // every lane has read the entry before it is overwritten
      if (lane == 0) pool[best] = pool[len - 1];
      --len;
      const int node = size++;
      if (lane == 0) {
        at_s[node] = (e.depth - 1) * k + e.rank;  // the token is looked up afterwards, in parallel
        parents_s[node] = e.parent;
        depths_s[node] = e.depth;
        if (log_probs != nullptr) log_probs[node] = static_cast<float>(e.w);
      }
      if (e.rank + 1 < k) push(FrontierEntry{e.w - lp(e.depth - 1, e.rank) + lp(e.depth - 1, e.rank + 1), e.parent, e.depth, e.rank + 1, seq++});
      if (e.depth < depth) push(FrontierEntry{e.w + lp(e.depth, 0), node, e.depth + 1, 0, seq++});
      __syncwarp();  // the pool's writes are visible to the next scan
    }
    if (lane == 0) {
      size_s = size;
      *size_out = size;
    }
  }
  __syncthreads();
  DDTREE_PHASE(5);
  const int size = size_s;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (i > 0 && i < size) tokens[i] = tok[at_s[i]];
    parents[i] = parents_s[i];
    depths[i] = depths_s[i];
    positions[i] = static_cast<int32_t>(start + depths_s[i]);
    if (log_probs != nullptr && (i == 0 || i >= size)) log_probs[i] = i == 0 ? 0.f : -INFINITY;
  }
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < n; i += blockDim.x >> 5) {
    uint8_t* row = mask + static_cast<int64_t>(i) * n;
    for (int j = lane; j < n; j += 32) row[j] = 0;
    __syncwarp();
    if (lane == 0 && i < size) for (int j = i; j >= 0; j = parents_s[j]) row[j] = 1;
    __syncwarp();
  }
}

__global__ void __launch_bounds__(1024) BuildTreeKernel(const float* values, const int32_t* tok, const double* logz, int depth, int k, int root, int budget,
                                                        int64_t start, const int32_t* root_on_device, const int32_t* start_on_device, bool lp_in_smem,
                                                        int32_t* tokens, int32_t* parents, int32_t* depths, int32_t* positions, uint8_t* mask, int32_t* size_out, float* log_probs) {
  PdlWait();
  PdlLaunchDependents();
  root = static_cast<int>(HostOrDevice(root, root_on_device));
  start = HostOrDevice(start, start_on_device);
  extern __shared__ __align__(16) unsigned char dyn[];
  FrontierEntry* pool = reinterpret_cast<FrontierEntry*>(dyn);
  double* lp_table = reinterpret_cast<double*>(dyn + static_cast<size_t>(budget + 2) * sizeof(FrontierEntry));
  BuildTree<kMaxNodes>(values, tok, logz, depth, k, root, budget, start, lp_in_smem, pool, lp_table, tokens, parents, depths, positions, mask, size_out, log_probs);
}

// ---- small trees in one launch ----
// Budgets of up to policy::kDdtreeFusedMaxBudget nodes over up to 32 depths: the four launches above
// (row top-k, log-sum-exp slices, their merge, the build) each do little work for a small tree, and
// on a small target (a decode step of ~0.2 ms) their launch gaps are a visible part of a DDTree
// step that a chain of the same nodes does not pay. Block (row, slice)
// computes its slice's log-sum-exp partial (LseSlice: the same bits) and the slice's k best; the
// last block to finish merges each row's slices (a warp per row) and builds the tree. The k best
// are ordered as RowTopkKernel orders them: OrderKey descending, then the lower index.
constexpr int kFusedK = policy::kDdtreeFusedMaxBudget;
constexpr int kFusedPerLane = policy::kDdtreeFusedValuesPerLane;
static_assert(policy::kDdtreeFusedSlices == kLseSlices && policy::kDdtreeFusedMaxDepth <= 32, "the fused build's limits (dispatch_policy.h) follow its layout");

// The warp's best (key, index) among the lanes that have one: the largest key, then the lowest
// index; false where no lane has one.
__device__ __forceinline__ bool WarpBestPair(bool has, uint32_t key, uint32_t index, uint32_t* best_key, uint32_t* best_index) {
  *best_key = __reduce_max_sync(0xffffffffu, has ? key : 0u);
  *best_index = __reduce_min_sync(0xffffffffu, has && key == *best_key ? index : 0xffffffffu);
  return *best_index != 0xffffffffu;
}

// The k best of up to 32 lists sorted by (key desc, index asc), in that order: lane l walks list l
// (n entries, key_at(h) and id_at(h) its h-th); emit(j, key, index) runs on lane 0 for the j-th.
template <typename KeyAt, typename IdAt, typename Emit>
__device__ __forceinline__ void MergeLists(int n, int k, KeyAt key_at, IdAt id_at, Emit emit) {
  const int lane = threadIdx.x & 31;
  int h = 0;
  for (int j = 0; j < k; ++j) {
    const bool has = h < n;
    const uint32_t key = has ? key_at(h) : 0u, id = has ? id_at(h) : 0u;
    uint32_t best_key, best_index;
    if (!WarpBestPair(has, key, id, &best_key, &best_index)) break;
    if (lane == 0) emit(j, best_key, best_index);
    if (has && id == best_index) ++h;
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(1024) FusedBuildKernel(const float* x, int64_t cols, int k, double2* lse_partial, uint32_t* cand_keys, int32_t* cand_ids, int* counter,
                                                         int root, int budget, int64_t start, const int32_t* root_on_device, const int32_t* start_on_device,
                                                         int32_t* tokens, int32_t* parents, int32_t* depths, int32_t* positions, uint8_t* mask, int32_t* size_out,
                                                         float* log_probs) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ __align__(16) double red[1024];  // the last block reads it as double2
  __shared__ uint32_t warp_keys[32][kFusedK];
  __shared__ int32_t warp_ids[32][kFusedK];
  __shared__ int warp_count[32];
  const int depth = gridDim.x, r = blockIdx.x, slice = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* row = x + r * cols;
  const double2 part = LseSlice(row, cols, slice, red);
  if (threadIdx.x == 0) lse_partial[r * kLseSlices + slice] = part;
  // the slice's k best: each warp the k best of its contiguous share (lane l holds values l, l + 32,
  // ... of it), then warp 0 merges the 32 lists
  const int64_t per = (cols + kLseSlices - 1) / kLseSlices;
  const int64_t lo = min(cols, slice * per), hi = min(cols, lo + per), len = hi - lo;
  const int64_t share = (len + 31) / 32;
  const int64_t w0 = lo + min(len, warp * share), w1 = lo + min(len, (warp + 1) * share);
  uint32_t keys[kPerLane];
  uint32_t live = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = w0 + lane + 32 * j;
    keys[j] = i < w1 ? OrderKey(row[i]) : 0u;
    if (i < w1) live |= 1u << j;
  }
  // this lane's best: the largest key, the first (lowest index) of equal ones
  const auto lane_best = [&](uint32_t* key) {
    int best = -1;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if ((live >> j & 1u) && (best < 0 || keys[j] > *key)) {
        *key = keys[j];
        best = j;
      }
    }
    return best;
  };
  uint32_t mine_key = 0;
  int mine = lane_best(&mine_key);
  int count = 0;
  for (; count < k; ++count) {
    const uint32_t index = mine >= 0 ? static_cast<uint32_t>(w0 + lane + 32 * mine) : 0u;
    uint32_t best_key, best_index;
    if (!WarpBestPair(mine >= 0, mine_key, index, &best_key, &best_index)) break;
    if (lane == 0) {
      warp_keys[warp][count] = best_key;
      warp_ids[warp][count] = static_cast<int32_t>(best_index);
    }
    if (mine >= 0 && index == best_index) {  // taken: this lane's next best
      live &= ~(1u << mine);
      mine = lane_best(&mine_key);
    }
  }
  if (lane == 0) warp_count[warp] = count;
  __syncthreads();
  if (warp == 0) {
    uint32_t* out_keys = cand_keys + (r * kLseSlices + slice) * k;
    int32_t* out_ids = cand_ids + (r * kLseSlices + slice) * k;
    MergeLists(
        warp_count[lane], k, [&](int h) { return warp_keys[lane][h]; }, [&](int h) { return static_cast<uint32_t>(warp_ids[lane][h]); },
        [&](int j, uint32_t key, uint32_t index) {
          out_keys[j] = key;
          out_ids[j] = static_cast<int32_t>(index);
        });
  }
  __shared__ bool last;
  if (!LastOfBlocks(counter, gridDim.x * gridDim.y, &last)) return;
  // the last block: each row's log-sum-exp and k best (lane s walks slice s's list), then the tree
  __shared__ double logz_s[32];
  __shared__ float values_s[32 * kFusedK];
  __shared__ int32_t tok_s[32 * kFusedK];
  {
    // every slice's list and log-sum-exp partial into shared memory at once (the merges' reads
    // would each wait for L2 in turn: k of them a row); the partials where `red` was
    extern __shared__ uint32_t lists_s[];  // keys [depth][slices][k], then ids
    const int entries = depth * kLseSlices * k;
    double2* lse_s = reinterpret_cast<double2*>(red);
    for (int i = threadIdx.x; i < entries; i += blockDim.x) {
      lists_s[i] = __ldcg(cand_keys + i);
      lists_s[entries + i] = static_cast<uint32_t>(__ldcg(cand_ids + i));
    }
    for (int i = threadIdx.x; i < depth * kLseSlices; i += blockDim.x) lse_s[i] = __ldcg(lse_partial + i);
    __syncthreads();
    if (warp < depth) {
      const double logz = MergeLseWarp(lse_s + warp * kLseSlices);
      if (lane == 0) logz_s[warp] = logz;
      const int64_t slo = min(cols, lane * per), shi = min(cols, slo + per);
      const int n = lane < kLseSlices ? static_cast<int>(min(static_cast<int64_t>(k), shi - slo)) : 0;
      const uint32_t* list_keys = lists_s + (warp * kLseSlices + lane) * k;
      const uint32_t* list_ids = list_keys + entries;
      MergeLists(
          n, k, [&](int h) { return list_keys[h]; }, [&](int h) { return list_ids[h]; },
          [&](int j, uint32_t key, uint32_t index) {
            values_s[warp * k + j] = FromOrderKey(key);
            tok_s[warp * k + j] = static_cast<int32_t>(index);
          });
    }
  }
  __syncthreads();
  __shared__ FrontierEntry pool[kFusedK + 2];
  __shared__ double lp_table[32 * kFusedK];
  root = static_cast<int>(HostOrDevice(root, root_on_device));
  start = HostOrDevice(start, start_on_device);
  BuildTree<kFusedK + 1>(values_s, tok_s, logz_s, depth, k, root, budget, start, true, pool, lp_table, tokens, parents, depths, positions, mask, size_out, log_probs);
}

// ---- small drafts: a row over one or two blocks, the blocks one cluster ----
// Up to 8 rows of up to policy::kDdtreeClusterMaxVocab values. A part of a row (the whole row, or
// each half of a row past policy::kDdtreeClusterHalfVocab values) fits in the registers of one block of 1024
// threads (kPerThread values a thread); the blocks of one cluster take a part each, write its
// log-sum-exp partial and its k best into block 0's shared memory (distributed shared memory),
// and block 0 merges each row's parts and builds the tree. The fused build (above) needs a global
// round trip, a device-wide fence and a last-block count after its slices, and merges each row's
// top-k three times (warps, slices, rows); on a small target (a decode step of ~0.2 ms) that
// serial chain is what made a DDTree step dearer than a chain step of the same nodes. A part's
// pass is bound by its SM's issue rate (f64 exponentials and ordering work for every value), so a
// row of 8192 runs on two SMs: a cluster of 2 x depth blocks (past the portable 8 from 5 rows), where
// the device can hold one. A part's k best come from one threshold pass: T = the k-th largest of
// its 32 warps' maxima leaves at least k values >= T, those above T (typically a few more than
// k - 1) ranked against each other and those equal to T after them by index. Where the values
// equal to T are too many to keep (a drafter that gives every unseen token one low logit) the
// lowest indices among them are found in index order; parts with too many values above T take k
// rounds of a block-wide pick.
constexpr int kClusterCandidates = 256;
constexpr int kClusterRows = policy::kDdtreeClusterMaxBlocks;
static_assert(policy::kDdtreeClusterValuesPerThread == 8 && policy::kDdtreeClusterHalfVocab == 4096, "the cluster build's instances (LaunchDdtreeBuild) follow its limits");

// The cluster's barrier in two halves (sm_90): arrive (release: this thread's writes, distributed
// shared memory included, are visible to whoever waits after it; relaxed: nothing to publish)
// and wait (acquire). Arrives and waits alternate in each thread; a wait counts only threads that
// have not exited.
__device__ __forceinline__ void ClusterArrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void ClusterArriveRelaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void ClusterWait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// A (key, index) pair as one ordered word: larger keys first, then the lower index.
__device__ __forceinline__ unsigned long long RankWord(uint32_t key, uint32_t index) { return static_cast<unsigned long long>(key) << 32 | (0xFFFFFFFFu - index); }

// Shared memory of ClusterPart.
struct ClusterRowScratch {
  uint32_t warp_max[32];
  double warp_sum[32];
  unsigned long long above[kClusterCandidates];  // values above T, as rank words
  int equal[kClusterCandidates];                 // indices of values equal to T
  int above_count, equal_count;
  uint2 pick[2][32];  // per warp: a round's pick, or an index-order step's count (.x)
};

// A part's log-sum-exp partial (its max, and the f64 sum of exp(x - max)) and its min(k, cols) best
// (key desc, index asc) as values and tokens (`first` + the index in the part), by a block of
// 1024 threads; thread t holds values t, t + 1024, ... Returns synchronized.
template <int kPerThread>
__device__ void ClusterPart(const float* row, int64_t cols, int32_t first, int k, ClusterRowScratch& sh, float* out_values, int32_t* out_tokens, double2* out_lse) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned lanes_before = (1u << lane) - 1;
  const auto valid = [&](int j) { return static_cast<int64_t>(threadIdx.x) + 1024 * j < cols; };
  uint32_t key[kPerThread];
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    key[j] = valid(j) ? OrderKey(row[threadIdx.x + 1024 * j]) : 0u;
    mine = max(mine, key[j]);
  }
  const uint32_t wmax = __reduce_max_sync(0xffffffffu, mine);
  if (lane == 0) sh.warp_max[warp] = wmax;
  if (threadIdx.x == 0) sh.above_count = sh.equal_count = 0;
  __syncthreads();
  // every warp: the row's maximum, and T = the k-th largest warp maximum (k <= 32 warps), from the
  // 32 maxima sorted descending across the lanes (bitonic)
  uint32_t w = sh.warp_max[lane];
  const uint32_t max_key = __reduce_max_sync(0xffffffffu, w);
  for (int size = 2; size <= 32; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const uint32_t o = __shfl_xor_sync(0xffffffffu, w, stride);
      w = (((lane & stride) == 0) == ((lane & size) == 0)) ? max(w, o) : min(w, o);
    }
  }
  const uint32_t threshold = __shfl_sync(0xffffffffu, w, k - 1);
  // candidates: the values above T and those equal to it, each in any order (ranked below)
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const bool gt = valid(j) && key[j] > threshold, eq = valid(j) && key[j] == threshold;
    const unsigned bgt = __ballot_sync(0xffffffffu, gt), beq = __ballot_sync(0xffffffffu, eq);
    if ((bgt | beq) == 0) continue;
    const int leader = __ffs(bgt | beq) - 1;
    int base_gt = 0, base_eq = 0;
    if (lane == leader) {
      if (bgt) base_gt = atomicAdd(&sh.above_count, __popc(bgt));
      if (beq) base_eq = atomicAdd(&sh.equal_count, __popc(beq));
    }
    base_gt = __shfl_sync(0xffffffffu, base_gt, leader);
    base_eq = __shfl_sync(0xffffffffu, base_eq, leader);
    const uint32_t index = threadIdx.x + 1024 * j;
    if (gt) {
      const int at = base_gt + __popc(bgt & lanes_before);
      if (at < kClusterCandidates) sh.above[at] = RankWord(key[j], index);
    } else if (eq) {
      const int at = base_eq + __popc(beq & lanes_before);
      if (at < kClusterCandidates) sh.equal[at] = static_cast<int>(index);
    }
  }
  // sum of exp(x - max) in f64: each thread in index order, then a fixed tree. Terms below e^-60
  // are left out: the sum holds the max's term, 1, and 8192 of them add less than 1e-22, below
  // half an f64 ulp of 1 (a warp whose values are all that far below skips its exponentials).
  const float m = FromOrderKey(max_key);
  double sum = 0.0;
  if (m != -INFINITY) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const double d = static_cast<double>(FromOrderKey(key[j])) - static_cast<double>(m);
      if (valid(j) && !(d < -60.0)) sum += exp(d);  // a NaN stays in the sum, as in the other builds
    }
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
  if (lane == 0) sh.warp_sum[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    double total = sh.warp_sum[lane];
    for (int off = 16; off > 0; off >>= 1) total += __shfl_down_sync(0xffffffffu, total, off);
    if (lane == 0) *out_lse = make_double2(static_cast<double>(m), total);
  }
  const int above = sh.above_count, equal = sh.equal_count;
  const float t_value = FromOrderKey(threshold);
  if (above <= kClusterCandidates) {
    // the values above T, each ranked among the others (distinct words: the index breaks ties)
    if (threadIdx.x < above) {
      const unsigned long long me = sh.above[threadIdx.x];
      int ahead = 0;
      for (int j = 0; j < above; ++j) ahead += sh.above[j] > me;
      if (ahead < k) {
        out_values[ahead] = FromOrderKey(static_cast<uint32_t>(me >> 32));
        out_tokens[ahead] = first + static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(me));
      }
    }
    const int need = k - above;  // from the values equal to T, lowest index first
    if (need > 0 && equal <= kClusterCandidates) {
      if (threadIdx.x < equal) {
        const int me = sh.equal[threadIdx.x];
        int ahead = 0;
        for (int j = 0; j < equal; ++j) ahead += sh.equal[j] < me;
        if (ahead < need) {
          out_values[above + ahead] = t_value;
          out_tokens[above + ahead] = first + me;
        }
      }
    } else if (need > 0) {
      // more than were kept: in index order (step j holds indices 1024 j .. 1024 j + 1023 by
      // thread), each step's count per warp scanned, until `need` are placed
      int taken = 0;
      for (int j = 0; j < kPerThread && taken < need; ++j) {
        const bool eq = valid(j) && key[j] == threshold;
        const unsigned beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) sh.pick[j & 1][warp].x = __popc(beq);
        __syncthreads();  // pick[j & 1] was last read before the previous step's barrier
        const int count = static_cast<int>(sh.pick[j & 1][lane].x);
        int incl = count;
        for (int d = 1; d < 32; d <<= 1) {
          const int u = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += u;
        }
        const int warp_before = __shfl_sync(0xffffffffu, incl - count, warp), total = __shfl_sync(0xffffffffu, incl, 31);
        const int at = taken + warp_before + __popc(beq & lanes_before);
        if (eq && at < need) {
          out_values[above + at] = t_value;
          out_tokens[above + at] = first + static_cast<int32_t>(threadIdx.x + 1024 * j);
        }
        taken += total;
      }
    }
  } else {
    // k rounds: each picks the best value after the previous pick in (key desc, index asc) order
    unsigned long long prev = 0;
    for (int r = 0; r < k; ++r) {
      unsigned long long best = 0;
      bool has = false;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const unsigned long long v = RankWord(key[j], static_cast<uint32_t>(threadIdx.x + 1024 * j));
        if (valid(j) && (r == 0 || v < prev) && (!has || v > best)) best = v, has = true;
      }
      uint32_t bk, bi;
      const bool warp_has = WarpBestPair(has, static_cast<uint32_t>(best >> 32), has ? 0xFFFFFFFFu - static_cast<uint32_t>(best) : 0u, &bk, &bi);
      if (lane == 0) sh.pick[r & 1][warp] = warp_has ? make_uint2(bk, bi) : make_uint2(0u, 0xFFFFFFFFu);
      __syncthreads();  // pick[r & 1] was last read before the previous round's barrier
      const uint2 p = sh.pick[r & 1][lane];
      WarpBestPair(p.y != 0xFFFFFFFFu, p.x, p.y, &bk, &bi);
      prev = RankWord(bk, bi);
      if (threadIdx.x == 0) {
        out_values[r] = FromOrderKey(bk);
        out_tokens[r] = first + static_cast<int32_t>(bi);
      }
    }
  }
  __syncthreads();
}

// Block 0: each row's log-sum-exp and k best from its parts' (kParts lists of k, each sorted by
// (key desc, index asc), part 0's indices below part 1's), by rank: an entry's place in the row is
// its place in its list plus the entries of the other list ahead of it (a prefix of that list,
// found by bisection). The rows' log-sum-exp (an f64 exp and log each) is the last warp's, beside
// the ranks rather than after them.
template <int kParts>
__device__ void MergeParts(int depth, int k, const float* part_values, const int32_t* part_tokens, const double2* part_lse, float* values, int32_t* tokens, double* logz) {
  static_assert(kParts == 1 || kParts == 2, "one or two parts a row");
  for (int t = threadIdx.x; t < depth * kParts * k; t += blockDim.x) {
    const int row = t / (kParts * k), part = t / k % kParts, i = t % k;
    const float v = part_values[t];
    int ahead = i;
    if constexpr (kParts == 2) {
      const uint32_t key = OrderKey(v);
      const float* other = part_values + (row * 2 + (part ^ 1)) * k;
      int lo = 0, hi = k;  // the other list's first entry that is not ahead of this one
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const uint32_t o = OrderKey(other[mid]);
        if (part == 0 ? o > key : o >= key) lo = mid + 1;  // equal keys: part 0's lower index first
        else hi = mid;
      }
      ahead += lo;
    }
    if (ahead < k) {
      values[row * k + ahead] = v;
      tokens[row * k + ahead] = part_tokens[t];
    }
  }
  for (int row = static_cast<int>(threadIdx.x) - static_cast<int>(blockDim.x - 32); row >= 0 && row < depth; row += 32) {
    double m = part_lse[row * kParts].x;
    for (int p = 1; p < kParts; ++p) m = fmax(m, part_lse[row * kParts + p].x);
    // as MergeLseWarp: a part of -inf values adds nothing, a NaN part's sum (fmax skips it in m)
    // still reaches the total, and a row of -inf values gets -inf + log(0) = -inf
    double sum = 0.0;
    for (int p = 0; p < kParts; ++p) {
      const double2 l = part_lse[row * kParts + p];
      sum += kParts == 1 ? l.y : l.x != -INFINITY ? l.y * exp(l.x - m) : 0.0;
    }
    logz[row] = m + log(sum);
  }
}

template <int kPerThread, int kParts>
__global__ void __launch_bounds__(1024) ClusterBuildKernel(const float* x, int depth, int64_t cols, int k, int root, int budget, int64_t start, const int32_t* root_on_device,
                                                           const int32_t* start_on_device, int32_t* tokens, int32_t* parents, int32_t* depths, int32_t* positions, uint8_t* mask,
                                                           int32_t* size_out, float* log_probs) {
  PdlWait();
  DDTREE_PHASE(0);
  PdlLaunchDependents();
  // arrive now and wait before the first write into block 0: by then every block of the cluster
  // has started, so its shared memory exists
  ClusterArriveRelaxed();
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int me = static_cast<int>(cluster.block_rank());
  const int row = me / kParts, part = me % kParts;
  const int64_t per = (cols + kParts - 1) / kParts, lo = part * per, len = min(cols, lo + per) - lo;
  __shared__ float my_values[kFusedK];
  __shared__ int32_t my_tokens[kFusedK];
  __shared__ double2 my_lse;
  __shared__ ClusterRowScratch scratch;
  ClusterPart<kPerThread>(x + row * cols + lo, len, static_cast<int32_t>(lo), k, scratch, my_values, my_tokens, &my_lse);
  DDTREE_PHASE(1);
  // every part's results into block 0's shared memory (a part holds at least k values: k <= the
  // vocabulary, and a row has two parts only past 4096 values, at least 2048 each); the other blocks
  // then leave (nothing reads theirs)
  __shared__ float part_values[kClusterRows * kParts * kFusedK];
  __shared__ int32_t part_tokens[kClusterRows * kParts * kFusedK];
  __shared__ double2 part_lse[kClusterRows * kParts];
  ClusterWait();
  if (threadIdx.x < k) {
    cluster.map_shared_rank(part_values, 0)[me * k + threadIdx.x] = my_values[threadIdx.x];
    cluster.map_shared_rank(part_tokens, 0)[me * k + threadIdx.x] = my_tokens[threadIdx.x];
  }
  if (threadIdx.x == 0) *cluster.map_shared_rank(part_lse + me, 0) = my_lse;
  ClusterArrive();
  if (me != 0) return;
  ClusterWait();
  DDTREE_PHASE(2);
  __shared__ float values_s[kClusterRows * kFusedK];
  __shared__ int32_t tok_s[kClusterRows * kFusedK];
  __shared__ double logz_s[kClusterRows];
  MergeParts<kParts>(depth, k, part_values, part_tokens, part_lse, values_s, tok_s, logz_s);
  __syncthreads();
  DDTREE_PHASE(3);
  __shared__ FrontierEntry pool[kFusedK + 2];
  __shared__ double lp_table[kClusterRows * kFusedK];
  root = static_cast<int>(HostOrDevice(root, root_on_device));
  start = HostOrDevice(start, start_on_device);
  BuildTree<kFusedK + 1>(values_s, tok_s, logz_s, depth, k, root, budget, start, true, pool, lp_table, tokens, parents, depths, positions, mask, size_out, log_probs);
  DDTREE_PHASE(6);
}

// Accept in two parallel passes instead of a serial child scan per step: first[p] = the lowest
// child c of p whose token is the target's argmax at p, then thread 0 follows first[] from the root.
__global__ void __launch_bounds__(1024) AcceptKernel(const int32_t* tokens, const int32_t* parents, const int32_t* size_p, const int32_t* argmax, int32_t* path,
                                                     int32_t* path_len, int32_t* bonus, int capacity) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ int first[kMaxNodes];
  const int size = max(1, min(*size_p, capacity));
  for (int c = threadIdx.x; c < size; c += blockDim.x) first[c] = INT_MAX;
  __syncthreads();
  for (int c = 1 + threadIdx.x; c < size; c += blockDim.x) {
    const int p = parents[c];
    if (p >= 0 && p < c && tokens[c] == argmax[p]) atomicMin(&first[p], c);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int cur = 0, len = 1;
    path[0] = 0;
    while (first[cur] != INT_MAX) {
      cur = first[cur];
      path[len++] = cur;
    }
    *path_len = len;
    *bonus = argmax[cur];
  }
}

constexpr int kMaxCommitCaches = 64;
struct CommitBatch {
  void* data[kMaxCommitCaches];                             // f32 or bf16 rows
  int64_t rows[kMaxCommitCaches], width[kMaxCommitCaches];  // width: units per row
  bool wide[kMaxCommitCaches];                              // units of 32 bits (rows of whole words), else 16
};

template <typename U>
__device__ __forceinline__ void MoveRow(U* data, int64_t width, int64_t to, int64_t from) {
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) data[to * width + j] = data[from * width + j];
}

// One block per cache tensor; k ascending with a barrier between steps (a later step may read a
// slot an earlier one would otherwise overwrite).
__global__ void KvCommitKernel(const __grid_constant__ CommitBatch batch, const int32_t* path, const int32_t* path_len, int capacity, int64_t start,
                               const int32_t* start_on_device) {
  PdlWait();
  PdlLaunchDependents();
  start = HostOrDevice(start, start_on_device);
  if (start < 0) return;  // rejected by the cpu twin; nothing to move here
  void* data = batch.data[blockIdx.x];
  const int64_t rows = batch.rows[blockIdx.x], width = batch.width[blockIdx.x];
  const bool wide = batch.wide[blockIdx.x];
  const int len = min(*path_len, capacity);
  for (int k = 0; k < len; ++k) {
    const int src = path[k];
    const bool ok = src >= k && start + src < rows;
    if (ok && src != k) {
      if (wide) {
        MoveRow(static_cast<uint32_t*>(data), width, start + k, start + src);
      } else {
        MoveRow(static_cast<uint16_t*>(data), width, start + k, start + src);
      }
    }
    __syncthreads();
  }
}

// The committed length after a commit: start + path_len (path_len clamped as KvCommitKernel does).
__global__ void NextStartKernel(int64_t start, const int32_t* start_on_device, const int32_t* path_len, int capacity, int32_t* next_start) {
  PdlWait();
  PdlLaunchDependents();
  *next_start = static_cast<int32_t>(HostOrDevice(start, start_on_device) + max(0, min(*path_len, capacity)));
}

}  // namespace

// Segments per row of the two-pass top-k: one block per row left 8 of 132 SMs busy for a draft's
// 8 rows of 163840 logits (~260 us). Each segment's k best are candidates; the k
// best of a row's candidates are its k best, with the same ties: a row's candidates run in
// segment order and, among equal values, in index order.
int TopkSegments(int64_t cols, int k) {
  constexpr int64_t kMinSegment = 8192;  // values per block at least (below, the extra pass costs more)
  const int64_t per = std::max<int64_t>(kMinSegment, 4LL * k);
  return static_cast<int>(std::min<int64_t>(32, std::max<int64_t>(1, cols / per)));
}

size_t TopkScratchBytes(int64_t rows, int k, int64_t cols) {
  const int segments = TopkSegments(cols, k);
  return segments > 1 ? static_cast<size_t>(rows) * segments * k * (sizeof(float) + sizeof(int32_t)) : 0;
}

Status LaunchRowTopk(const float* x, int64_t rows, int64_t cols, int k, float* values, int32_t* ids, void* scratch, cudaStream_t s) {
  if (rows == 0 || k == 0) return Status::Ok();
  const int segments = TopkSegments(cols, k);
  if (segments == 1) {
    return LaunchPdl("row top-k", RowTopkKernel, dim3(static_cast<unsigned>(rows)), dim3(kTopkThreads), 0, s, x, cols, cols, 1, cols, k, static_cast<const int32_t*>(nullptr), values, ids);
  }
  const int64_t candidates = static_cast<int64_t>(segments) * k;
  float* cand_values = static_cast<float*>(scratch);
  int32_t* cand_ids = reinterpret_cast<int32_t*>(cand_values + rows * candidates);
  KDTREE_RETURN_IF_ERROR(LaunchPdl("row top-k: segments", RowTopkKernel, dim3(static_cast<unsigned>(rows * segments)), dim3(kTopkThreads), 0, s, x, cols, (cols + segments - 1) / segments,
                                   segments, cols, k, static_cast<const int32_t*>(nullptr), cand_values, cand_ids));
  if (candidates <= kSortCandidatesMax) {
    return LaunchPdl("row top-k: sort candidates", SortCandidatesKernel, dim3(static_cast<unsigned>(rows)), dim3(kTopkThreads), 0, s, static_cast<const float*>(cand_values),
                     static_cast<const int32_t*>(cand_ids), static_cast<int>(candidates), k, values, ids);
  }
  return LaunchPdl("row top-k: candidates", RowTopkKernel, dim3(static_cast<unsigned>(rows)), dim3(kTopkThreads), 0, s, static_cast<const float*>(cand_values), candidates, candidates, 1,
                   candidates, k, static_cast<const int32_t*>(cand_ids), values, ids);
}

// Whether this device can hold a cluster of 2 x depth blocks of the build over halves of rows (past 8 blocks
// the size is not portable: it needs the opt-in and a GPC with that many free SMs), asked once
// per device and depth; where it cannot, each row runs on one block.
namespace {
bool ClusterOfHalvesFits(int depth) {
  constexpr int kDevices = 64;
  static std::atomic<int8_t> known[kDevices][kClusterRows + 1];  // 0 not asked, 1 fits, -1 does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices || depth < 1 || depth > kClusterRows) return false;
  std::atomic<int8_t>& slot = known[device][depth];
  if (const int8_t k = slot.load(std::memory_order_relaxed); k != 0) return k > 0;
  // A failed query below leaves its error as the thread's last error; it is cleared so that the next
  // launch's check does not report it, unless an earlier call had left an error pending, which is
  // not cleared with it (CUDA keeps one last error: the query's then stands in its place).
  const bool earlier_error_pending = cudaPeekAtLastError() != cudaSuccess;
  const auto kernel = ClusterBuildKernel<4, 2>;
  bool fits = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  if (fits) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(2 * depth);
    config.blockDim = dim3(1024);
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2 * depth;
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = 0;
    fits = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
  }
  if (!fits && !earlier_error_pending) cudaGetLastError();
  slot.store(fits ? 1 : -1, std::memory_order_relaxed);
  return fits;
}
}  // namespace

Status LaunchDdtreeBuild(const DdtreeBuildArgs& a, cudaStream_t s, Scratch& scratch, const char** form_out) {
  const int depth = static_cast<int>(a.draft_logits.dim(0));
  const int64_t vocab = a.draft_logits.dim(1);
  const int k = static_cast<int>(std::min<int64_t>(a.budget, vocab));
  const int kk = std::max(k, 1);
  const policy::DdtreeBuildForm form = policy::PlanDdtreeBuild(a.budget, depth, vocab);
  *form_out = policy::DdtreeBuildFormName(form);
  if (form == policy::DdtreeBuildForm::kCluster || form == policy::DdtreeBuildForm::kClusterHalves) {
    const auto launch = [&](auto kernel, int parts) -> Status {
      return LaunchPdlCluster("ddtree build (cluster)", kernel, dim3(depth * parts), dim3(1024), 0, s, depth * parts, a.draft_logits.as<const float>(), depth, vocab, k, a.root,
                              a.budget, a.start, OnDevice(a.root_on_device), OnDevice(a.start_on_device), a.tokens.as<int32_t>(), a.parents.as<int32_t>(),
                              a.depths.as<int32_t>(), a.positions.as<int32_t>(), a.mask.as<uint8_t>(), a.size.as<int32_t>(),
                              a.log_probs.present() ? a.log_probs.as<float>() : nullptr);
    };
    if (form == policy::DdtreeBuildForm::kClusterHalves) {
      if (ClusterOfHalvesFits(depth)) return launch(ClusterBuildKernel<4, 2>, 2);
      *form_out = policy::DdtreeBuildFormName(policy::DdtreeBuildForm::kCluster);
    }
    const int64_t per_thread = (vocab + 1023) / 1024;
    if (per_thread <= 1) return launch(ClusterBuildKernel<1, 1>, 1);
    if (per_thread <= 2) return launch(ClusterBuildKernel<2, 1>, 1);
    if (per_thread <= 4) return launch(ClusterBuildKernel<4, 1>, 1);
    return launch(ClusterBuildKernel<8, 1>, 1);
  }
  if (form == policy::DdtreeBuildForm::kFused) {
    // scratch: lse partials [depth, slices], slice candidates (keys, ids) [depth, slices, k]
    const size_t off_keys = static_cast<size_t>(depth) * kLseSlices * sizeof(double2);
    const size_t off_ids = off_keys + static_cast<size_t>(depth) * kLseSlices * k * sizeof(uint32_t);
    KDTREE_RETURN_IF_ERROR(scratch.Reserve(off_ids + static_cast<size_t>(depth) * kLseSlices * k * sizeof(int32_t), s));
    void* counter = nullptr;
    KDTREE_RETURN_IF_ERROR(scratch.Zeroed(sizeof(int), s, &counter));
    char* base = static_cast<char*>(scratch.ptr);
    // the last block's copy of every slice's list (keys and ids); the attribute is always set to
    // the largest copy, so host threads launching other sizes at once never lower it under a launch
    const size_t lists_bytes = static_cast<size_t>(depth) * kLseSlices * k * 8;
    constexpr int kMaxListsBytes = policy::kDdtreeFusedMaxDepth * kLseSlices * kFusedK * 8;
    // values a lane holds: a slice's share of the row over 32 warps of 32 lanes, in the smallest
    // instance that holds them (every round of a warp's picks scans them all)
    const int64_t per_lane = ((vocab + kLseSlices - 1) / kLseSlices + 1023) / 1024;
    const auto launch = [&](auto kernel) -> Status {
      KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxListsBytes), "ddtree build (fused): shared memory"));
      return LaunchPdl("ddtree build (fused)", kernel, dim3(depth, kLseSlices), dim3(1024), lists_bytes, s, a.draft_logits.as<const float>(), vocab, k, reinterpret_cast<double2*>(base),
                       reinterpret_cast<uint32_t*>(base + off_keys), reinterpret_cast<int32_t*>(base + off_ids), static_cast<int*>(counter), a.root, a.budget, a.start,
                       OnDevice(a.root_on_device), OnDevice(a.start_on_device), a.tokens.as<int32_t>(), a.parents.as<int32_t>(), a.depths.as<int32_t>(),
                       a.positions.as<int32_t>(), a.mask.as<uint8_t>(), a.size.as<int32_t>(), a.log_probs.present() ? a.log_probs.as<float>() : nullptr);
    };
    static_assert(kFusedPerLane == 16, "the instances below");
    if (per_lane <= 1) return launch(FusedBuildKernel<1>);
    if (per_lane <= 2) return launch(FusedBuildKernel<2>);
    if (per_lane <= 4) return launch(FusedBuildKernel<4>);
    if (per_lane <= 8) return launch(FusedBuildKernel<8>);
    return launch(FusedBuildKernel<16>);
  }
  // scratch: values f32 [depth, k], tokens i32 [depth, k], logz f64 [depth], lse partials [depth, slices], top-k candidates
  const size_t off_tok = static_cast<size_t>(depth) * kk * 4;
  const size_t off_logz = (off_tok + static_cast<size_t>(depth) * kk * 4 + 15) / 16 * 16;
  const size_t off_lse = off_logz + (static_cast<size_t>(depth) * 8 + 15) / 16 * 16;
  const size_t off_topk = (off_lse + static_cast<size_t>(depth) * kLseSlices * sizeof(double2) + 255) / 256 * 256;
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(off_topk + TopkScratchBytes(depth, kk, vocab), s));
  char* base = static_cast<char*>(scratch.ptr);
  float* values = reinterpret_cast<float*>(base);
  int32_t* tok = reinterpret_cast<int32_t*>(base + off_tok);
  double* logz = reinterpret_cast<double*>(base + off_logz);
  double2* lse_partial = reinterpret_cast<double2*>(base + off_lse);
  if (k > 0) {
    KDTREE_RETURN_IF_ERROR(LaunchRowTopk(a.draft_logits.as<const float>(), depth, vocab, k, values, tok, base + off_topk, s));
    KDTREE_RETURN_IF_ERROR(LaunchPdl("ddtree log-sum-exp", LogSumExpSliceKernel, dim3(depth, kLseSlices), dim3(1024), 0, s, a.draft_logits.as<const float>(), vocab, lse_partial));
    KDTREE_RETURN_IF_ERROR(LaunchPdl("ddtree log-sum-exp merge", LogSumExpMergeKernel, dim3(depth), dim3(32), 0, s, static_cast<const double2*>(lse_partial), logz));
  }
  // shared memory: the frontier pool always, the [depth, k] log-prob table when it fits beside it
  constexpr size_t kMaxDynamicSmem = 160 * 1024;
  const size_t pool_bytes = static_cast<size_t>(a.budget + 2) * sizeof(FrontierEntry);
  const size_t table_bytes = static_cast<size_t>(depth) * k * sizeof(double);
  const bool lp_in_smem = pool_bytes + table_bytes <= kMaxDynamicSmem;
  const size_t smem = pool_bytes + (lp_in_smem ? table_bytes : 0);
  constexpr size_t kStaticSmem = 3 * kMaxNodes * sizeof(int) + sizeof(int);  // parents_s, depths_s, at_s, size_s
  if (smem + kStaticSmem > 48 * 1024) {  // static + dynamic past 48 KiB needs the opt-in
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(BuildTreeKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "ddtree build: shared memory"));
  }
  return LaunchPdl("ddtree build", BuildTreeKernel, dim3(1), dim3(1024), smem, s, static_cast<const float*>(values), static_cast<const int32_t*>(tok), static_cast<const double*>(logz), depth,
                   k, a.root, a.budget, a.start, OnDevice(a.root_on_device), OnDevice(a.start_on_device), lp_in_smem, a.tokens.as<int32_t>(), a.parents.as<int32_t>(), a.depths.as<int32_t>(), a.positions.as<int32_t>(), a.mask.as<uint8_t>(),
                   a.size.as<int32_t>(), a.log_probs.present() ? a.log_probs.as<float>() : nullptr);
}

Status LaunchDdtreeAccept(const DdtreeAcceptArgs& a, cudaStream_t s) {
  const int capacity = static_cast<int>(std::min(a.tokens.dim(0), a.target_argmax.dim(0)));
  return LaunchPdl("ddtree accept", AcceptKernel, dim3(1), dim3(1), 0, s, a.tokens.as<const int32_t>(), a.parents.as<const int32_t>(), a.size.as<const int32_t>(),
                   a.target_argmax.as<const int32_t>(), a.path.as<int32_t>(), a.path_len.as<int32_t>(), a.bonus.as<int32_t>(), capacity);
}

Status LaunchKvCommit(const KvCommitArgs& a, cudaStream_t s) {
  for (size_t first = 0; first < a.caches.size(); first += kMaxCommitCaches) {
    CommitBatch batch{};
    const int count = static_cast<int>(std::min<size_t>(kMaxCommitCaches, a.caches.size() - first));
    for (int i = 0; i < count; ++i) {
      const Tensor& c = a.caches[first + i];
      const int64_t row_bytes = c.dim(1) * DTypeSize(c.dtype);
      batch.data[i] = c.data;
      batch.rows[i] = c.dim(0);
      batch.wide[i] = row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(c.data) % 4 == 0;
      batch.width[i] = row_bytes / (batch.wide[i] ? 4 : 2);
    }
    KDTREE_RETURN_IF_ERROR(LaunchPdl("kv_commit", KvCommitKernel, dim3(count), dim3(256), 0, s, batch, a.path.as<const int32_t>(), a.path_len.as<const int32_t>(),
                                     static_cast<int>(a.path.dim(0)), a.start, OnDevice(a.start_on_device)));
  }
  // after every batch has read the start: next_start may be start_on_device itself
  if (a.next_start.present()) {
    return LaunchPdl("kv_commit: next start", NextStartKernel, dim3(1), dim3(1), 0, s, a.start, OnDevice(a.start_on_device), a.path_len.as<const int32_t>(),
                     static_cast<int>(a.path.dim(0)), a.next_start.as<int32_t>());
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace kdtree
