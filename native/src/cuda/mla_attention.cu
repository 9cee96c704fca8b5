// MLA attention over the latent KV cache, in the absorbed form (DeepSeek-V3 / Kimi K2):
//   q_lat[t, h] = W_kb[h]^T q_nope[t, h]                       (R = kv_lora_rank values)
//   score_j     = (q_lat . c_j + q_pe . kpe_j) * scale          over the keys token t may see
//   ctx[t, h]   = sum_j softmax(score)_j c_j;   out[t, h] = W_vb[h] ctx[t, h]
// Keys: the `base` committed slots, then the new tokens the mask allows (causal without a mask;
// a DDTree verify passes the ancestor mask). Flash-decoding style: a token's key list is cut into
// fixed chunks, a block per (chunk, tile of token-head rows), so a 4096-key decode fills the GPU
// instead of running H blocks; chunks combine in a fixed order, so a token's output depends only
// on the keys it sees (decode and tree verify give the same bits for the same prefix).
//
// The call runs as four stages, one file each (mla_stages.cuh declares them and what passes
// between them); this file holds the scratch they share and which form of each stage runs:
//   q absorption  mla_q_absorb.cu, mla_q_absorb_mma.cu   q_nope [T, H, dn] -> q_lat [T H, R]
//   attend        mla_attend.cu, mla_attend_mma.cu       q_lat, q_pe, cache -> partial
//                                                          [T H, chunks, R + 2]
//   merge         mla_merge.cu                           partial -> ctx [T H, R] (many rows: out)
//   projection    mla_project.cu, mla_project_mma.cu     ctx -> out [T, H, dv]
// A form is chosen by what the call is (dtypes, alignment, shared memory, row count), never by
// the values; the forms chosen by row count give a row the same bits, so tree verify equals
// decoding. Each rule is a kernel's precondition or sits beside the launch it shapes.
#include "mla_project_mma.cuh"
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kCombineAloneRows = 128;  // from this many rows, one merge kernel (mla_merge.cu's CombineOutKernel) instead of two

}  // namespace

Status LaunchMlaAttention(const MlaAttentionArgs& a, cudaStream_t s, Scratch& scratch, int sms) {
  const int T = static_cast<int>(a.q_nope.dim(0)), H = static_cast<int>(a.q_nope.dim(1)), dn = static_cast<int>(a.q_nope.dim(2));
  const int dr = static_cast<int>(a.q_pe.dim(2)), R = static_cast<int>(a.cache_c.dim(1)), dv = static_cast<int>(a.out.dim(2));
  const int max_chunks = static_cast<int>((a.base + T + mla::kAttnChunk - 1) / mla::kAttnChunk);
  // every call with this kv_b takes the same projection: rows keep their bits
  const bool project_mma = mla::ProjectMmaFits(a.kv_b.data, a.kv_b.dtype, R);
  const int ctx_stride = project_mma ? R + 4 : R;  // floats per ctx row in the merge's shared memory
  if ((static_cast<size_t>(ctx_stride) + max_chunks) * 4 > 48 * 1024) return Unsupported("mla_attention: ", a.base + T, " keys need more chunk weights than the merge keeps in shared memory (", (48 * 1024 / 4 - ctx_stride) * mla::kAttnChunk, " at most)");
  // scratch: q_lat f32 [T * H, R], ctx f32 [T * H, R] (the two-kernel merge; on 16 bytes where R is
  // a multiple of 4, as the tensor-core projection reads it), partial f32 [T * H, max_chunks, R + 2],
  // key counts i64 [T * H] (KeyCounts)
  const size_t q_lat_floats = static_cast<size_t>(T) * H * R, partial_floats = static_cast<size_t>(T) * H * max_chunks * (R + 2);
  const size_t floats_bytes = (2 * q_lat_floats + partial_floats) * sizeof(float), counts_offset = (floats_bytes + 255) / 256 * 256;
  const uint8_t* mask = a.mask.present() ? a.mask.as<const uint8_t>() : nullptr;
  mla::AttendMmaArgs mma{nullptr, a.q_pe.as<const float>(), nullptr, nullptr, mask, T, H, R, dr, a.base, static_cast<float>(a.scale), max_chunks, {}, nullptr};
  bool tensor_cores = false;
  if (a.cache_c.dtype == DType::kBF16) {
    mma.cache_c = a.cache_c.as<const __nv_bfloat16>();
    mma.cache_kpe = a.cache_kpe.as<const __nv_bfloat16>();
    tensor_cores = mla::AttendMmaFits(mma);
  }
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(counts_offset + (mask && !tensor_cores ? static_cast<size_t>(T) * H * sizeof(int64_t) : 0), s));
  float* q_lat = static_cast<float*>(scratch.ptr);
  float* ctx = q_lat + q_lat_floats;
  float* partial = ctx + q_lat_floats;
  // counted by a kernel only with a mask on the CUDA-core path
  int64_t* counts = mask && !tensor_cores ? reinterpret_cast<int64_t*>(static_cast<char*>(scratch.ptr) + counts_offset) : nullptr;
  const int32_t* base_on_device = OnDevice(a.base_on_device);
  const mla::KeyCounts key_counts{counts, mask, T, H, a.base, base_on_device};
  if (mla::QLatentMmaFits(a.kv_b.data, a.kv_b.dtype, a.q_nope.as<const float>(), dn, R)) {
    KDTREE_RETURN_IF_ERROR(mla::LaunchQLatentMma(a.q_nope.as<const float>(), static_cast<const __nv_bfloat16*>(a.kv_b.data), T, H, dn, dv, R, q_lat, s));
  } else {
    KDTREE_RETURN_IF_ERROR(mla::LaunchQLatent(a.q_nope.as<const float>(), static_cast<const void*>(a.kv_b.data), a.kv_b.dtype, T, H, dn, dv, R, q_lat, s));
  }
  if (counts) KDTREE_RETURN_IF_ERROR(mla::LaunchKeyCounts(mask, T, H, a.base, base_on_device, counts, s));
  // Causal, every chunk is shared by all rows. With a mask the committed prefix's chunks are, and
  // the chunks from the committed slots' one are looked up per token: with the committed slots on
  // the device, as many as T new keys can touch from any start (the kernels find where they begin).
  const int shared_chunks = mask ? static_cast<int>(a.base / mla::kAttnChunk) : max_chunks;
  const int token_chunks = !mask ? 0 : base_on_device ? std::min(max_chunks, (T + mla::kAttnChunk - 1) / mla::kAttnChunk + 1) : max_chunks - shared_chunks;
  if (tensor_cores) {  // every call on this cache takes the same path: rows keep their bits
    mma.q_lat = q_lat;
    mma.key_counts = key_counts;
    mma.partial = partial;
    KDTREE_RETURN_IF_ERROR(mla::LaunchAttendMma(mma, shared_chunks, token_chunks, sms, s));
  } else if (a.cache_c.dtype == DType::kBF16) {
    const mla::AttendArgs<__nv_bfloat16> args{q_lat, a.q_pe.as<const float>(), a.cache_c.as<const __nv_bfloat16>(), a.cache_kpe.as<const __nv_bfloat16>(), mask, T, H, R, dr, a.base,
                                         static_cast<float>(a.scale), max_chunks, key_counts, partial};
    KDTREE_RETURN_IF_ERROR(mla::LaunchAttend(args, shared_chunks, token_chunks, sms, s));
  } else {
    const mla::AttendArgs<float> args{q_lat, a.q_pe.as<const float>(), a.cache_c.as<const float>(), a.cache_kpe.as<const float>(), mask, T, H, R, dr, a.base, static_cast<float>(a.scale),
                                 max_chunks, key_counts, partial};
    KDTREE_RETURN_IF_ERROR(mla::LaunchAttend(args, shared_chunks, token_chunks, sms, s));
  }
  // kv_b rows read 8 values per load when every row starts on 16 bytes
  const bool vector_rows = R % 8 == 0 && reinterpret_cast<uintptr_t>(a.kv_b.data) % 16 == 0;
  const OutRows out{a.out.data, a.out.dtype};
  // many rows: merged and projected in one kernel; few rows: merged into ctx, then projected
  if (T * H >= kCombineAloneRows) return mla::LaunchMergeOut(partial, key_counts, max_chunks, T, H, R, a.kv_b.data, a.kv_b.dtype, vector_rows, dn, dv, out, project_mma, ctx_stride, sms, s);
  KDTREE_RETURN_IF_ERROR(mla::LaunchMergeContext(partial, key_counts, max_chunks, T * H, R, ctx, s));
  if (project_mma) return mla::LaunchProjectOutMma(ctx, static_cast<const __nv_bfloat16*>(a.kv_b.data), T, H, R, dn, dv, out, s);
  return mla::LaunchProjectOut(ctx, T, H, R, a.kv_b.data, a.kv_b.dtype, vector_rows, dn, dv, out, s);
}

}  // namespace cuda
}  // namespace kdtree
