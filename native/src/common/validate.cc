#include "validate.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <tuple>

#include "kdtree/w4a16_layout.h"

namespace kdtree {

std::string Tensor::Describe() const {
  if (!present()) return name + ": none";
  std::ostringstream os;
  os << name << ": " << DTypeName(dtype) << " [";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

namespace {

// "op(x: bf16 [3, 64], qw: i32 [16, 8]): " (optional arguments only when given), written only when
// a message needs it: every call is validated and few fail, and formatting it up front cost ~0.4 us
// per tensor of every call.
class OpContext {
 public:
  template <typename... Ts>
  explicit OpContext(const char* op, const Ts&... tensors) : op_(op), count_(sizeof...(Ts)), tensors_{&tensors...} {
    static_assert(sizeof...(Ts) <= kMaxTensors, "OpContext holds up to kMaxTensors tensors");
  }
  friend std::ostream& operator<<(std::ostream& os, const OpContext& c) {
    os << c.op_ << "(";
    bool first = true;
    for (size_t i = 0; i < c.count_; ++i) {
      if (!c.tensors_[i]->present()) continue;  // optional arguments not given
      os << (first ? "" : ", ") << c.tensors_[i]->Describe();
      first = false;
    }
    return os << "): ";
  }

 private:
  static constexpr size_t kMaxTensors = 10;
  const char* op_;
  size_t count_;
  const Tensor* tensors_[kMaxTensors];
};

Status CheckTensor(const OpContext& ctx, const Tensor& t, std::initializer_list<DType> allowed, int rank) {
  bool ok = false;
  for (DType d : allowed) ok = ok || d == t.dtype;
  if (!ok) {
    std::string names;
    for (DType d : allowed) names += names.empty() ? DTypeName(d) : std::string(" or ") + DTypeName(d);
    return Invalid(ctx, t.name, " must be ", names, ", got ", DTypeName(t.dtype));
  }
  if (rank >= 0 && t.rank() != rank) return Invalid(ctx, t.name, " must have ", rank, " dimensions, got ", t.rank());
  for (int64_t d : t.shape) {
    if (d < 0) return Invalid(ctx, t.name, " has a negative dimension");
  }
  if (t.data == nullptr && t.numel() > 0) return Invalid(ctx, t.name, " has no buffer");
  // buffers start aligned, so this is the offset's alignment: a misaligned element load faults on
  // the device (and leaves the context unusable) and is undefined behaviour on the host
  const int size = DTypeSize(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % size != 0) return Invalid(ctx, t.name, " must start at a multiple of its ", size, "-byte elements (its offset into the buffer)");
  const int64_t need = t.numel() * size;
  if (need > t.bytes) return Invalid(ctx, t.name, " needs ", need, " bytes but its buffer holds ", t.bytes, " from its offset");
  return Status::Ok();
}

// An optional i32 [1] a kernel reads on the device (a committed length, a token).
Status CheckDeviceScalar(const OpContext& ctx, const Tensor& t) {
  if (!t.present()) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, t, {DType::kI32}, 1));
  if (t.dim(0) != 1) return Invalid(ctx, t.name, " must be [1], got [", t.dim(0), "]");
  return Status::Ok();
}

// The packed layout's dimensions for an N x K matrix (w4a16_layout.h).
Status CheckPacked(const OpContext& ctx, const Tensor& qw, const Tensor& sc, int lead, int64_t experts, int64_t n, int64_t k, int group) {
  const int64_t tiles = w4::Tiles(n), steps = w4::Steps(k), blocks = w4::ScaleBlocks(k, group);
  const auto e = [&] { return lead ? std::to_string(experts) + ", " : std::string(); };
  const bool q_ok = qw.dim(lead) == tiles && qw.dim(lead + 1) == steps && qw.dim(lead + 2) == w4::kWordsPerStep && (!lead || qw.dim(0) == experts);
  if (!q_ok) {
    return Invalid(ctx, qw.name, " must be the packed layout [", lead ? "E, " : "", "N/16, K/128, 256] = [", e(), tiles, ", ", steps, ", ", w4::kWordsPerStep, "] for N = ", n, ", K = ", k,
                   " (pack checkpoint weights with w4a16Pack)");
  }
  const bool s_ok = sc.dim(lead) == tiles && sc.dim(lead + 1) == blocks && sc.dim(lead + 2) == w4::kScalesPerBlock && (!lead || sc.dim(0) == experts);
  if (!s_ok) {
    return Invalid(ctx, sc.name, " must be the packed layout [", lead ? "E, " : "", "N/16, K/(4G), 64] = [", e(), tiles, ", ", blocks, ", ", w4::kScalesPerBlock, "] for N = ", n, ", K = ", k, ", G = ", group);
  }
  return Status::Ok();
}

// Checkpoint weights handed to a GEMM: say what to do instead of "wrong rank".
Status NotCheckpoint(const OpContext& ctx, const Tensor& qw, int checkpoint_rank) {
  if (qw.rank() != checkpoint_rank) return Status::Ok();
  std::ostringstream shape;
  for (int i = 0; i < qw.rank(); ++i) shape << (i ? ", " : "") << qw.dim(i);
  return Invalid(ctx, qw.name, " is in the checkpoint layout [", shape.str(), "]: pack it first (w4a16Pack, or KdtreeBackend.packW4A16)");
}

Status CheckGroup(const OpContext& ctx, int64_t k, int group) {
  if (group != 32 && group != 64 && group != 128) return Invalid(ctx, "group size ", group, " is not 32, 64 or 128");
  if (k % 8 != 0 || k % group != 0) return Invalid(ctx, "K = ", k, " must be a multiple of 8 and of the group size ", group);
  return Status::Ok();
}

// qw and sc against what w4a16Pack recorded for them (when it did): the same pack, of `experts`
// matrices (0: one) with N = n, K = k and this group, rows in the order the epilogue reads.
Status CheckPackedInfo(const OpContext& ctx, const Tensor& qw, const Tensor& sc, const PackedWeightInfo& qi, const PackedWeightInfo& si, int64_t experts, int64_t n, int64_t k, int group, Epilogue epilogue,
                       const char* x_name) {
  const auto describe = [](const PackedWeightInfo& p) {
    std::ostringstream os;
    os << "N = " << p.n << ", K = " << p.k << ", G = " << p.group;
    if (p.experts > 0) os << ", E = " << p.experts;
    if (p.gate_up) os << ", interleaveGateUp";
    return os.str();
  };
  for (const auto& [t, info, want_scales] : {std::tuple{&qw, &qi, false}, std::tuple{&sc, &si, true}}) {
    if (!info->known) continue;
    if (info->scales != want_scales) return Invalid(ctx, t->name, " holds the packed ", info->scales ? "scales (scPacked)" : "codes (qwPacked)", " of a w4a16Pack: pass qwPacked as qw and scPacked as sc");
    const std::string packed = std::string(t->name) + " was packed by w4a16Pack for " + describe(*info);
    if ((info->experts > 0) != (experts > 0)) return Invalid(ctx, packed, experts > 0 ? ": one matrix, not experts [E, N, K]" : ": experts [E, N, K], not one matrix");
    if (info->k != k) return Invalid(ctx, packed, ", but ", x_name, " has K = ", k);
    // gate_up rows without the epilogue: y takes them in their interleaved order, padding included
    const bool interleaved = info->gate_up && epilogue == Epilogue::kNone;
    const int64_t rows = interleaved ? w4::Tiles(info->n) * w4::kTileRows : info->n;
    if (rows != n) {
      if (epilogue == Epilogue::kSiluMul) return Invalid(ctx, packed, ", but y's ", n / 2, " columns need ", n, " gate_up rows (y must be [M, ", info->n / 2, "])");
      if (interleaved) return Invalid(ctx, packed, ", so without the siluMul epilogue y must have ", rows, " columns (its rows in the interleaved order, padding included), got ", n);
      return Invalid(ctx, packed, ", but y has N = ", n);
    }
    if (info->group != group) return Invalid(ctx, packed, ", but the call says group ", group);
    if (info->experts != experts) return Invalid(ctx, packed, ", but the call has E = ", experts);
    if (epilogue == Epilogue::kSiluMul && !info->gate_up) return Invalid(ctx, packed, " without interleaveGateUp: the siluMul epilogue needs gate_up rows packed with interleaveGateUp");
  }
  if (qi.known && si.known && (qi.n != si.n || qi.k != si.k || qi.group != si.group || qi.experts != si.experts || qi.gate_up != si.gate_up)) {
    return Invalid(ctx, "qw was packed for ", describe(qi), " but sc for ", describe(si), ": pass the qw and sc of one w4a16Pack");
  }
  return Status::Ok();
}

}  // namespace

PackedWeightInfo PackedWeightInfoOf(const W4A16PackArgs& a) {
  const int lead = a.qw.rank() - 2;
  PackedWeightInfo p;
  p.known = true;
  p.experts = lead ? a.qw.dim(0) : 0;
  p.n = a.qw.dim(lead);
  p.k = a.qw.dim(lead + 1) * 8;
  p.group = a.group;
  p.gate_up = a.gate_up;
  return p;
}

Status ValidateW4A16Pack(const W4A16PackArgs& a) {
  const OpContext ctx("w4a16_pack", a.qw, a.sc, a.qw_packed, a.sc_packed);
  const int rank = a.qw.rank();
  if (rank != 2 && rank != 3) return Invalid(ctx, "qw must be [N, K/8] or [E, N, K/8], got ", rank, " dimensions");
  const int lead = rank - 2;
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.qw, {DType::kI32}, rank));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.sc, {DType::kBF16, DType::kF32}, rank));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.qw_packed, {DType::kI32}, rank + 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.sc_packed, {a.sc.dtype}, rank + 1));
  const int64_t e = lead ? a.qw.dim(0) : 1, n = a.qw.dim(lead), k = a.qw.dim(lead + 1) * 8;
  KDTREE_RETURN_IF_ERROR(CheckGroup(ctx, k, a.group));
  if (a.gate_up && n % 2 != 0) return Invalid(ctx, "interleaveGateUp: qw must hold gate rows then as many up rows (an even N), got N = ", n);
  if (a.sc.dim(lead) != n || a.sc.dim(lead + 1) * a.group != k || (lead && a.sc.dim(0) != e)) {
    return Invalid(ctx, "sc must be [", lead ? std::to_string(e) + ", " : "", n, ", ", k / a.group, "] (N, K/G) for qw's N = ", n, ", K = ", k, ", G = ", a.group);
  }
  return CheckPacked(ctx, a.qw_packed, a.sc_packed, lead, e, n, k, a.group);
}

Status ValidateW4A16Gemm(const W4A16GemmArgs& a) {
  const OpContext ctx("w4a16_gemm", a.x, a.qw, a.sc, a.y);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  KDTREE_RETURN_IF_ERROR(NotCheckpoint(ctx, a.qw, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.qw, {DType::kI32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.sc, {DType::kBF16, DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.y, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  const int64_t m = a.x.dim(0), k = a.x.dim(1), n = WeightRows(a.y, a.epilogue);
  KDTREE_RETURN_IF_ERROR(CheckGroup(ctx, k, a.group));
  if (a.y.dim(0) != m) return Invalid(ctx, "y must be [M, ", a.epilogue == Epilogue::kSiluMul ? "I" : "N", "] with M = ", m, " (x's rows)");
  KDTREE_RETURN_IF_ERROR(CheckPacked(ctx, a.qw, a.sc, 0, 1, n, k, a.group));
  return CheckPackedInfo(ctx, a.qw, a.sc, a.qw_info, a.sc_info, 0, n, k, a.group, a.epilogue, "x");
}

Status ValidateGemm(const GemmArgs& a) {
  const OpContext ctx("gemm", a.x, a.w, a.y);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.w, {DType::kBF16, DType::kF16}, 2));
  if (a.w.dtype == DType::kBF16) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kBF16, DType::kF32}, 2));
  } else {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF16}, 2));  // f32 split into f16 pieces would overflow past 65504
  }
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.y, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(0);
  if (a.w.dim(1) != k) return Invalid(ctx, "w must be [N, K] with K = ", k, " (x's columns), got K = ", a.w.dim(1));
  if (k == 0 || k % 8 != 0) return Invalid(ctx, "K = ", k, " must be a positive multiple of 8 (rows of 16-byte units)");
  if (a.y.dim(0) != m || a.y.dim(1) != n) return Invalid(ctx, "y must be [M, N] = [", m, ", ", n, "]");
  if (k > (int64_t{1} << 30) || n > (int64_t{1} << 30) || m > (int64_t{1} << 30)) return Invalid(ctx, "M, N and K must each be at most 2^30");
  for (const Tensor* t : {&a.x, &a.w}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return Invalid(ctx, t->name, " must start 16-byte aligned (its offset into the buffer a multiple of 16)");
  }
  return Status::Ok();
}

namespace {

// The routing shapes both weight forms share: ids [T, topk]; gather: x [T, K], y [T*topk, N];
// sum: x [T*topk, K], weights f32 [T, topk], y [T, N].
Status CheckMoeRows(const OpContext& ctx, const OpContext& wctx, const MoeGemmArgs& a) {
  const int64_t t = a.ids.dim(0), kk = a.ids.dim(1);
  if (a.mode == MoeMode::kGather) {
    if (a.x.dim(0) != t) return Invalid(ctx, "gather mode: x must have one row per token (", t, ")");
    if (a.y.dim(0) != t * kk) return Invalid(ctx, "gather mode: y must be [T*topk, N] = [", t * kk, ", N]");
    return Status::Ok();
  }
  if (a.epilogue != Epilogue::kNone) return Invalid(ctx, "the siluMul epilogue needs gather mode (it makes the activation of a gate_up projection)");
  if (!a.weights.present()) return Invalid(ctx, "sum mode needs weights, f32 [T, topk] = [", t, ", ", kk, "]");
  KDTREE_RETURN_IF_ERROR(CheckTensor(wctx, a.weights, {DType::kF32}, 2));
  if (a.weights.dim(0) != t || a.weights.dim(1) != kk) return Invalid(wctx, "weights must be [T, topk] like ids");
  if (a.x.dim(0) != t * kk) return Invalid(wctx, "sum mode: x must have one row per (token, expert) pair (", t * kk, ")");
  if (a.y.dim(0) != t) return Invalid(wctx, "sum mode: y must be [T, N] = [", t, ", N]");
  return Status::Ok();
}

// Experts in bf16 as stored, w [E, N, K] (with the siluMul epilogue N = 2I: gate rows, then up).
Status ValidateMoeGemmBf16(const MoeGemmArgs& a, int64_t* experts, int64_t* topk) {
  const OpContext ctx("moe_gemm", a.x, a.w, a.ids, a.y);
  const OpContext wctx("moe_gemm", a.x, a.w, a.ids, a.weights, a.y);
  if (a.qw.present() || a.sc.present()) return Invalid(ctx, "w (bf16 experts as stored) replaces qw and sc (packed W4A16 experts): give one or the other");
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.w, {DType::kBF16}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.ids, {DType::kI32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.y, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  const int64_t e = a.w.dim(0), n = WeightRows(a.y, a.epilogue), k = a.x.dim(1);
  if (a.w.dim(1) != n || a.w.dim(2) != k) {
    return Invalid(ctx, "w must be [E, N, K] = [", e, ", ", n, ", ", k, "] (N from y", a.epilogue == Epilogue::kSiluMul ? ": 2I gate then up rows for y's I columns" : "", ", K from x)");
  }
  if (k == 0 || k % 8 != 0) return Invalid(ctx, "K = ", k, " must be a positive multiple of 8 (rows of 16-byte units)");
  if (k > (int64_t{1} << 30) || n > (int64_t{1} << 30) || e > (int64_t{1} << 20)) return Invalid(ctx, "N and K must each be at most 2^30, E at most 2^20");
  if (a.min_warp_steps != 0) return Invalid(ctx, "minWarpSteps applies to packed W4A16 experts (qw, sc), not to bf16 w");
  for (const Tensor* t : {&a.x, &a.w}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return Invalid(ctx, t->name, " must start 16-byte aligned (its offset into the buffer a multiple of 16)");
  }
  KDTREE_RETURN_IF_ERROR(CheckMoeRows(ctx, wctx, a));
  *experts = e;
  *topk = a.ids.dim(1);
  return Status::Ok();
}

}  // namespace

Status ValidateMoeGemm(const MoeGemmArgs& a, int64_t* experts, int64_t* topk) {
  if (a.w.present()) return ValidateMoeGemmBf16(a, experts, topk);
  constexpr int64_t kMaxMinWarpSteps = 1 << 20;
  const OpContext ctx("moe_gemm", a.x, a.qw, a.sc, a.ids, a.y);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  KDTREE_RETURN_IF_ERROR(NotCheckpoint(ctx, a.qw, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.qw, {DType::kI32}, 4));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.sc, {DType::kBF16, DType::kF32}, 4));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.ids, {DType::kI32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.y, {DType::kF32, DType::kBF16, DType::kF16}, 2));
  const int64_t e = a.qw.dim(0), n = WeightRows(a.y, a.epilogue), k = a.x.dim(1), kk = a.ids.dim(1);
  KDTREE_RETURN_IF_ERROR(CheckGroup(ctx, k, a.group));
  if (a.min_warp_steps < 0 || a.min_warp_steps > kMaxMinWarpSteps) return Invalid(ctx, "minWarpSteps must be in [0, ", kMaxMinWarpSteps, "], got ", a.min_warp_steps);
  KDTREE_RETURN_IF_ERROR(CheckMoeRows(ctx, OpContext("moe_gemm", a.x, a.qw, a.sc, a.ids, a.weights, a.y), a));
  KDTREE_RETURN_IF_ERROR(CheckPacked(ctx, a.qw, a.sc, 1, e, n, k, a.group));
  KDTREE_RETURN_IF_ERROR(CheckPackedInfo(ctx, a.qw, a.sc, a.qw_info, a.sc_info, e, n, k, a.group, a.epilogue, "x"));
  *experts = e;
  *topk = kk;
  return Status::Ok();
}

Status ValidateMlaAttention(const MlaAttentionArgs& a) {
  const OpContext ctx("mla_attention", a.q_nope, a.q_pe, a.kv_b, a.cache_c, a.cache_kpe, a.out, a.mask, a.base_on_device);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_nope, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_pe, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.kv_b, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_c, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_kpe, {a.cache_c.dtype}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32, DType::kBF16}, 3));
  const int64_t t = a.q_nope.dim(0), h = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
  const int64_t r = a.cache_c.dim(1), dv = a.out.dim(2), s = a.cache_c.dim(0);
  if (t < 1) return Invalid(ctx, "needs at least one query token");
  if (a.q_pe.dim(0) != t || a.q_pe.dim(1) != h) return Invalid(ctx, "q_pe must be [T, H, rope] = [", t, ", ", h, ", rope]");
  if (a.kv_b.dim(0) != h * (dn + dv) || a.kv_b.dim(1) != r) return Invalid(ctx, "kv_b must be [H * (nope + v), R] = [", h * (dn + dv), ", ", r, "]");
  if (a.cache_kpe.dim(0) != s || a.cache_kpe.dim(1) != dr) return Invalid(ctx, "cache_kpe must be [S, rope] = [", s, ", ", dr, "]");
  if (a.out.dim(0) != t || a.out.dim(1) != h) return Invalid(ctx, "out must be [T, H, v] = [", t, ", ", h, ", v]");
  if (a.base < 0 || a.base + t > INT32_MAX) return Invalid(ctx, "base ", a.base, " + T ", t, " new tokens leave the i32 positions (at most 2^31 - 1)");
  if (a.base + t > s) {
    if (a.base_on_device.present()) return Invalid(ctx, "base (the bound of ", a.base_on_device.name, ") ", a.base, " + T ", t, " new tokens exceed the cache's ", s, " slots");
    return Invalid(ctx, "base ", a.base, " + T ", t, " new tokens exceed the cache's ", s, " slots");
  }
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.base_on_device));
  if (r > 1024 || dr > 256) return Unsupported(ctx, "kv_lora_rank up to 1024 and rope dims up to 256 are supported");
  if (!(a.scale > 0) || !std::isfinite(a.scale)) return Invalid(ctx, "scale must be positive and finite, got ", a.scale);
  if (a.mask.present()) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.mask, {DType::kU8}, 2));
    if (a.mask.dim(0) != t || a.mask.dim(1) != t) return Invalid(ctx, "mask must be [T, T] = [", t, ", ", t, "]");
  }
  return Status::Ok();
}

Status ValidateEmbedding(const EmbeddingArgs& a) {
  const OpContext ctx("embedding", a.table, a.ids, a.out);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.table, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.ids, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32}, 2));
  if (a.out.dim(0) != a.ids.dim(0) || a.out.dim(1) != a.table.dim(1)) return Invalid(ctx, "out must be [T, H] = [", a.ids.dim(0), ", ", a.table.dim(1), "]");
  return Status::Ok();
}

Status ValidateRmsNorm(const RmsNormArgs& a) {
  const OpContext ctx("rms_norm", a.x, a.weight, a.out, a.residual, a.sum, a.out_bf16);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.weight, {DType::kF32, DType::kBF16}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32, DType::kBF16}, 2));
  if (a.weight.dim(0) != a.x.dim(1) || a.out.shape != a.x.shape) return Invalid(ctx, "weight must be [H] and out like x");
  if (a.residual.present() != a.sum.present()) return Invalid(ctx, "residual and sum go together (the norm of x + residual, which sum receives)");
  if (a.residual.present()) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.residual, {DType::kF32}, 2));
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.sum, {DType::kF32}, 2));
    if (a.residual.shape != a.x.shape || a.sum.shape != a.x.shape) return Invalid(ctx, "residual and sum must be like x");
  }
  if (a.out_bf16.present()) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out_bf16, {DType::kBF16}, 2));
    if (a.out.dtype != DType::kF32) return Invalid(ctx, "outBf16 is the bf16 copy of an f32 out; out is already ", DTypeName(a.out.dtype));
    if (a.out_bf16.shape != a.x.shape) return Invalid(ctx, "outBf16 must be like x");
  }
  if (!(a.eps > 0) || !std::isfinite(a.eps)) return Invalid(ctx, "eps must be positive and finite, got ", a.eps);
  return Status::Ok();
}

Status ValidateRope(const RopeArgs& a) {
  const OpContext ctx("rope", a.x, a.positions, a.inv_freq);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.positions, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.inv_freq, {DType::kF64}, 1));
  if (a.positions.dim(0) != a.x.dim(0)) return Invalid(ctx, "positions must have one entry per row of x (", a.x.dim(0), ")");
  if (a.offset < 0 || a.offset + 2 * a.inv_freq.dim(0) > a.x.dim(2)) return Invalid(ctx, "rotated dims [", a.offset, ", ", a.offset + 2 * a.inv_freq.dim(0), ") exceed the head dim ", a.x.dim(2));
  if (!std::isfinite(a.attention_factor)) return Invalid(ctx, "attentionFactor must be finite, got ", a.attention_factor);
  return Status::Ok();
}

Status ValidateSiluMul(const SiluMulArgs& a) {
  const OpContext ctx("silu_mul", a.x, a.out);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32, DType::kBF16}, 2));
  if (a.x.dim(1) % 2 != 0 || a.out.dim(0) != a.x.dim(0) || a.out.dim(1) * 2 != a.x.dim(1)) return Invalid(ctx, "x must be [T, 2I] and out [T, I]");
  return Status::Ok();
}

Status ValidateGqaAttention(const GqaAttentionArgs& a) {
  const OpContext ctx("gqa_attention", a.q, a.k_cache, a.v_cache, a.k, a.v, a.out, a.context_length_on_device);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.k_cache, {DType::kF32, DType::kBF16}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.v_cache, {DType::kF32, DType::kBF16}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.k, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.v, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32, DType::kBF16}, 3));
  const int64_t t = a.q.dim(0), hq = a.q.dim(1), d = a.q.dim(2);
  const int64_t s = a.k_cache.dim(0), hkv = a.k_cache.dim(1);
  if (d < 1 || d > kMaxGqaHeadDim) return Unsupported(ctx, "head dims 1..", kMaxGqaHeadDim, " are supported, q has ", d);
  if (hkv < 1 || hq % hkv != 0) return Invalid(ctx, "q's ", hq, " heads must be a multiple of kCache's ", hkv, " KV heads (each KV head serves Hq / Hkv query heads)");
  if (a.k_cache.dim(2) != d) return Invalid(ctx, "kCache must be [S, Hkv, D] with D = ", d, " (q's head dim)");
  if (a.v_cache.shape != a.k_cache.shape) return Invalid(ctx, "vCache must be like kCache: [", s, ", ", hkv, ", ", d, "]");
  if (a.v_cache.dtype != a.k_cache.dtype) return Invalid(ctx, "vCache must have kCache's dtype (", DTypeName(a.k_cache.dtype), ")");
  if (a.k.dim(0) != t || a.k.dim(1) != hkv || a.k.dim(2) != d) return Invalid(ctx, "k must be [T, Hkv, D] = [", t, ", ", hkv, ", ", d, "] (the block's own keys)");
  if (a.v.shape != a.k.shape) return Invalid(ctx, "v must be like k: [", t, ", ", hkv, ", ", d, "]");
  if (a.out.shape != a.q.shape) return Invalid(ctx, "out must be like q: [", t, ", ", hq, ", ", d, "]");
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.context_length_on_device));
  if (a.context_length < 0 || a.context_length > s) {
    if (a.context_length_on_device.present()) return Invalid(ctx, "contextLength (the bound of ", a.context_length_on_device.name, ") ", a.context_length, " is outside the cache's [0, ", s, "] rows");
    return Invalid(ctx, "contextLength ", a.context_length, " is outside the cache's [0, ", s, "] rows");
  }
  if (!(a.scale > 0) || !std::isfinite(a.scale)) return Invalid(ctx, "scale must be positive and finite, got ", a.scale);
  return Status::Ok();
}

Status ValidateAdd(const AddArgs& a) {
  const OpContext ctx("add", a.a, a.b, a.out);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.a, {DType::kF32}, -1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.b, {DType::kF32}, -1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kF32}, -1));
  if (a.a.shape != a.b.shape || a.a.shape != a.out.shape) return Invalid(ctx, "a, b and out must have the same shape");
  return Status::Ok();
}

Status ValidateRouter(const RouterArgs& a) {
  const OpContext ctx("router", a.logits, a.bias, a.ids, a.weights);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.logits, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.bias, {DType::kF32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.ids, {DType::kI32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.weights, {DType::kF32}, 2));
  const int64_t t = a.logits.dim(0), e = a.logits.dim(1);
  if (a.bias.dim(0) != e) return Invalid(ctx, "bias must be [E] = [", e, "]");
  if (a.ids.dim(0) != t || a.ids.dim(1) != a.topk || a.weights.shape != a.ids.shape) return Invalid(ctx, "ids and weights must be [T, topk] = [", t, ", ", a.topk, "]");
  if (a.n_group < 1 || e % a.n_group != 0) return Invalid(ctx, "E = ", e, " must be a multiple of n_group = ", a.n_group);
  if (a.topk_group < 1 || a.topk_group > a.n_group) return Invalid(ctx, "topk_group ", a.topk_group, " must be in [1, n_group = ", a.n_group, "]");
  if (a.n_group > 1 && e / a.n_group < 2) return Invalid(ctx, "groups need at least 2 experts");
  if (a.topk < 1 || a.topk > a.topk_group * (e / a.n_group)) return Invalid(ctx, "topk ", a.topk, " cannot be chosen from ", a.topk_group, " groups of ", e / a.n_group);
  if (!std::isfinite(a.scaling)) return Invalid(ctx, "scaling must be finite, got ", a.scaling);
  if (e > 1024 || a.topk > 32) return Unsupported(ctx, "up to 1024 experts and 32 per token are supported");
  return Status::Ok();
}

Status ValidateArgmax(const ArgmaxArgs& a) {
  const OpContext ctx("argmax", a.x, a.out);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kI32}, 1));
  if (a.out.dim(0) != a.x.dim(0)) return Invalid(ctx, "out must be [T] = [", a.x.dim(0), "]");
  if (a.x.dim(1) < 1) return Invalid(ctx, "rows must not be empty");
  return Status::Ok();
}

Status ValidateTopk(const TopkArgs& a) {
  const OpContext ctx("topk", a.x, a.values, a.ids);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.values, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.ids, {DType::kI32}, 2));
  if (a.k < 1 || a.k > a.x.dim(1)) return Invalid(ctx, "k = ", a.k, " must be in [1, ", a.x.dim(1), "]");
  if (a.k > 1024) return Unsupported(ctx, "k up to 1024 is supported");
  if (a.values.dim(0) != a.x.dim(0) || a.values.dim(1) != a.k || a.ids.shape != a.values.shape) return Invalid(ctx, "values and ids must be [T, k] = [", a.x.dim(0), ", ", a.k, "]");
  return Status::Ok();
}

Status ValidateKvWrite(const KvWriteArgs& a) {
  const OpContext ctx("kv_write", a.c, a.kpe, a.cache_c, a.cache_kpe, a.slots);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.c, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.kpe, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_c, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_kpe, {a.cache_c.dtype}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.slots, {DType::kI32}, 1));
  const int64_t t = a.c.dim(0);
  if (a.kpe.dim(0) != t || a.slots.dim(0) != t) return Invalid(ctx, "c, kpe and slots need one row per token (", t, ")");
  if (a.cache_c.dim(1) != a.c.dim(1) || a.cache_kpe.dim(1) != a.kpe.dim(1) || a.cache_c.dim(0) != a.cache_kpe.dim(0)) return Invalid(ctx, "cache rows must match c and kpe");
  return Status::Ok();
}

namespace {
// The RoPE arguments mla_inputs and mla_query share: one position per row, frequencies for all
// `dims` rotated dims.
Status CheckMlaRope(const OpContext& ctx, const Tensor& positions, const Tensor& inv_freq, int64_t t, int64_t dims, double attention_factor) {
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, positions, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, inv_freq, {DType::kF64}, 1));
  if (positions.dim(0) != t) return Invalid(ctx, "positions must have one entry per row of x (", t, ")");
  if (2 * inv_freq.dim(0) != dims) return Invalid(ctx, "invFreq must be [rope / 2] = [", dims / 2, "] (every rope dim is rotated), got [", inv_freq.dim(0), "]");
  if (!std::isfinite(attention_factor)) return Invalid(ctx, "attentionFactor must be finite, got ", attention_factor);
  return Status::Ok();
}
}  // namespace

Status ValidateMlaInputs(const MlaInputsArgs& a) {
  const OpContext ctx("mla_inputs", a.x, a.q_a_norm, a.q_a_out, a.kv_a_norm, a.cache_c, a.cache_kpe, a.slots, a.positions, a.inv_freq);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.kv_a_norm, {DType::kF32, DType::kBF16}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_c, {DType::kF32, DType::kBF16}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.cache_kpe, {a.cache_c.dtype}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.slots, {DType::kI32}, 1));
  const int64_t t = a.x.dim(0), w = a.x.dim(1), r = a.cache_c.dim(1), dr = a.cache_kpe.dim(1);
  if (a.kv_a_norm.dim(0) != r) return Invalid(ctx, "kvANorm must be [R] = [", r, "] (cacheC's row)");
  if (a.cache_kpe.dim(0) != a.cache_c.dim(0)) return Invalid(ctx, "cacheC and cacheKpe must have the same slots");
  if (dr % 2 != 0) return Invalid(ctx, "cacheKpe's rope dims must be even, got ", dr);
  if (a.slots.dim(0) != t) return Invalid(ctx, "slots must have one entry per row of x (", t, ")");
  if (a.q_a_norm.present() != a.q_a_out.present()) return Invalid(ctx, "qANorm and qAOut go together (the normed q_a part of x)");
  int64_t q = 0;
  if (a.q_a_norm.present()) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_a_norm, {DType::kF32, DType::kBF16}, 1));
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_a_out, {DType::kF32, DType::kBF16}, 2));
    q = a.q_a_norm.dim(0);
    if (a.q_a_out.dim(0) != t || a.q_a_out.dim(1) != q) return Invalid(ctx, "qAOut must be [T, Q] = [", t, ", ", q, "] (qANorm's Q)");
  }
  if (w < q + r + dr) return Invalid(ctx, "x must hold [q_a (", q, ") ... | c (", r, ") | k_pe (", dr, ")] in its ", w, " columns: at least ", q + r + dr);
  KDTREE_RETURN_IF_ERROR(CheckMlaRope(ctx, a.positions, a.inv_freq, t, dr, a.attention_factor));
  if (!(a.eps > 0) || !std::isfinite(a.eps)) return Invalid(ctx, "eps must be positive and finite, got ", a.eps);
  return Status::Ok();
}

Status ValidateMlaQuery(const MlaQueryArgs& a) {
  const OpContext ctx("mla_query", a.x, a.q_nope, a.q_pe, a.positions, a.inv_freq);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.x, {DType::kF32}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_nope, {DType::kF32}, 3));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.q_pe, {DType::kF32}, 3));
  const int64_t t = a.x.dim(0), h = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
  if (a.q_nope.dim(0) != t || a.q_pe.dim(0) != t || a.q_pe.dim(1) != h) return Invalid(ctx, "qNope must be [T, H, nope] and qPe [T, H, rope] with x's T = ", t);
  if (dr % 2 != 0) return Invalid(ctx, "qPe's rope dims must be even, got ", dr);
  if (a.x.dim(1) < h * (dn + dr)) return Invalid(ctx, "x must hold [nope of ", h, " heads (", h * dn, ") | their rope parts (", h * dr, ")] in its ", a.x.dim(1), " columns");
  return CheckMlaRope(ctx, a.positions, a.inv_freq, t, dr, a.attention_factor);
}

Status ValidateDdtreeBuild(const DdtreeBuildArgs& a) {
  const OpContext ctx("ddtree_build", a.draft_logits, a.tokens, a.parents, a.depths, a.positions, a.mask, a.size, a.root_on_device, a.start_on_device, a.log_probs);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.draft_logits, {DType::kF32}, 2));
  for (const Tensor* t : {&a.tokens, &a.parents, &a.depths, &a.positions}) KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, *t, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.mask, {DType::kU8}, 2));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.size, {DType::kI32}, 1));
  const int64_t n = static_cast<int64_t>(a.budget) + 1, v = a.draft_logits.dim(1);
  if (a.budget < 0 || a.budget > kMaxDdtreeBudget) return Invalid(ctx, "budget ", a.budget, " must be in [0, ", kMaxDdtreeBudget, "]");
  if (a.draft_logits.dim(0) < 1) return Invalid(ctx, "needs at least one draft depth");
  // positions are i32 start + depth, depth <= L
  if (a.start < 0 || a.start + a.draft_logits.dim(0) > INT32_MAX) return Invalid(ctx, "start ", a.start, " + ", a.draft_logits.dim(0), " draft depths leave the i32 positions (at most 2^31 - 1)");
  if (!a.root_on_device.present() && (a.root < 0 || a.root >= v)) return Invalid(ctx, "root token ", a.root, " is outside the vocabulary [0, ", v, ")");
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.root_on_device));
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.start_on_device));
  for (const Tensor* t : {&a.tokens, &a.parents, &a.depths, &a.positions}) {
    if (t->dim(0) != n) return Invalid(ctx, t->name, " must be [budget + 1] = [", n, "]");
  }
  if (a.mask.dim(0) != n || a.mask.dim(1) != n) return Invalid(ctx, "mask must be [budget + 1, budget + 1] = [", n, ", ", n, "]");
  if (a.size.dim(0) != 1) return Invalid(ctx, "size must be [1]");
  if (a.log_probs.present()) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.log_probs, {DType::kF32}, 1));
    if (a.log_probs.dim(0) != n) return Invalid(ctx, "logProbs must be [budget + 1] = [", n, "]");
  }
  return Status::Ok();
}

Status ValidateDdtreeAccept(const DdtreeAcceptArgs& a) {
  const OpContext ctx("ddtree_accept", a.tokens, a.parents, a.size, a.target_argmax, a.path, a.path_len, a.bonus);
  for (const Tensor* t : {&a.tokens, &a.parents, &a.size, &a.target_argmax, &a.path, &a.path_len, &a.bonus}) KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, *t, {DType::kI32}, 1));
  const int64_t n = a.tokens.dim(0);
  if (a.parents.dim(0) != n || a.target_argmax.dim(0) < 1 || a.path.dim(0) != n) return Invalid(ctx, "tokens, parents and path must be [N] and target_argmax one per node");
  if (n > kMaxDdtreeBudget + 1) return Invalid(ctx, "a tree holds at most ", kMaxDdtreeBudget + 1, " nodes (budget ", kMaxDdtreeBudget, " + root), got ", n);
  if (a.size.dim(0) != 1 || a.path_len.dim(0) != 1 || a.bonus.dim(0) != 1) return Invalid(ctx, "size, path_len and bonus must be [1]");
  return Status::Ok();
}

Status ValidateKvCommit(const KvCommitArgs& a) {
  const OpContext ctx("kv_commit", a.path, a.path_len, a.start_on_device, a.next_start);
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.path, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.path_len, {DType::kI32}, 1));
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.start_on_device));
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.next_start));
  if (a.caches.empty()) return Invalid(ctx, "needs at least one cache tensor");
  // the committed length after the commit is written as an i32
  if (a.start < 0 || a.start + a.path.dim(0) > INT32_MAX) return Invalid(ctx, "start ", a.start, " + ", a.path.dim(0), " path slots leave the i32 range (at most 2^31 - 1)");
  for (const Tensor& c : a.caches) {
    KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, c, {DType::kF32, DType::kBF16}, 2));
    // a start read on the device is checked there (rows past the cache are not moved)
    if (!a.start_on_device.present() && (a.start < 0 || a.start + a.path.dim(0) > c.dim(0))) {
      return Invalid(ctx, c.Describe(), ": start ", a.start, " + ", a.path.dim(0), " path slots exceed its ", c.dim(0), " rows");
    }
  }
  return Status::Ok();
}

Status ValidateArange(const ArangeArgs& a) {
  const OpContext ctx("arange", a.start_on_device, a.out);
  KDTREE_RETURN_IF_ERROR(CheckDeviceScalar(ctx, a.start_on_device));
  KDTREE_RETURN_IF_ERROR(CheckTensor(ctx, a.out, {DType::kI32}, 1));
  if (a.start < INT32_MIN || a.start + a.out.dim(0) > INT32_MAX) return Invalid(ctx, "start ", a.start, " + ", a.out.dim(0), " values leave the i32 range");
  return Status::Ok();
}

}  // namespace kdtree
