// The CPU twins of the DDTree ops (cuda/ddtree.cu): ddtreeBuild (the best-first tree of a draft's
// per-depth top-K tokens, its ancestor mask and positions), ddtreeAccept (the longest path the
// target's argmax agrees with) and kvCommit (the accepted path's cache rows moved into place).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <queue>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

Status DdtreeBuild(const DdtreeBuildArgs& a, ThreadPool& pool) {
  const int64_t depth = a.draft_logits.dim(0), v = a.draft_logits.dim(1);
  const int64_t k = std::min<int64_t>(a.budget, v), n = a.budget + 1;
  const int32_t root = a.root_on_device.present() ? a.root_on_device.as<const int32_t>()[0] : a.root;
  const int64_t start = a.start_on_device.present() ? a.start_on_device.as<const int32_t>()[0] : a.start;
  if (root < 0 || root >= v) return Invalid("ddtree_build: rootOnDevice holds token ", root, ", outside the vocabulary [0, ", v, ")");
  if (start < 0) return Invalid("ddtree_build: startOnDevice holds ", start, ", a negative position");
  // per depth: top-K tokens by log-softmax, descending; ties to the lower token id
  std::vector<double> lp(static_cast<size_t>(depth * std::max<int64_t>(k, 1)));
  std::vector<int32_t> tok(lp.size());
  std::vector<int> order(static_cast<size_t>(v));
  for (int64_t d = 0; d < depth && k > 0; ++d) {
    const float* x = a.draft_logits.as<const float>() + d * v;
    double mx = -INFINITY;
    for (int64_t i = 0; i < v; ++i) mx = std::max(mx, static_cast<double>(x[i]));
    double sum = 0.0;
    for (int64_t i = 0; i < v; ++i) sum += std::exp(x[i] - mx);
    const double logz = mx + std::log(sum);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int p, int q) { return x[p] > x[q] || (x[p] == x[q] && p < q); });
    for (int64_t r = 0; r < k; ++r) {
      tok[d * k + r] = order[r];
      lp[d * k + r] = x[order[r]] - logz;
    }
  }
  int32_t* tokens = a.tokens.as<int32_t>();
  int32_t* parents = a.parents.as<int32_t>();
  int32_t* depths = a.depths.as<int32_t>();
  std::fill(tokens, tokens + n, -1);
  std::fill(parents, parents + n, -1);
  std::fill(depths, depths + n, 0);
  float* log_probs = a.log_probs.present() ? a.log_probs.as<float>() : nullptr;
  if (log_probs != nullptr) {
    std::fill(log_probs, log_probs + n, -INFINITY);
    log_probs[0] = 0.f;
  }
  tokens[0] = root;
  int64_t size = 1;
  struct Entry { double w; int32_t parent, depth, rank; int64_t seq; };
  auto worse = [](const Entry& x, const Entry& y) { return x.w < y.w || (x.w == y.w && x.seq > y.seq); };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  int64_t seq = 0;
  if (k > 0) heap.push({lp[0], 0, 1, 0, seq++});
  while (!heap.empty() && size < n) {
    const Entry e = heap.top();
    heap.pop();
    const int64_t node = size++;
    const int64_t at = (e.depth - 1) * k + e.rank;
    tokens[node] = tok[at];
    parents[node] = e.parent;
    depths[node] = e.depth;
    if (log_probs != nullptr) log_probs[node] = static_cast<float>(e.w);
    if (e.rank + 1 < k) heap.push({e.w - lp[at] + lp[at + 1], e.parent, e.depth, e.rank + 1, seq++});
    if (e.depth < depth) heap.push({e.w + lp[e.depth * k], static_cast<int32_t>(node), e.depth + 1, 0, seq++});
  }
  uint8_t* mask = a.mask.as<uint8_t>();
  std::memset(mask, 0, static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    a.positions.as<int32_t>()[i] = static_cast<int32_t>(start + depths[i]);
    if (i < size) for (int64_t j = i; j >= 0; j = parents[j]) mask[i * n + j] = 1;
  }
  a.size.as<int32_t>()[0] = static_cast<int32_t>(size);
  return Status::Ok();
}

Status DdtreeAccept(const DdtreeAcceptArgs& a, ThreadPool& pool) {
  const int32_t size = a.size.as<const int32_t>()[0];
  if (size < 1 || size > a.tokens.dim(0)) return Invalid("ddtree_accept: size ", size, " is outside [1, ", a.tokens.dim(0), "] (tokens' nodes)");
  if (size > a.target_argmax.dim(0)) return Invalid("ddtree_accept: size ", size, " is more nodes than targetArgmax's ", a.target_argmax.dim(0), " (one target argmax a node)");
  int32_t cur = 0, len = 1;
  a.path.as<int32_t>()[0] = 0;
  for (;;) {
    int32_t next = -1;
    for (int32_t c = cur + 1; c < size; ++c) {
      if (a.parents.as<const int32_t>()[c] == cur && a.tokens.as<const int32_t>()[c] == a.target_argmax.as<const int32_t>()[cur]) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    a.path.as<int32_t>()[len++] = next;
    cur = next;
  }
  a.path_len.as<int32_t>()[0] = len;
  a.bonus.as<int32_t>()[0] = a.target_argmax.as<const int32_t>()[cur];
  return Status::Ok();
}

Status KvCommit(const KvCommitArgs& a, ThreadPool& pool) {
  const int32_t len = a.path_len.as<const int32_t>()[0];
  if (len < 1 || len > a.path.dim(0)) return Invalid("kv_commit: path_len ", len, " is outside [1, ", a.path.dim(0), "]");
  const int64_t start = a.start_on_device.present() ? a.start_on_device.as<const int32_t>()[0] : a.start;
  if (start < 0) return Invalid("kv_commit: startOnDevice holds ", start, ", a negative slot");
  // every cache's slots checked before any row moves: a refused commit leaves every cache as it was
  for (const Tensor& c : a.caches) {
    for (int32_t k = 0; k < len; ++k) {
      const int32_t src = a.path.as<const int32_t>()[k];
      if (src < k || start + src >= c.dim(0)) return Invalid("kv_commit: path[", k, "] = ", src, " is not a slot at or after ", k, " inside ", c.Describe(), " from start ", start);
    }
  }
  for (const Tensor& c : a.caches) {
    const int64_t row_bytes = c.dim(1) * DTypeSize(c.dtype);
    for (int32_t k = 0; k < len; ++k) {
      const int32_t src = a.path.as<const int32_t>()[k];
      std::memmove(c.as<char>() + (start + k) * row_bytes, c.as<const char>() + (start + src) * row_bytes, row_bytes);
    }
  }
  if (a.next_start.present()) a.next_start.as<int32_t>()[0] = static_cast<int32_t>(start + len);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
