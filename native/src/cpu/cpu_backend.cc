// The CPU twin of every kernel: the same semantics as the CUDA ops (cuda/*.cu), written plainly,
// multi-threaded over independent output rows. Each output element is one fixed-order sum, so
// results are batch-invariant and independent of the thread count.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <queue>
#include <set>
#include <thread>
#include <vector>

#include <unistd.h>

#include "../common/dispatch_policy.h"
#include "../common/half.h"
#include "../common/validate.h"
#include "kdtree/backend.h"
#include "gqa_attention.h"
#include "kdtree/w4a16_layout.h"
#include "thread_pool.h"

namespace kdtree {
namespace {

float LoadF(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return t.as<const float>()[i];
    case DType::kBF16: return Bf16ToF32(t.as<const uint16_t>()[i]);
    case DType::kF16: return F16ToF32(t.as<const uint16_t>()[i]);
    case DType::kF64: return static_cast<float>(t.as<const double>()[i]);
    default: return 0.f;
  }
}

// Row `row` of a 2-D f32 or bf16 tensor (a latent cache) as f32: the row itself, or its values
// widened into `scratch`.
const float* RowAsF32(const Tensor& t, int64_t row, std::vector<float>& scratch) {
  const int64_t w = t.dim(1);
  if (t.dtype == DType::kF32) return t.as<const float>() + row * w;
  scratch.resize(static_cast<size_t>(w));
  for (int64_t j = 0; j < w; ++j) scratch[j] = LoadF(t, row * w + j);
  return scratch.data();
}

std::vector<float> LoadAll(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = LoadF(t, i);
  return v;
}

void StoreF(const Tensor& t, int64_t i, float v) {
  switch (t.dtype) {
    case DType::kF32: t.as<float>()[i] = v; break;
    case DType::kBF16: t.as<uint16_t>()[i] = F32ToBf16(v); break;
    case DType::kF16: t.as<uint16_t>()[i] = F32ToF16(v); break;
    default: break;
  }
}

// v as a tensor of `dtype` holds it (rounded to nearest even for bf16 and f16).
float RoundTo(DType dtype, float v) {
  switch (dtype) {
    case DType::kBF16: return Bf16ToF32(F32ToBf16(v));
    case DType::kF16: return F16ToF32(F32ToF16(v));
    default: return v;
  }
}

// silu(g) * u as silu_mul computes it (the W4A16 SiLU epilogue too, on gate and up rounded to its
// output's dtype, so that fused and unfused give the same bits).
float SiluMulValue(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// One 16-row tile of a packed W4A16 matrix (w4a16_layout.h) back in row order: codes q = u - 8
// [16][K] and f32 scales [16][K/G]. Rows past N come out as zeros (the packing's padding).
struct W4Tile {
  std::vector<int8_t> q;
  std::vector<float> s;
};

void UnpackW4Tile(const int32_t* qwp, const Tensor& scp, int64_t sc_offset, int64_t k, int group, W4Tile* out) {
  const int64_t steps = w4::Steps(k), groups = k / group;
  out->q.assign(static_cast<size_t>(w4::kTileRows * k), 0);
  out->s.assign(static_cast<size_t>(w4::kTileRows * groups), 0.f);
  for (int64_t st = 0; st < steps; ++st) {
    for (int word = 0; word < w4::kWordsPerStep; ++word) {
      const uint32_t w = static_cast<uint32_t>(qwp[st * w4::kWordsPerStep + word]);
      const int row = w4::WordRow(word), t = w4::WordLaneT(word);
      for (int p = 0; p < 8; ++p) {
        const int64_t kk = st * w4::kStepK + 32 * w4::WordBlock(word) + w4::NibbleK(t, p);
        if (kk < k) out->q[row * k + kk] = static_cast<int8_t>(static_cast<int>((w >> (4 * p)) & 0xF) - 8);
      }
    }
  }
  for (int64_t b = 0; b < w4::ScaleBlocks(k, group); ++b) {
    for (int slot = 0; slot < w4::kScalesPerBlock; ++slot) {
      const int64_t grp = 4 * b + w4::ScaleGroup(slot);
      if (grp < groups) out->s[w4::ScaleRow(slot) * groups + grp] = LoadF(scp, sc_offset + b * w4::kScalesPerBlock + slot);
    }
  }
}

// dot(x_row, dequant(W row)) with the CUDA kernels' grouping: per group the f32 sum of x * q,
// then scaled; groups accumulate in f32, in order.
float W4Dot(const float* x, const int8_t* q, const float* scales, int64_t k, int group) {
  float acc = 0.f;
  for (int64_t g = 0; g < k / group; ++g) {
    float part = 0.f;
    for (int64_t j = g * group; j < (g + 1) * group; ++j) part += x[j] * static_cast<float>(q[j]);
    acc = std::fma(part, scales[g], acc);
  }
  return acc;
}

// dot(x, w) over k (a multiple of 8) in the order of the cuda bf16 MoE GEMM's warp (moe_bf16.cu):
// lane l sums chunks of 8 k, l, l + 32, ..., one FMA after another; the 32 lane sums meet in an
// xor butterfly. The same bits on both backends, and for a row whatever else is in the call.
float WarpOrderDot(const float* x, const float* w, int64_t k) {
  float lanes[32];
  for (int l = 0; l < 32; ++l) {
    float acc = 0.f;
    for (int64_t c = 8 * l; c < k; c += 8 * 32) {
      for (int j = 0; j < 8; ++j) acc = std::fma(x[c + j], w[c + j], acc);
    }
    lanes[l] = acc;
  }
  for (int off = 16; off > 0; off >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
    std::copy(next, next + 32, lanes);
  }
  return lanes[0];
}

// Checkpoint -> packed, one output word (or scale) at a time: a gather, so every padding slot is
// written too.
void PackW4(const W4A16PackArgs& a, ThreadPool& pool) {
  const int lead = a.qw.rank() - 2;
  const int64_t experts = lead ? a.qw.dim(0) : 1, n = a.qw.dim(lead), k = a.qw.dim(lead + 1) * 8, group = a.group;
  const int64_t tiles = w4::Tiles(n), steps = w4::Steps(k), blocks = w4::ScaleBlocks(k, a.group), groups = k / group;
  const int32_t* qw = a.qw.as<const int32_t>();
  int32_t* qwp = a.qw_packed.as<int32_t>();
  const int esize = DTypeSize(a.sc.dtype);
  pool.ParallelFor(experts * tiles, [&](int64_t begin, int64_t end) {
    for (int64_t et = begin; et < end; ++et) {
      const int64_t e = et / tiles, tile = et % tiles;
      for (int64_t st = 0; st < steps; ++st) {
        for (int word = 0; word < w4::kWordsPerStep; ++word) {
          const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::WordRow(word), n, a.gate_up);
          uint32_t v = 0;
          for (int p = 0; p < 8; ++p) {
            const int64_t kk = st * w4::kStepK + 32 * w4::WordBlock(word) + w4::NibbleK(w4::WordLaneT(word), p);
            uint32_t code = 8;
            if (row >= 0 && kk < k) code = (static_cast<uint32_t>(qw[(e * n + row) * (k / 8) + kk / 8]) >> (4 * (kk % 8))) & 0xF;
            v |= code << (4 * p);
          }
          qwp[(et * steps + st) * w4::kWordsPerStep + word] = static_cast<int32_t>(v);
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        for (int slot = 0; slot < w4::kScalesPerBlock; ++slot) {
          const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::ScaleRow(slot), n, a.gate_up), grp = 4 * b + w4::ScaleGroup(slot);
          char* dst = static_cast<char*>(a.sc_packed.data) + ((et * blocks + b) * w4::kScalesPerBlock + slot) * esize;
          if (row >= 0 && grp < groups) std::memcpy(dst, static_cast<const char*>(a.sc.data) + ((e * n + row) * groups + grp) * esize, esize);
          else std::memset(dst, 0, esize);
        }
      }
    }
  });
}

// Row `row` of y from the 16 rows of packed tile `ti` (rows past y's width dropped): as they are,
// or with the SiLU epilogue (a gate_up tile) y[row, 8 ti + r] = silu(rows[r]) * rows[8 + r].
void StoreTileRow(const Tensor& y, int64_t row, int64_t ti, const float* rows, bool silu) {
  const int64_t width = y.dim(1);
  if (!silu) {
    for (int r = 0; r < w4::kTileRows && ti * w4::kTileRows + r < width; ++r) StoreF(y, row * width + ti * w4::kTileRows + r, rows[r]);
    return;
  }
  for (int r = 0; r < 8 && ti * 8 + r < width; ++r) StoreF(y, row * width + ti * 8 + r, SiluMulValue(RoundTo(y.dtype, rows[r]), RoundTo(y.dtype, rows[8 + r])));
}

// A row's sum of squares in the cuda kernel's order (kRmsNormThreads, ops.h).
float RmsSumOfSquares(const float* x, int64_t h) {
  float part[kRmsNormThreads];
  const int64_t chunks = (h + 3) / 4;
  for (int t = 0; t < kRmsNormThreads; ++t) {
    float ss = 0.f;
    for (int64_t c = t; c < chunks; c += kRmsNormThreads) {
      for (int64_t j = 4 * c; j < std::min(4 * c + 4, h); ++j) ss = std::fma(x[j], x[j], ss);
    }
    part[t] = ss;
  }
  float total = 0.f;
  for (int w = 0; w < kRmsNormThreads / 32; ++w) {
    float* lanes = part + 32 * w;
    for (int off = 16; off > 0; off >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
      std::copy(next, next + 32, lanes);
    }
    total += lanes[0];
  }
  return total;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend() : pool_(std::max(1u, std::thread::hardware_concurrency())) {}
  const char* kind() const override { return "cpu"; }
  DeviceInfo info() const override {
    DeviceInfo d;
    d.name = "cpu (" + std::to_string(pool_.size()) + " threads)";
    d.multiprocessors = static_cast<int>(pool_.size());
    return d;
  }

  Status Alloc(size_t bytes, void** ptr) override {
    *ptr = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
    if (*ptr == nullptr) return MakeStatus(Code::kOutOfMemory, "cpu: cannot allocate ", bytes, " bytes");
    return Status::Ok();
  }
  Status Free(void* ptr) override {
    std::free(ptr);
    return Status::Ok();
  }
  Status AllocHost(size_t bytes, void** ptr) override { return Alloc(bytes, ptr); }
  Status FreeHost(void* ptr) override { return Free(ptr); }
  Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    return Copy(dst, src, bytes);
  }
  // The host's memory: MemAvailable and MemTotal of /proc/meminfo (what the kernel could hand out
  // without swapping), else the free and total physical pages.
  Status MemoryInfo(int64_t* free, int64_t* total) override {
    *free = *total = -1;
    if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
      char key[64];
      long long kib = 0;
      while (std::fscanf(f, "%63s %lld kB", key, &kib) == 2) {
        if (std::strcmp(key, "MemTotal:") == 0) *total = kib * 1024;
        if (std::strcmp(key, "MemAvailable:") == 0) *free = kib * 1024;
      }
      std::fclose(f);
    }
    const int64_t page = sysconf(_SC_PAGESIZE);
    if (*total < 0) *total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page;
    if (*free < 0) *free = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
    if (*total <= 0 || *free < 0) return MakeStatus(Code::kDeviceError, "cpu: the host's memory could not be read (/proc/meminfo, sysconf)");
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status CopyToHost(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status Fill(void* dst, uint8_t value, size_t bytes, int) override {
    std::memset(dst, value, bytes);
    return Status::Ok();
  }
  Status Hold(int64_t, int stream) override { return CheckStream(stream); }  // ops here are synchronous: nothing queues
  Status CreateStream(int* stream) override {
    *stream = next_stream_++;
    streams_.insert(*stream);
    return Status::Ok();
  }
  Status DestroyStream(int stream) override {
    if (stream == 0 || streams_.count(stream) == 0) return Invalid("destroy_stream: unknown stream ", stream);
    if (recording_.count(stream)) return Invalid("destroy_stream: stream ", stream, " is capturing; end the capture first");
    streams_.erase(stream);
    return Status::Ok();
  }
  Status Synchronize(int stream) override { return stream < 0 ? Status::Ok() : CheckStream(stream); }
  Status CheckStream(int stream) override {
    if (stream != 0 && streams_.count(stream) == 0) return Invalid("unknown stream ", stream, " (create it with createStream())");
    return Status::Ok();
  }
  Status CreateEvent(int* event) override {
    *event = next_event_++;
    events_[*event] = kNeverRecorded;
    return Status::Ok();
  }
  Status DestroyEvent(int event) override {
    if (events_.erase(event) == 0) return Invalid("destroy_event: unknown event ", event);
    return Status::Ok();
  }
  Status RecordEvent(int event, int stream) override {
    if (!events_.count(event)) return Invalid("record_event: unknown event ", event);
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    events_[event] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return Status::Ok();
  }
  Status ElapsedMs(int start, int end, float* ms) override {
    for (const int e : {start, end}) {
      auto it = events_.find(e);
      if (it == events_.end()) return Invalid("elapsed_ms: unknown event ", e);
      if (it->second == kNeverRecorded) return Invalid("elapsed_ms: event ", e, " was never recorded (recordEvent first)");
    }
    *ms = static_cast<float>(events_[end] - events_[start]);
    return Status::Ok();
  }

  Status WaitEvent(int event, int stream) override {  // ops here are synchronous: nothing to wait for
    if (!events_.count(event)) return Invalid("wait_event: unknown event ", event);
    return CheckStream(stream);
  }

  // A graph is the op calls of its capture, replayed in order on the calling thread.
  Status BeginCapture(int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    if (stream == 0) return Invalid("begin_capture: stream 0 (the default stream) cannot be captured; capture a stream from createStream()");
    if (!recording_.emplace(stream, std::vector<std::function<Status()>>{}).second) return Invalid("begin_capture: stream ", stream, " is already capturing");
    return Status::Ok();
  }
  Status EndCapture(int stream, int* graph) override {
    auto it = recording_.find(stream);
    if (it == recording_.end()) return Invalid("end_capture: stream ", stream, " is not capturing");
    *graph = next_graph_++;
    graphs_[*graph] = std::move(it->second);
    recording_.erase(it);
    return Status::Ok();
  }
  bool RecordsCalls() const override { return true; }
  Status RecordCall(int stream, std::function<Status()> call) override {
    auto it = recording_.find(stream);
    if (it == recording_.end()) return Invalid("record: stream ", stream, " is not capturing");
    it->second.push_back(std::move(call));
    return Status::Ok();
  }
  Status LaunchGraph(int graph, int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) return Invalid("launch_graph: unknown graph ", graph);
    const std::vector<std::function<Status()>>& calls = it->second;
    for (size_t i = 0; i < calls.size(); ++i) {
      const Status s = calls[i]();
      if (!s.ok()) return MakeStatus(s.code, "graph ", graph, ", call ", i + 1, " of ", calls.size(), ": ", s.message);
    }
    return Status::Ok();
  }
  Status DestroyGraph(int graph) override {
    if (graphs_.erase(graph) == 0) return Invalid("destroy_graph: unknown graph ", graph);
    return Status::Ok();
  }

  Status W4A16Pack(const W4A16PackArgs& a, int) override {
    PackW4(a, pool_);
    return Status::Ok();
  }

  Status SetForcedForms(const char* gemm, const char* w4a16_prefill) override {
    policy::ForcedForms f;
    KDTREE_RETURN_IF_ERROR(policy::ParseGemmForm(gemm, &f.gemm));
    return policy::ParsePrefillOverride(w4a16_prefill, &f.w4a16_prefill);
  }
  const char* LastForm() const override { return last_form_; }

  Status W4A16Gemm(const W4A16GemmArgs& a, int) override {
    last_form_ = "cpu";
    const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.y.dim(1);
    const bool silu = a.epilogue == Epilogue::kSiluMul;
    const std::vector<float> x = LoadAll(a.x);
    pool_.ParallelFor(w4::Tiles(WeightRows(a.y, a.epilogue)), [&](int64_t b, int64_t e) {
      W4Tile tile;
      float rows[w4::kTileRows];
      for (int64_t ti = b; ti < e; ++ti) {
        UnpackW4Tile(a.qw.as<const int32_t>() + ti * w4::Steps(k) * w4::kWordsPerStep, a.sc, ti * w4::ScaleBlocks(k, a.group) * w4::kScalesPerBlock, k, a.group, &tile);
        for (int64_t row = 0; row < m; ++row) {
          for (int r = 0; r < w4::kTileRows; ++r) rows[r] = W4Dot(&x[row * k], &tile.q[r * k], &tile.s[r * (k / a.group)], k, a.group);
          StoreTileRow(a.y, row, ti, rows, silu);
        }
      }
    });
    return Status::Ok();
  }

  // Each output is one f32 dot product in a fixed order (8 interleaved partial sums, K being a
  // multiple of 8, added pairwise), whatever M is: batch-invariant like the CUDA kernel, though not
  // its bits (a tensor core's sum of products is its own).
  Status Gemm(const GemmArgs& a, int) override {
    last_form_ = "cpu";
    const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(0);
    const std::vector<float> x = LoadAll(a.x);
    pool_.ParallelFor(n, [&](int64_t begin, int64_t end) {
      std::vector<float> w(static_cast<size_t>(k));
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t i = 0; i < k; ++i) w[i] = LoadF(a.w, row * k + i);
        for (int64_t r = 0; r < m; ++r) {
          const float* xr = &x[r * k];
          float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (int64_t i = 0; i < k; i += 8) {
            for (int j = 0; j < 8; ++j) s[j] = std::fma(xr[i + j], w[i + j], s[j]);
          }
          StoreF(a.y, r * n + row, ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
        }
      }
    }, std::max<int64_t>(1, 4096 / k));  // rows per chunk: ~4K weights at least (K > 0 is validated)
    return Status::Ok();
  }

  // ids[t, j] in [0, experts): the cuda kernels skip the others, the twin rejects them.
  static Status CheckExpertIds(const Tensor& ids, int64_t experts) {
    const int64_t pairs = ids.numel(), topk = ids.dim(1);
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t id = ids.as<const int32_t>()[i];
      if (id < 0 || id >= experts) return Invalid("moe_gemm: ids[", i / topk, ", ", i % topk, "] = ", id, " is not an expert in [0, ", experts, ")");
    }
    return Status::Ok();
  }

  // bf16 experts as stored: every (pair, row) one WarpOrderDot; each used expert's row widened
  // once per call.
  Status MoeGemmBf16(const MoeGemmArgs& a) {
    const int64_t experts = a.w.dim(0), n = a.w.dim(1), k = a.x.dim(1), t = a.ids.dim(0), topk = a.ids.dim(1), pairs = t * topk;
    KDTREE_RETURN_IF_ERROR(CheckExpertIds(a.ids, experts));
    const std::vector<float> x = LoadAll(a.x);
    const int32_t* ids = a.ids.as<const int32_t>();
    std::map<int64_t, std::vector<int64_t>> pairs_of;  // expert -> its (token, slot) pairs
    for (int64_t p = 0; p < pairs; ++p) pairs_of[ids[p]].push_back(p);
    std::vector<float> out(static_cast<size_t>(pairs * n));  // [pair][weight row], f32
    pool_.ParallelFor(n, [&](int64_t begin, int64_t end) {
      std::vector<float> w(static_cast<size_t>(k));
      for (int64_t row = begin; row < end; ++row) {
        for (const auto& [e, expert_pairs] : pairs_of) {
          for (int64_t i = 0; i < k; ++i) w[i] = LoadF(a.w, (e * n + row) * k + i);
          for (const int64_t p : expert_pairs) out[p * n + row] = WarpOrderDot(&x[(a.mode == MoeMode::kGather ? p / topk : p) * k], w.data(), k);
        }
      }
    }, std::max<int64_t>(1, 4096 / k));
    const int64_t cols = a.y.dim(1);
    if (a.mode == MoeMode::kSum) {
      for (int64_t tok = 0; tok < t; ++tok) {
        for (int64_t col = 0; col < cols; ++col) {
          float acc = 0.f;
          for (int64_t j = 0; j < topk; ++j) acc = std::fma(a.weights.as<const float>()[tok * topk + j], out[(tok * topk + j) * n + col], acc);
          StoreF(a.y, tok * cols + col, acc);
        }
      }
    } else if (a.epilogue == Epilogue::kSiluMul) {  // rows [gate; up]: column j from rows j and I + j
      for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t j = 0; j < cols; ++j) StoreF(a.y, p * cols + j, SiluMulValue(RoundTo(a.y.dtype, out[p * n + j]), RoundTo(a.y.dtype, out[p * n + cols + j])));
      }
    } else {
      for (int64_t i = 0; i < pairs * n; ++i) StoreF(a.y, i, out[i]);
    }
    return Status::Ok();
  }

  Status MoeGemm(const MoeGemmArgs& a, int) override {
    last_form_ = "cpu";
    if (a.w.present()) return MoeGemmBf16(a);
    const int64_t e_count = a.qw.dim(0), k = a.x.dim(1), t = a.ids.dim(0), topk = a.ids.dim(1);
    const bool silu = a.epilogue == Epilogue::kSiluMul;
    const int64_t n = WeightRows(a.y, a.epilogue);
    const int32_t* ids = a.ids.as<const int32_t>();
    KDTREE_RETURN_IF_ERROR(CheckExpertIds(a.ids, e_count));
    const std::vector<float> x = LoadAll(a.x);
    const int64_t tiles = w4::Tiles(n), q_tile = w4::Steps(k) * w4::kWordsPerStep, s_tile = w4::ScaleBlocks(k, a.group) * w4::kScalesPerBlock;
    const int64_t pairs = t * topk, groups = k / a.group;
    std::map<int64_t, std::vector<int64_t>> pairs_of;  // expert -> its (token, slot) pairs, in order
    for (int64_t p = 0; p < pairs; ++p) pairs_of[ids[p]].push_back(p);
    pool_.ParallelFor(tiles, [&](int64_t b, int64_t end) {
      W4Tile tile;
      std::vector<float> out(static_cast<size_t>(pairs * w4::kTileRows));  // [pair][row in tile]
      for (int64_t ti = b; ti < end; ++ti) {
        const int rows = silu ? w4::kTileRows : static_cast<int>(std::min<int64_t>(w4::kTileRows, n - ti * w4::kTileRows));
        for (const auto& [e, expert_pairs] : pairs_of) {  // each used expert's tile unpacked once
          UnpackW4Tile(a.qw.as<const int32_t>() + (e * tiles + ti) * q_tile, a.sc, (e * tiles + ti) * s_tile, k, a.group, &tile);
          for (const int64_t p : expert_pairs) {
            const float* xr = &x[(a.mode == MoeMode::kGather ? p / topk : p) * k];
            for (int r = 0; r < rows; ++r) out[p * w4::kTileRows + r] = W4Dot(xr, &tile.q[r * k], &tile.s[r * groups], k, a.group);
          }
        }
        if (a.mode == MoeMode::kGather) {
          for (int64_t p = 0; p < pairs; ++p) StoreTileRow(a.y, p, ti, &out[p * w4::kTileRows], silu);
          continue;
        }
        for (int r = 0; r < rows; ++r) {
          const int64_t col = ti * w4::kTileRows + r;
          for (int64_t tok = 0; tok < t; ++tok) {
            float acc = 0.f;
            for (int64_t j = 0; j < topk; ++j) acc = std::fma(a.weights.as<const float>()[tok * topk + j], out[(tok * topk + j) * w4::kTileRows + r], acc);
            StoreF(a.y, tok * n + col, acc);
          }
        }
      }
    });
    return Status::Ok();
  }

  Status MlaAttention(const MlaAttentionArgs& a, int) override {
    int64_t base = a.base;
    if (a.base_on_device.present()) {
      base = a.base_on_device.as<const int32_t>()[0];
      if (base < 0 || base > a.base) return Invalid("mla_attention: baseOnDevice holds ", base, ", outside [0, base = ", a.base, "] (base bounds it)");
    }
    const int64_t t = a.q_nope.dim(0), h = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
    const int64_t r = a.cache_c.dim(1), dv = a.out.dim(2);
    const bool masked = a.mask.present();
    pool_.ParallelFor(t * h, [&](int64_t b, int64_t e) {
      std::vector<float> q_lat(static_cast<size_t>(r)), ctx(static_cast<size_t>(r)), scores, c_row, kpe_row;
      std::vector<int64_t> keys;
      for (int64_t item = b; item < e; ++item) {
        const int64_t ti = item / h, hi = item % h;
        const float* qn = a.q_nope.as<const float>() + (ti * h + hi) * dn;
        const float* qp = a.q_pe.as<const float>() + (ti * h + hi) * dr;
        const int64_t kb = hi * (dn + dv);  // this head's rows of kv_b: [dn rows of W_kb, dv rows of W_vb]
        for (int64_t j = 0; j < r; ++j) {
          float s = 0.f;
          for (int64_t i = 0; i < dn; ++i) s = std::fma(qn[i], LoadF(a.kv_b, (kb + i) * r + j), s);
          q_lat[j] = s;
        }
        keys.clear();
        for (int64_t s = 0; s < base; ++s) keys.push_back(s);
        for (int64_t j = 0; j < t; ++j) {
          if (masked ? a.mask.as<const uint8_t>()[ti * t + j] != 0 : j <= ti) keys.push_back(base + j);
        }
        scores.assign(keys.size(), 0.f);
        float mx = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* c = RowAsF32(a.cache_c, keys[i], c_row);
          const float* kp = RowAsF32(a.cache_kpe, keys[i], kpe_row);
          float s = 0.f;
          for (int64_t j = 0; j < r; ++j) s = std::fma(q_lat[j], c[j], s);
          for (int64_t j = 0; j < dr; ++j) s = std::fma(qp[j], kp[j], s);
          scores[i] = s * static_cast<float>(a.scale);
          mx = std::max(mx, scores[i]);
        }
        float sum = 0.f;
        for (float& s : scores) sum += (s = std::exp(s - mx));
        std::fill(ctx.begin(), ctx.end(), 0.f);
        for (size_t i = 0; i < keys.size(); ++i) {
          const float p = scores[i] / sum;
          const float* c = RowAsF32(a.cache_c, keys[i], c_row);
          for (int64_t j = 0; j < r; ++j) ctx[j] = std::fma(p, c[j], ctx[j]);
        }
        const int64_t out = (ti * h + hi) * dv;
        for (int64_t v = 0; v < dv; ++v) {
          float s = 0.f;
          for (int64_t j = 0; j < r; ++j) s = std::fma(LoadF(a.kv_b, (kb + dn + v) * r + j), ctx[j], s);
          StoreF(a.out, out + v, s);
        }
      }
    });
    return Status::Ok();
  }

  Status Embedding(const EmbeddingArgs& a, int) override {
    const int64_t v = a.table.dim(0), hdim = a.table.dim(1);
    for (int64_t i = 0; i < a.ids.dim(0); ++i) {
      const int32_t id = a.ids.as<const int32_t>()[i];
      if (id < 0 || id >= v) return Invalid("embedding: ids[", i, "] = ", id, " is outside the table's ", v, " rows");
      for (int64_t j = 0; j < hdim; ++j) a.out.as<float>()[i * hdim + j] = LoadF(a.table, id * hdim + j);
    }
    return Status::Ok();
  }

  Status RmsNorm(const RmsNormArgs& a, int) override {
    const int64_t rows = a.x.dim(0), hdim = a.x.dim(1);
    pool_.ParallelFor(rows, [&](int64_t b, int64_t e) {
      std::vector<float> sum;
      for (int64_t r = b; r < e; ++r) {
        const float* x = a.x.as<const float>() + r * hdim;
        if (a.residual.present()) {  // the fused residual add: x + residual, also stored to `sum`
          const float* res = a.residual.as<const float>() + r * hdim;
          sum.resize(static_cast<size_t>(hdim));
          for (int64_t j = 0; j < hdim; ++j) sum[j] = x[j] + res[j];
          std::copy(sum.begin(), sum.end(), a.sum.as<float>() + r * hdim);
          x = sum.data();
        }
        const float inv = 1.f / std::sqrt(RmsSumOfSquares(x, hdim) / static_cast<float>(hdim) + static_cast<float>(a.eps));
        for (int64_t j = 0; j < hdim; ++j) {
          const float y = x[j] * inv * LoadF(a.weight, j);
          StoreF(a.out, r * hdim + j, y);
          if (a.out_bf16.present()) StoreF(a.out_bf16, r * hdim + j, y);
        }
      }
    });
    return Status::Ok();
  }

  Status Rope(const RopeArgs& a, int) override {
    const int64_t t = a.x.dim(0), heads = a.x.dim(1), hd = a.x.dim(2), half = a.inv_freq.dim(0);
    for (int64_t ti = 0; ti < t; ++ti) {
      const double pos = a.positions.as<const int32_t>()[ti];
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * a.inv_freq.as<const double>()[i];
        const double c = std::cos(angle) * a.attention_factor, s = std::sin(angle) * a.attention_factor;
        for (int64_t hh = 0; hh < heads; ++hh) {
          float* x = a.x.as<float>() + (ti * heads + hh) * hd + a.offset;
          const int64_t i0 = a.interleave ? 2 * i : i, i1 = a.interleave ? 2 * i + 1 : i + half;
          const double x0 = x[i0], x1 = x[i1];
          x[i0] = static_cast<float>(x0 * c - x1 * s);
          x[i1] = static_cast<float>(x1 * c + x0 * s);
        }
      }
    }
    return Status::Ok();
  }

  Status GqaAttention(const GqaAttentionArgs& a, int) override { return CpuGqaAttention(a, pool_); }  // gqa_attention.cc

  Status SiluMul(const SiluMulArgs& a, int) override {
    const int64_t t = a.out.dim(0), inter = a.out.dim(1);
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t j = 0; j < inter; ++j) {
        StoreF(a.out, r * inter + j, SiluMulValue(LoadF(a.x, r * 2 * inter + j), LoadF(a.x, r * 2 * inter + inter + j)));
      }
    }
    return Status::Ok();
  }

  Status Add(const AddArgs& a, int) override {
    for (int64_t i = 0; i < a.a.numel(); ++i) a.out.as<float>()[i] = a.a.as<const float>()[i] + a.b.as<const float>()[i];
    return Status::Ok();
  }

  Status Router(const RouterArgs& a, int) override {
    const int64_t t = a.logits.dim(0), e = a.logits.dim(1), per = e / a.n_group;
    std::vector<float> scores(static_cast<size_t>(e)), choice(static_cast<size_t>(e));
    std::vector<int> order(static_cast<size_t>(e));
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t i = 0; i < e; ++i) {
        scores[i] = 1.f / (1.f + std::exp(-a.logits.as<const float>()[r * e + i]));
        choice[i] = scores[i] + a.bias.as<const float>()[i];
      }
      std::vector<char> allowed(static_cast<size_t>(e), 1);
      if (a.n_group > 1) {
        std::vector<float> gscore(static_cast<size_t>(a.n_group));
        for (int g = 0; g < a.n_group; ++g) {
          float b1 = -INFINITY, b2 = -INFINITY;
          for (int64_t i = g * per; i < (g + 1) * per; ++i) {
            if (choice[i] > b1) { b2 = b1; b1 = choice[i]; } else if (choice[i] > b2) b2 = choice[i];
          }
          gscore[g] = b1 + b2;
        }
        std::vector<int> gorder(static_cast<size_t>(a.n_group));
        std::iota(gorder.begin(), gorder.end(), 0);
        std::stable_sort(gorder.begin(), gorder.end(), [&](int x, int y) { return gscore[x] > gscore[y]; });
        std::fill(allowed.begin(), allowed.end(), 0);
        for (int g = 0; g < a.topk_group; ++g) std::fill(allowed.begin() + gorder[g] * per, allowed.begin() + (gorder[g] + 1) * per, 1);
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
        if (allowed[x] != allowed[y]) return allowed[x] > allowed[y];
        return choice[x] > choice[y];
      });
      std::vector<int> chosen(order.begin(), order.begin() + a.topk);
      std::sort(chosen.begin(), chosen.end());
      float sum = 0.f;
      for (int c : chosen) sum += scores[c];
      for (int j = 0; j < a.topk; ++j) {
        float w = scores[chosen[j]];
        if (a.norm_topk_prob) w = w / (sum + 1e-20f);
        a.ids.as<int32_t>()[r * a.topk + j] = chosen[j];
        a.weights.as<float>()[r * a.topk + j] = w * static_cast<float>(a.scaling);
      }
    }
    return Status::Ok();
  }

  Status Argmax(const ArgmaxArgs& a, int) override {
    const int64_t t = a.x.dim(0), v = a.x.dim(1);
    for (int64_t r = 0; r < t; ++r) {
      const float* x = a.x.as<const float>() + r * v;
      int64_t best = 0;
      for (int64_t i = 1; i < v; ++i) if (x[i] > x[best]) best = i;
      a.out.as<int32_t>()[r] = static_cast<int32_t>(best);
    }
    return Status::Ok();
  }

  Status Topk(const TopkArgs& a, int) override {
    const int64_t t = a.x.dim(0), v = a.x.dim(1);
    std::vector<int> order(static_cast<size_t>(v));
    for (int64_t r = 0; r < t; ++r) {
      const float* x = a.x.as<const float>() + r * v;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + a.k, order.end(), [&](int p, int q) { return x[p] > x[q] || (x[p] == x[q] && p < q); });
      for (int j = 0; j < a.k; ++j) {
        a.values.as<float>()[r * a.k + j] = x[order[j]];
        a.ids.as<int32_t>()[r * a.k + j] = order[j];
      }
    }
    return Status::Ok();
  }

  Status KvWrite(const KvWriteArgs& a, int) override {
    const int64_t t = a.c.dim(0), r = a.c.dim(1), dr = a.kpe.dim(1), s = a.cache_c.dim(0);
    for (int64_t i = 0; i < t; ++i) {
      const int32_t slot = a.slots.as<const int32_t>()[i];
      if (slot < 0 || slot >= s) return Invalid("kv_write: slots[", i, "] = ", slot, " is outside the cache's ", s, " slots");
      for (int64_t j = 0; j < r; ++j) StoreF(a.cache_c, slot * r + j, a.c.as<const float>()[i * r + j]);
      for (int64_t j = 0; j < dr; ++j) StoreF(a.cache_kpe, slot * dr + j, a.kpe.as<const float>()[i * dr + j]);
    }
    return Status::Ok();
  }

  Status DdtreeBuild(const DdtreeBuildArgs& a, int) override {
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

  Status DdtreeAccept(const DdtreeAcceptArgs& a, int) override {
    const int32_t size = a.size.as<const int32_t>()[0];
    if (size < 1 || size > a.tokens.dim(0) || size > a.target_argmax.dim(0)) return Invalid("ddtree_accept: size ", size, " is outside [1, ", a.tokens.dim(0), "]");
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

  Status KvCommit(const KvCommitArgs& a, int) override {
    const int32_t len = a.path_len.as<const int32_t>()[0];
    if (len < 1 || len > a.path.dim(0)) return Invalid("kv_commit: path_len ", len, " is outside [1, ", a.path.dim(0), "]");
    const int64_t start = a.start_on_device.present() ? a.start_on_device.as<const int32_t>()[0] : a.start;
    if (start < 0) return Invalid("kv_commit: startOnDevice holds ", start, ", a negative slot");
    for (const Tensor& c : a.caches) {
      const int64_t row_bytes = c.dim(1) * DTypeSize(c.dtype);
      for (int32_t k = 0; k < len; ++k) {
        const int32_t src = a.path.as<const int32_t>()[k];
        if (src < k || start + src >= c.dim(0)) return Invalid("kv_commit: path[", k, "] = ", src, " is not a slot at or after ", k, " inside ", c.Describe(), " from start ", start);
        std::memmove(c.as<char>() + (start + k) * row_bytes, c.as<const char>() + (start + src) * row_bytes, row_bytes);
      }
    }
    if (a.next_start.present()) a.next_start.as<int32_t>()[0] = static_cast<int32_t>(start + len);
    return Status::Ok();
  }

  Status Arange(const ArangeArgs& a, int) override {
    const int64_t start = a.start + (a.start_on_device.present() ? a.start_on_device.as<const int32_t>()[0] : 0);  // read before out is written: they may be one
    for (int64_t i = 0; i < a.out.dim(0); ++i) a.out.as<int32_t>()[i] = static_cast<int32_t>(start + i);
    return Status::Ok();
  }

 private:
  static Status Copy(void* dst, const void* src, size_t bytes) {
    std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  ThreadPool pool_;
  const char* last_form_ = nullptr;  // LastForm()
  int next_stream_ = 1, next_event_ = 1;
  std::set<int> streams_;
  static constexpr double kNeverRecorded = -1;  // an event's time before its first record
  std::map<int, double> events_;  // event -> the steady-clock ms of its last record
  int next_graph_ = 1;
  std::map<int, std::vector<std::function<Status()>>> recording_;  // capturing stream -> its calls so far
  std::map<int, std::vector<std::function<Status()>>> graphs_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace kdtree
