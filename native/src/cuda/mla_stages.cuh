// The stages of MLA attention and what passes between them: their entry points, which
// mla_attention.cu calls in order (one file per stage; a stage's device pieces stay in its file):
//   1 q absorption  q_nope f32 [T, H, dn] -> q_lat f32 [T H, R]                  mla_q_absorb*.cu
//   2 attend        q_lat, q_pe f32 [T H, dr], latent cache -> partial f32 [T H, max_chunks, R + 2]
//                   (per row and chunk of 64 keys: m, l, R context values)      mla_attend*.cu
//   3 merge         partial -> ctx f32 [T H, R], or with many rows straight to out   mla_merge.cu
//   4 projection    ctx -> out [T, H, dv] (f32 or bf16)                          mla_project*.cu
// Each stage has a CUDA-core form and a tensor-core form (the *_mma files, for bf16 operands); the
// chunking and the key counts the attend and merge kernels share are in mla_chunk.cuh.
#pragma once
#include "mla_chunk.cuh"

namespace kdtree {
namespace cuda {
namespace mla {

// ---- 1. q absorption ----

// On CUDA cores (mla_q_absorb.cu): any kv_b dtype and alignment.
Status LaunchQLatent(const float* q_nope, const void* kv_b, DType kvb_dtype, int T, int H, int dn, int dv, int R, float* q_lat, cudaStream_t s);
// On tensor cores (mla_q_absorb_mma.cu): whether it takes this call (bf16 kv_b,
// dn a multiple of 16 up to 128, R a multiple of 8, aligned rows), and its launch; otherwise
// LaunchQLatent. Either way a token's q_lat does not depend on the others.
bool QLatentMmaFits(const void* kv_b, DType kvb_dtype, const float* q_nope, int dn, int R);
Status LaunchQLatentMma(const float* q_nope, const __nv_bfloat16* kv_b, int T, int H, int dn, int dv, int R, float* q_lat, cudaStream_t s);

// ---- 2. attend ----

// The key counts of a masked call on the CUDA-core path, into counts [T H] (KeyCounts::counts).
Status LaunchKeyCounts(const uint8_t* mask, int T, int H, int64_t base, const int32_t* base_on_device, int64_t* counts, cudaStream_t s);

// On CUDA cores (mla_attend.cu), for an f32 or bf16 cache (CacheT).
template <typename CacheT>
struct AttendArgs {
  const float *q_lat, *q_pe;
  const CacheT *cache_c, *cache_kpe;
  const uint8_t* mask;
  int T, H, R, dr;
  int64_t base;
  float scale;
  int max_chunks;
  KeyCounts key_counts;
  float* partial;
};
// Every row's chunks: the first `shared_chunks` shared by all rows, the next `token_chunks` looked
// up per token through the mask. Defined for CacheT float and __nv_bfloat16.
template <typename CacheT>
Status LaunchAttend(const AttendArgs<CacheT>& args, int shared_chunks, int token_chunks, int sms, cudaStream_t s);

// On tensor cores (mla_attend_mma.cu), for a bf16 cache. A chunk's partial for one token-head row:
// [m, l, R context values] at partial[(th * max_chunks + chunk) * (R + 2)].
struct AttendMmaArgs {
  const float *q_lat, *q_pe;                   // [T H, R], [T H, dr] (f32)
  const __nv_bfloat16 *cache_c, *cache_kpe;    // [slots, R], [slots, dr]
  const uint8_t* mask;                          // [T, T] or null (causal)
  int T, H, R, dr;
  int64_t base;
  float scale;
  int max_chunks;
  KeyCounts key_counts;
  float* partial;                               // [T H, max_chunks, R + 2]
};
// Whether the tensor-core kernel takes this call (bf16 cache, rows in whole 8-byte pieces, the
// chunk and a tile's q in shared memory).
bool AttendMmaFits(const AttendMmaArgs& a);
// Runs every row's chunks (the first `shared_chunks` shared by all rows, the next `token_chunks`
// looked up per token through the mask) on a device of `sms` SMs.
Status LaunchAttendMma(const AttendMmaArgs& a, int shared_chunks, int token_chunks, int sms, cudaStream_t s);

// ---- 3. merge (mla_merge.cu) ----

// Many rows: each row's chunks merged and projected to out in one kernel (the tensor-core
// projection where project_mma; ctx rows ctx_stride floats apart in shared memory).
Status LaunchMergeOut(const float* partial, KeyCounts key_counts, int max_chunks, int T, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, OutRows out,
                      bool project_mma, int ctx_stride, int sms, cudaStream_t s);
// Few rows: each of the `rows` rows' chunks merged into ctx [rows, R]; stage 4 follows.
Status LaunchMergeContext(const float* partial, KeyCounts key_counts, int max_chunks, int rows, int R, float* ctx, cudaStream_t s);

// ---- 4. projection of few rows ----

// On CUDA cores (mla_project.cu). The tensor-core form, ProjectMmaFits and LaunchProjectOutMma, is
// declared with its device pieces in mla_project_mma.cuh (the many-row merge runs them too).
Status LaunchProjectOut(const float* ctx, int T, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, OutRows out, cudaStream_t s);

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
