// The op set of the addon, with the arguments each one takes. Work space an op needs (the MoE
// expert sort, MLA's latent query and context, DDTree's top-K table, the GEMM's K-range partials)
// comes from the backend's per-stream scratch arena, so callers pass only inputs and outputs.
// Every op has a CPU twin and a CUDA
// version with the same semantics; `ValidateX` (validate.cc) checks dtypes and shapes before
// either backend sees the arguments, so kernels can trust them.
//
// Shapes (row-major):
//   W4A16 pack   checkpoint qw[(E,) N, K/8], sc[(E,) N, K/G] -> packed qw[(E,) N/16, K/128, 256],
//                sc[(E,) N/16, K/(4G), 64] (rounded up; the layout is in w4a16_layout.h)
//                (gate_up: qw holds [gate; up], 2I rows, packed as tiles of 8 gate rows and the same 8
//                up rows: tile t, row r < 8 = gate row 8t + r, row 8 + r = up row 8t + r)
//   W4A16 GEMM   y[M, N] = x[M, K] . dequant(W)^T, W packed (N from y, K from x); with the SiLU
//                epilogue W is gate_up-packed with 2I rows and y[M, I] = silu(gate) * up, gate and up
//                first rounded to y's dtype (the bits of the plain GEMM followed by silu_mul)
//   GEMM         y[M, N] = x[M, K] . W^T, W[N, K] in bf16 or f16 as the checkpoint stores it (the
//                layers that stay float: attention projections, shared experts, dense MLPs, lm_head)
//   MoE GEMM     gather: y[T*topk, N] row t*topk+j = x[t] . W[ids[t, j]]^T
//                sum:    y[T, N] = sum_j weights[t, j] * (x[t*topk+j] . W[ids[t, j]]^T)   (j in order)
//                gather with the SiLU epilogue: as the W4A16 GEMM's, per (token, expert) row
//                W packed W4A16 (qw, sc), or bf16 w[E, N, K] as the checkpoint stores it (with the
//                SiLU epilogue its 2I rows are [gate; up] in checkpoint order, not interleaved)
//   MLA          out[T, H, dv] from q_nope[T, H, dn], q_pe[T, H, dr] (RoPE'd), kv_b[H*(dn+dv), R],
//                latent cache c[S, R], kpe[S, dr] holding `base` committed slots + T new ones
#pragma once
#include <cstdint>
#include <vector>

#include "kdtree/status.h"
#include "kdtree/tensor.h"

namespace kdtree {

struct W4A16PackArgs {
  Tensor qw, sc;                 // checkpoint layout
  Tensor qw_packed, sc_packed;   // outputs, every element written (padding included)
  int group = 32;
  bool gate_up = false;          // qw, sc are [gate; up] (N = 2I): pack for the SiLU epilogue
};

// The matrix a packed qw or sc holds, as w4a16Pack recorded it: the packed shapes give N and K
// only to their padding (16 rows, 128 k) and the group not at all when K <= 128, so the GEMMs
// check x's K, y's N and their group against this when it is known (the binding keeps it with
// the buffers w4a16Pack wrote; weights put there by upload or copy have none).
struct PackedWeightInfo {
  bool known = false;
  bool scales = false;    // sc_packed (else qw_packed)
  int64_t experts = 0;    // 0: one matrix [N, K]; else E matrices
  int64_t n = 0, k = 0;   // the checkpoint's N (2I for gate_up) and K
  int group = 0;
  bool gate_up = false;   // interleaveGateUp: rows in the siluMul epilogue's order
};

// What a W4A16 GEMM does with a finished output tile before it stores it.
enum class Epilogue : int {
  kNone = 0,
  // gate_up-packed weights: y = silu(gate) * up, so an MLP's activation needs no kernel of its own
  // and its [M, 2I] gate_up output is never written
  kSiluMul = 1,
};

// The weight rows of a W4A16 GEMM writing y: its N columns, or with the SiLU epilogue 2I gate_up
// rows for y's I columns.
inline int64_t WeightRows(const Tensor& y, Epilogue e) { return e == Epilogue::kSiluMul ? 2 * y.dim(1) : y.dim(1); }

struct W4A16GemmArgs {
  Tensor x, qw, sc, y;           // qw, sc packed
  int group = 32;
  Epilogue epilogue = Epilogue::kNone;
  PackedWeightInfo qw_info, sc_info;  // what qw and sc hold, where known
};

struct GemmArgs {
  Tensor x, w, y;  // x bf16 / f32 (bf16 w) or f16 (f16 w); y f32, bf16 or f16
};

enum class MoeMode : int { kGather = 0, kSum = 1 };

struct MoeGemmArgs {
  Tensor x, qw, sc, ids, weights, y;  // qw, sc packed with a leading E; weights unused in gather mode
  Tensor w;  // bf16 [E, N, K] experts as stored, instead of qw and sc (a float bundle's routed experts)
  int group = 32;
  MoeMode mode = MoeMode::kGather;
  Epilogue epilogue = Epilogue::kNone;  // kSiluMul: gather mode only
  // The least weight steps (16 rows x 128 k) each warp streams, 0 = decode-sized ranges. Longer
  // ranges mean fewer blocks: faster when a call uses many experts (a tree verify), slower for a
  // decode step. A row's bits depend on it: keep one value for every call on the same weights.
  int64_t min_warp_steps = 0;
  PackedWeightInfo qw_info, sc_info;  // what qw and sc hold, where known
};

struct MlaAttentionArgs {
  Tensor q_nope, q_pe, kv_b, cache_c, cache_kpe, mask, out;  // mask: u8 [T, T] or empty (causal)
  int64_t base = 0;   // committed slots in the cache; the T new tokens are at [base, base + T)
  double scale = 1.0;
  // Optional i32 [1]: the committed slots, read on the device when the kernels run, so one captured
  // graph serves every decode step. `base` then bounds it (the grid and the work space are sized
  // for `base`; a larger value is clamped on the device, rejected by the cpu twin); the bits are
  // those of the same call with that value as `base`.
  Tensor base_on_device;
};

struct EmbeddingArgs { Tensor table, ids, out; };
struct RmsNormArgs {
  Tensor x, weight, out;
  double eps = 1e-6;
  // Optional, f32 like x: the norm is of x + residual, which is also written to `sum` (f32 like x;
  // it may be x or residual itself): a layer's residual add fused into the next norm, with the bits
  // of add followed by rms_norm.
  Tensor residual, sum;
  // Optional, bf16 like x's shape with an f32 out: the same values rounded to nearest even as well,
  // from one pass (a MoE layer's router reads the f32 norm, its experts the bf16 one).
  Tensor out_bf16;
};
// A row's sum of squares, in the same order on both backends (same bits): thread t of
// kRmsNormThreads sums its 4-element chunks t, t + kRmsNormThreads, ...; each warp's 32 partials meet
// in an xor butterfly; the warp sums are added in order.
constexpr int kRmsNormThreads = 512;
struct RopeArgs {
  Tensor x;          // f32 [T, heads, head_dim], rotated in place on dims [offset, offset + inv_freq*2)
  Tensor positions;  // i32 [T]
  Tensor inv_freq;   // f64 [rope_dim / 2]
  int64_t offset = 0;
  double attention_factor = 1.0;
  bool interleave = true;
};
// Non-causal grouped-query attention of a block over cached context keys and its own keys (a
// DFlash drafter's layer): query t of head h sees context rows [0, context_length) of the cache and
// every row of the block, all with KV head h / (Hq / Hkv).
struct GqaAttentionArgs {
  Tensor q;                 // f32 [T, Hq, D], normed and rotated
  Tensor k_cache, v_cache;  // f32 or bf16 [S, Hkv, D]; rows [0, context_length) are read
  Tensor k, v;              // f32 [T, Hkv, D]: the block's own keys and values
  Tensor out;               // f32 or bf16 [T, Hq, D]
  // With context_length_on_device (i32 [1], read when the kernel runs, so one captured step serves
  // every length), context_length is its bound and the value read is clamped to [0, bound].
  Tensor context_length_on_device;
  int64_t context_length = 0;
  double scale = 1.0;
};
// Head dims a gqa_attention call may have (each lane of a warp keeps D / 32 rounded up of them).
constexpr int64_t kMaxGqaHeadDim = 256;
struct SiluMulArgs { Tensor x, out; };  // x [T, 2I] = [gate | up] -> out [T, I]; f32 or bf16 each
struct AddArgs { Tensor a, b, out; };
struct RouterArgs {
  Tensor logits, bias, ids, weights;  // logits f32 [T, E], bias f32 [E] -> ids i32 [T, k], weights f32 [T, k]
  int topk = 8, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  double scaling = 1.0;
};
struct ArgmaxArgs { Tensor x, out; };  // x f32 [T, V] -> out i32 [T]
struct TopkArgs { Tensor x, values, ids; int k = 1; };  // per row, descending, ties -> lower index

struct KvWriteArgs { Tensor c, kpe, cache_c, cache_kpe, slots; };  // rows -> cache slots
// MLA's inputs from its down projections, fused so a decode step runs one short kernel where the
// unfused chain (rms_norm, rope, kv_write) ran three or four, each bound by launch latency:
//   mla_inputs: x f32 [T, W] holds [q_a(h) (Q, optional) ... | kv_a(h): c (R) | k_pe (dr)] (the kv
//     part is x's last R + dr columns). Writes q_a_out [T, Q] = rms_norm(x[:, :Q], q_a_norm) when
//     q_a_norm is given, cache_c[slots[t]] = rms_norm(c, kv_a_norm) and cache_kpe[slots[t]] =
//     rope(k_pe): the bits of rms_norm, rope (one head) and kv_write on the same rows.
//   mla_query: x f32 [T, W] holds [q_b(...) nope parts of all H heads (H * dn) | their rope parts
//     (H * dr)] in its first columns. Writes q_nope [T, H, dn] (copied) and q_pe [T, H, dr] =
//     rope(rope parts): the bits of rope on the same rows.
struct MlaInputsArgs {
  Tensor x;
  Tensor q_a_norm, q_a_out;  // optional together (a model without q_lora)
  Tensor kv_a_norm;          // [R]
  Tensor cache_c, cache_kpe, slots;  // as kv_write's
  Tensor positions, inv_freq;        // as rope's (inv_freq covers all dr dims)
  double eps = 1e-6;
  double attention_factor = 1.0;
  bool interleave = true;
};
struct MlaQueryArgs {
  Tensor x, q_nope, q_pe;
  Tensor positions, inv_freq;  // as rope's (inv_freq covers all dr dims)
  double attention_factor = 1.0;
  bool interleave = true;
};
// Trees hold at most kMaxDdtreeBudget + 1 nodes (the root plus the budget): the device kernels keep
// a tree's bookkeeping in one block's shared memory.
constexpr int64_t kMaxDdtreeBudget = 1024;
struct DdtreeBuildArgs {
  Tensor draft_logits;  // f32 [L, V]
  int root = 0;
  int budget = 0;
  int64_t start = 0;    // position of the root
  Tensor tokens, parents, depths, positions, mask, size;  // i32 [B+1] x4, u8 [(B+1)^2], i32 [1]
  // Optional i32 [1] each, read on the device instead of root / start: the last step's bonus token
  // and the committed length, with no host round trip between steps.
  Tensor root_on_device, start_on_device;
  // Optional f32 [B+1] output: each node's cumulative draft log-probability in pop order (0 at the
  // root, -inf past `size`); pop order is best-first, so its prefixes are the best smaller trees.
  Tensor log_probs;
};
struct DdtreeAcceptArgs { Tensor tokens, parents, size, target_argmax, path, path_len, bonus; };
struct KvCommitArgs {
  std::vector<Tensor> caches;
  Tensor path, path_len;
  int64_t start = 0;
  Tensor start_on_device;  // optional i32 [1], read on the device instead of start
  Tensor next_start;       // optional i32 [1] output: start + path_len (may be start_on_device itself)
};
// out[i] = start (+ start_on_device[0]) + i, i32: a step's positions and cache slots from the
// committed length on the device; out may be start_on_device itself (a length moved on).
struct ArangeArgs { Tensor start_on_device, out; int64_t start = 0; };

}  // namespace kdtree
