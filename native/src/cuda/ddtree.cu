// DDTree on the device (the reference is @kdtree/reference ddtree.ts):
//   build   per depth the top-K draft tokens (radix select + bitonic sort, one block per depth) and
//           their log-softmax (log-sum-exp in f64), then the best-first heap expansion into at most
//           B nodes (one thread: B <= 1024 pops, microseconds), then positions and the ancestor mask
//   accept  the greedy walk from the root along children whose token is the target's argmax
//   commit  KV[start + k] = KV[start + path[k]] for k ascending, in every cache tensor
// Ties follow the reference: tokens by (logit desc, id asc); heap entries by (log-prob desc, push order).
#include <algorithm>

#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kTopkThreads = 1024;

__device__ __forceinline__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // larger float -> larger key
}

// One block per row: the k largest (value desc, index asc), k <= 1024.
__global__ void __launch_bounds__(kTopkThreads) RowTopkKernel(const float* x, int64_t cols, int k, float* values, int32_t* ids) {
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int remaining_s;
  __shared__ int count_gt[kTopkThreads], count_eq[kTopkThreads];
  __shared__ uint32_t keys[kTopkThreads];
  __shared__ int idx[kTopkThreads];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  if (threadIdx.x == 0) {
    prefix_s = 0;
    mask_s = 0;
    remaining_s = k;
  }
  // 1. radix select: the k-th largest key, 8 bits at a time from the top
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const uint32_t key = OrderKey(row[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFF], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int remaining = remaining_s;
      for (int b = 255; b >= 0; --b) {
        if (hist[b] >= remaining) {
          prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
          mask_s = mask | (0xFFu << shift);
          break;
        }
        remaining -= hist[b];
      }
      remaining_s = remaining;  // how many keys equal to the threshold we still need
    }
    __syncthreads();
  }
  const uint32_t thr = prefix_s;
  const int need_eq = remaining_s;
  // 2. ordered compaction: contiguous index ranges per thread, so ties keep the lowest indices
  const int64_t chunk = (cols + blockDim.x - 1) / blockDim.x;
  const int64_t i0 = min(cols, threadIdx.x * chunk), i1 = min(cols, i0 + chunk);
  int gt = 0, eq = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t key = OrderKey(row[i]);
    gt += key > thr;
    eq += key == thr;
  }
  count_gt[threadIdx.x] = gt;
  count_eq[threadIdx.x] = eq;
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive scan over threads, in thread (= index) order
    int run_gt = 0, run_eq = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const int cg = count_gt[t], ce = count_eq[t];
      count_gt[t] = run_gt;
      count_eq[t] = run_eq;
      run_gt += cg;
      run_eq += ce;
    }
  }
  __syncthreads();
  int pos_gt = count_gt[threadIdx.x], pos_eq = count_eq[threadIdx.x];
  const int total_gt = k - need_eq;
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t key = OrderKey(row[i]);
    if (key > thr) {
      keys[pos_gt] = key;
      idx[pos_gt] = static_cast<int>(i);
      ++pos_gt;
    } else if (key == thr) {
      if (pos_eq < need_eq) {
        keys[total_gt + pos_eq] = key;
        idx[total_gt + pos_eq] = static_cast<int>(i);
      }
      ++pos_eq;
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
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool first = keys[i] > keys[j] || (keys[i] == keys[j] && idx[i] < idx[j]);  // i before j?
          const bool ascending_block = (i & size) == 0;
          if (ascending_block != first) {
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
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    values[static_cast<int64_t>(blockIdx.x) * k + i] = row[idx[i]];
    ids[static_cast<int64_t>(blockIdx.x) * k + i] = idx[i];
  }
}

// log-sum-exp per row in f64 (fixed-order tree), as the reference's log-softmax normalizer.
__global__ void LogSumExpKernel(const float* x, int64_t cols, double* out) {
  __shared__ double red[1024];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) mx = fmaxf(mx, row[i]);
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const double m = red[0];
  __syncthreads();
  double sum = 0;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) sum += exp(static_cast<double>(row[i]) - m);
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = m + log(red[0]);
}

struct HeapEntry {
  double w;
  int parent, depth, rank, seq;
};

__device__ __forceinline__ bool Better(const HeapEntry& a, const HeapEntry& b) { return a.w > b.w || (a.w == b.w && a.seq < b.seq); }

// The heap expansion on thread 0, then positions and the ancestor mask on the whole block.
__global__ void __launch_bounds__(1024) BuildTreeKernel(const float* values, const int32_t* tok, const double* logz, int depth, int k, int root, int budget,
                                                        int64_t start, HeapEntry* heap, int32_t* tokens, int32_t* parents, int32_t* depths,
                                                        int32_t* positions, uint8_t* mask, int32_t* size_out) {
  __shared__ int size_s;
  const int n = budget + 1;
  if (threadIdx.x == 0) {
    for (int i = 0; i < n; ++i) {
      tokens[i] = -1;
      parents[i] = -1;
      depths[i] = 0;
    }
    tokens[0] = root;
    int size = 1, len = 0, seq = 0;
    auto lp = [&](int d, int r) { return static_cast<double>(values[d * k + r]) - logz[d]; };
    auto push = [&](HeapEntry e) {
      int i = len++;
      heap[i] = e;
      while (i > 0) {
        const int p = (i - 1) >> 1;
        if (!Better(heap[i], heap[p])) break;
        const HeapEntry tmp = heap[i];
        heap[i] = heap[p];
        heap[p] = tmp;
        i = p;
      }
    };
    if (k > 0) push(HeapEntry{lp(0, 0), 0, 1, 0, seq++});
    while (len > 0 && size < n) {
      const HeapEntry e = heap[0];
      heap[0] = heap[--len];
      for (int i = 0;;) {  // sift down
        const int l = 2 * i + 1, r = l + 1;
        int m = i;
        if (l < len && Better(heap[l], heap[m])) m = l;
        if (r < len && Better(heap[r], heap[m])) m = r;
        if (m == i) break;
        const HeapEntry tmp = heap[i];
        heap[i] = heap[m];
        heap[m] = tmp;
        i = m;
      }
      const int node = size++;
      const int at = (e.depth - 1) * k + e.rank;
      tokens[node] = tok[at];
      parents[node] = e.parent;
      depths[node] = e.depth;
      if (e.rank + 1 < k) push(HeapEntry{e.w - lp(e.depth - 1, e.rank) + lp(e.depth - 1, e.rank + 1), e.parent, e.depth, e.rank + 1, seq++});
      if (e.depth < depth) push(HeapEntry{e.w + lp(e.depth, 0), node, e.depth + 1, 0, seq++});
    }
    size_s = size;
    *size_out = size;
  }
  __syncthreads();
  const int size = size_s;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    positions[i] = static_cast<int32_t>(start + depths[i]);
    uint8_t* row = mask + static_cast<int64_t>(i) * n;
    for (int j = 0; j < n; ++j) row[j] = 0;
    if (i < size) for (int j = i; j >= 0; j = parents[j]) row[j] = 1;
  }
}

__global__ void AcceptKernel(const int32_t* tokens, const int32_t* parents, const int32_t* size_p, const int32_t* argmax, int32_t* path, int32_t* path_len, int32_t* bonus, int capacity) {
  const int size = min(*size_p, capacity);
  int cur = 0, len = 1;
  path[0] = 0;
  for (;;) {
    int next = -1;
    for (int c = cur + 1; c < size; ++c) {
      if (parents[c] == cur && tokens[c] == argmax[cur]) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    path[len++] = next;
    cur = next;
  }
  *path_len = len;
  *bonus = argmax[cur];
}

constexpr int kMaxCommitCaches = 64;
struct CommitBatch {
  float* data[kMaxCommitCaches];
  int64_t rows[kMaxCommitCaches], width[kMaxCommitCaches];
};

// One block per cache tensor; k ascending with a barrier between steps (a later step may read a
// slot an earlier one would otherwise overwrite).
__global__ void KvCommitKernel(const __grid_constant__ CommitBatch batch, const int32_t* path, const int32_t* path_len, int capacity, int64_t start) {
  float* data = batch.data[blockIdx.x];
  const int64_t rows = batch.rows[blockIdx.x], width = batch.width[blockIdx.x];
  const int len = min(*path_len, capacity);
  for (int k = 0; k < len; ++k) {
    const int src = path[k];
    const bool ok = src >= k && start + src < rows;
    if (ok && src != k) {
      for (int64_t j = threadIdx.x; j < width; j += blockDim.x) data[(start + k) * width + j] = data[(start + src) * width + j];
    }
    __syncthreads();
  }
}

}  // namespace

size_t TopkScratchBytes(int64_t, int) { return 0; }

Status LaunchRowTopk(const float* x, int64_t rows, int64_t cols, int k, float* values, int32_t* ids, void*, cudaStream_t s) {
  if (rows == 0 || k == 0) return Status::Ok();
  RowTopkKernel<<<static_cast<unsigned>(rows), kTopkThreads, 0, s>>>(x, cols, k, values, ids);
  return LaunchStatus("row top-k");
}

Status LaunchDdtreeBuild(const DdtreeBuildArgs& a, cudaStream_t s, Scratch& scratch) {
  const int depth = static_cast<int>(a.draft_logits.dim(0));
  const int64_t vocab = a.draft_logits.dim(1);
  const int k = static_cast<int>(std::min<int64_t>(a.budget, vocab));
  const int kk = std::max(k, 1);
  // scratch: values f32 [depth, k], tokens i32 [depth, k], logz f64 [depth], heap [2 * budget + 2]
  const size_t off_tok = static_cast<size_t>(depth) * kk * 4;
  const size_t off_logz = (off_tok + static_cast<size_t>(depth) * kk * 4 + 7) / 8 * 8;
  const size_t off_heap = (off_logz + depth * 8 + 15) / 16 * 16;
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(off_heap + (2 * static_cast<size_t>(a.budget) + 2) * sizeof(HeapEntry), s));
  char* base = static_cast<char*>(scratch.ptr);
  float* values = reinterpret_cast<float*>(base);
  int32_t* tok = reinterpret_cast<int32_t*>(base + off_tok);
  double* logz = reinterpret_cast<double*>(base + off_logz);
  HeapEntry* heap = reinterpret_cast<HeapEntry*>(base + off_heap);
  if (k > 0) {
    KDTREE_RETURN_IF_ERROR(LaunchRowTopk(a.draft_logits.as<const float>(), depth, vocab, k, values, tok, nullptr, s));
    LogSumExpKernel<<<depth, 1024, 0, s>>>(a.draft_logits.as<const float>(), vocab, logz);
    KDTREE_RETURN_IF_ERROR(LaunchStatus("ddtree log-sum-exp"));
  }
  BuildTreeKernel<<<1, 1024, 0, s>>>(values, tok, logz, depth, k, a.root, a.budget, a.start, heap, a.tokens.as<int32_t>(), a.parents.as<int32_t>(),
                                     a.depths.as<int32_t>(), a.positions.as<int32_t>(), a.mask.as<uint8_t>(), a.size.as<int32_t>());
  return LaunchStatus("ddtree build");
}

Status LaunchDdtreeAccept(const DdtreeAcceptArgs& a, cudaStream_t s) {
  const int capacity = static_cast<int>(std::min(a.tokens.dim(0), a.target_argmax.dim(0)));
  AcceptKernel<<<1, 1, 0, s>>>(a.tokens.as<const int32_t>(), a.parents.as<const int32_t>(), a.size.as<const int32_t>(), a.target_argmax.as<const int32_t>(),
                               a.path.as<int32_t>(), a.path_len.as<int32_t>(), a.bonus.as<int32_t>(), capacity);
  return LaunchStatus("ddtree accept");
}

Status LaunchKvCommit(const KvCommitArgs& a, cudaStream_t s) {
  for (size_t first = 0; first < a.caches.size(); first += kMaxCommitCaches) {
    CommitBatch batch{};
    const int count = static_cast<int>(std::min<size_t>(kMaxCommitCaches, a.caches.size() - first));
    for (int i = 0; i < count; ++i) {
      const Tensor& c = a.caches[first + i];
      batch.data[i] = c.as<float>();
      batch.rows[i] = c.dim(0);
      batch.width[i] = c.dim(1);
    }
    KvCommitKernel<<<count, 256, 0, s>>>(batch, a.path.as<const int32_t>(), a.path_len.as<const int32_t>(), static_cast<int>(a.path.dim(0)), a.start);
    KDTREE_RETURN_IF_ERROR(LaunchStatus("kv_commit"));
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace kdtree
