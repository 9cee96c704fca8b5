// MLA attention over the latent KV cache, in the absorbed form (DeepSeek-V3 / Kimi K2):
//   q_lat[t, h] = W_kb[h]^T q_nope[t, h]                       (R = kv_lora_rank values)
//   score_j     = (q_lat . c_j + q_pe . kpe_j) * scale          over the keys token t may see
//   ctx[t, h]   = sum_j softmax(score)_j c_j;   out[t, h] = W_vb[h] ctx[t, h]
// Keys: the `base` committed slots, then the new tokens the mask allows (causal without a mask;
// a DDTree verify passes the ancestor mask). Flash-decoding style: a token's key list is cut into
// fixed chunks, one block per (token, head, chunk), so a 4096-key decode fills the GPU instead of
// running H blocks; chunks combine in a fixed order, so a token's output depends only on the keys
// it sees (decode and tree verify give the same bits for the same prefix).
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kAttnWarps = 8;
constexpr int kAttnChunk = 64;    // keys per block: a token's keys split into fixed chunks of its key list
constexpr int kKeysPerStep = 4;   // keys a warp has in flight at once (independent loads and reductions)
constexpr int kMaxR = 1024;
constexpr int kQLatR = 32;        // q_lat values per block (one per lane)
constexpr int kQLatSplit = 8;     // warps per block, each summing dn / 8 of the terms
constexpr int kOutVPerBlock = 32;

// q_lat[th, r] = sum_i q_nope[th, i] kv_b[h * (dn + dv) + i, r]: a block owns 32 values of r (a
// warp's loads are 128 contiguous bytes of a kv_b row); its 8 warps split i and add up in warp
// order through shared memory (deterministic). One thread per r over all of i left 32 blocks on
// the GPU, each walking 128 rows: 54 us for a decode token (Nsight, run 50).
__global__ void __launch_bounds__(kQLatR * kQLatSplit) QLatentKernel(const float* q_nope, const void* kv_b, DType kvb_dtype, int H, int dn, int dv, int R, float* q_lat) {
  __shared__ float part[kQLatSplit][kQLatR];
  const int th = blockIdx.x, h = th % H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.y * kQLatR + lane;
  const float* q = q_nope + static_cast<int64_t>(th) * dn;
  const int64_t col = static_cast<int64_t>(h) * (dn + dv) * R + r;
  float s = 0.f;
  if (r < R) {
#pragma unroll 4
    for (int i = warp; i < dn; i += kQLatSplit) s = fmaf(q[i], LoadAsF32(kv_b, kvb_dtype, col + static_cast<int64_t>(i) * R), s);
  }
  part[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && r < R) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kQLatSplit; ++w) sum += part[w][lane];
    q_lat[static_cast<int64_t>(th) * R + r] = sum;
  }
}

// One block per (token, head, chunk of kAttnChunk keys); the token's key list is the `base`
// committed slots then the new tokens its mask row allows, in order. Warps take kKeysPerStep keys
// at a time round-robin, with an online softmax; the block's warps then combine in order 0..7 into
// a partial (m, l, acc[R]) for the chunk. Chunking depends only on the key list, so a token's bits
// do not depend on T or on the other tokens (decode and tree verify agree).
__global__ void __launch_bounds__(kAttnWarps * 32) AttendKernel(const float* q_lat, const float* q_pe, const float* cache_c, const float* cache_kpe,
                                                              const uint8_t* mask, int T, int H, int R, int dr, int64_t base, float scale, int max_chunks,
                                                              float* partial, int64_t* key_counts) {
  extern __shared__ float smem[];
  float* wctx = smem;                                      // [warps][R]
  float* wm = wctx + kAttnWarps * R;                       // [warps]
  float* wl = wm + kAttnWarps;                             // [warps]
  int* allowed = reinterpret_cast<int*>(wl + kAttnWarps);  // [T]
  __shared__ int warp_counts[kAttnWarps];
  const int th = blockIdx.x, t = th / H, chunk = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // ordered compaction of the new tokens this token sees (ballot + prefix over warps)
  int count = 0;
  for (int j0 = 0; j0 < T; j0 += blockDim.x) {
    const int j = j0 + threadIdx.x;
    const bool ok = j < T && (mask ? mask[static_cast<int64_t>(t) * T + j] != 0 : j <= t);
    const unsigned bal = __ballot_sync(0xffffffffu, ok);
    if (lane == 0) warp_counts[warp] = __popc(bal);
    __syncthreads();
    int before = count;
    for (int w = 0; w < warp; ++w) before += warp_counts[w];
    if (ok) allowed[before + __popc(bal & ((1u << lane) - 1))] = j;
    for (int w = 0; w < kAttnWarps; ++w) count += warp_counts[w];
    __syncthreads();
  }
  const int64_t keys = base + count;
  if (chunk == 0 && threadIdx.x == 0) key_counts[th] = keys;  // how many chunks the merge reads
  const int64_t k_begin = static_cast<int64_t>(chunk) * kAttnChunk;
  if (k_begin >= keys) return;  // this token has fewer chunks than the longest one
  const int64_t k_end = min(keys, k_begin + kAttnChunk);
  const float* ql = q_lat + static_cast<int64_t>(th) * R;
  const float* qp = q_pe + static_cast<int64_t>(th) * dr;
  const int per_lane = (R + 31) / 32;
  float acc[kMaxR / 32];
#pragma unroll
  for (int i = 0; i < kMaxR / 32; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t k0 = k_begin + warp * kKeysPerStep; k0 < k_end; k0 += kAttnWarps * kKeysPerStep) {
    const float* c[kKeysPerStep];
    const float* kp[kKeysPerStep];
    float dot[kKeysPerStep];
#pragma unroll
    for (int q = 0; q < kKeysPerStep; ++q) {
      const int64_t key = min(k0 + q, k_end - 1);  // past the end: a valid slot, masked below
      const int64_t slot = key < base ? key : base + allowed[key - base];
      c[q] = cache_c + slot * R;
      kp[q] = cache_kpe + slot * dr;
      dot[q] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kMaxR / 32; ++i) {
      const int r = lane + 32 * i;
      if (i < per_lane && r < R) {
        const float qv = ql[r];
#pragma unroll
        for (int q = 0; q < kKeysPerStep; ++q) dot[q] = fmaf(qv, c[q][r], dot[q]);
      }
    }
    for (int i = lane; i < dr; i += 32) {
      const float qv = qp[i];
#pragma unroll
      for (int q = 0; q < kKeysPerStep; ++q) dot[q] = fmaf(qv, kp[q][i], dot[q]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int q = 0; q < kKeysPerStep; ++q) dot[q] += __shfl_xor_sync(0xffffffffu, dot[q], off);
    }
    float sc[kKeysPerStep], m_new = m;
#pragma unroll
    for (int q = 0; q < kKeysPerStep; ++q) {
      sc[q] = k0 + q < k_end ? dot[q] * scale : -INFINITY;
      m_new = fmaxf(m_new, sc[q]);
    }
    const float keep = m == -INFINITY ? 0.f : expf(m - m_new);  // rescale what was accumulated
    float p[kKeysPerStep];
    l *= keep;
#pragma unroll
    for (int q = 0; q < kKeysPerStep; ++q) {
      p[q] = sc[q] == -INFINITY ? 0.f : expf(sc[q] - m_new);
      l += p[q];
    }
#pragma unroll
    for (int i = 0; i < kMaxR / 32; ++i) {
      const int r = lane + 32 * i;
      if (i < per_lane && r < R) {
        float a = acc[i] * keep;
#pragma unroll
        for (int q = 0; q < kKeysPerStep; ++q) a = fmaf(p[q], c[q][r], a);
        acc[i] = a;
      }
    }
    m = m_new;
  }
  for (int i = 0; i < per_lane; ++i) {
    const int r = lane + 32 * i;
    if (r < R) wctx[warp * R + r] = acc[i];
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
  __syncthreads();
  // combine the warps in order 0..7 into this chunk's partial: m, l, then acc[R] relative to m
  float mx = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, wm[w]);
  float* out = partial + (static_cast<int64_t>(th) * max_chunks + chunk) * (R + 2);
  if (threadIdx.x == 0) {
    float denom = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) denom += wm[w] == -INFINITY ? 0.f : wl[w] * expf(wm[w] - mx);
    out[0] = mx;
    out[1] = denom;
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float num = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) {
      if (wm[w] != -INFINITY) num = fmaf(expf(wm[w] - mx), wctx[w * R + r], num);
    }
    out[2 + r] = num;
  }
}

// Combines a token-head's chunks into ctx[R] (shared memory): warp 0 turns each chunk's (m, l)
// into its weight exp(m_c - max) / sum once, then every r is one pass over the chunks (the weights
// recomputed per thread and per r took 57 us for a decode token; Nsight, run 50). Then
// out[v] = W_vb[h, v] . ctx for kOutVPerBlock values of v, one warp per v at a time.
__global__ void __launch_bounds__(256) CombineOutKernel(const float* partial, const int64_t* key_counts, int max_chunks, int H, int R, const void* kv_b,
                                                        DType kvb_dtype, int dn, int dv, float* out) {
  extern __shared__ float shared[];
  float* ctx = shared;           // [R]
  float* weight = shared + R;    // [max_chunks]
  const int th = blockIdx.x, h = th % H;
  const int chunks = static_cast<int>((key_counts[th] + kAttnChunk - 1) / kAttnChunk);
  const float* p = partial + static_cast<int64_t>(th) * max_chunks * (R + 2);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float mx = -INFINITY;
    for (int c = lane; c < chunks; c += 32) mx = fmaxf(mx, p[c * (R + 2)]);
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float denom = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      const float mc = p[c * (R + 2)];
      if (mc != -INFINITY) denom += p[c * (R + 2) + 1] * expf(mc - mx);
    }
    for (int off = 16; off > 0; off >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, off);
    for (int c = lane; c < chunks; c += 32) {
      const float mc = p[c * (R + 2)];
      weight[c] = mc == -INFINITY ? 0.f : expf(mc - mx) / denom;
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float num = 0.f;
    for (int c = 0; c < chunks; ++c) num = fmaf(weight[c], p[c * (R + 2) + 2 + r], num);
    ctx[r] = num;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int v_end = min(dv, static_cast<int>(blockIdx.y + 1) * kOutVPerBlock);
  for (int v = blockIdx.y * kOutVPerBlock + warp; v < v_end; v += blockDim.x / 32) {
    const int64_t row = static_cast<int64_t>(h * (dn + dv) + dn + v) * R;
    float s = 0.f;
    for (int r = lane; r < R; r += 32) s = fmaf(LoadAsF32(kv_b, kvb_dtype, row + r), ctx[r], s);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) out[static_cast<int64_t>(th) * dv + v] = s;
  }
}

}  // namespace

Status LaunchMlaAttention(const MlaAttentionArgs& a, cudaStream_t s, Scratch& scratch) {
  const int T = static_cast<int>(a.q_nope.dim(0)), H = static_cast<int>(a.q_nope.dim(1)), dn = static_cast<int>(a.q_nope.dim(2));
  const int dr = static_cast<int>(a.q_pe.dim(2)), R = static_cast<int>(a.cache_c.dim(1)), dv = static_cast<int>(a.out.dim(2));
  const size_t smem = static_cast<size_t>(kAttnWarps) * R * 4 + 2 * kAttnWarps * 4 + static_cast<size_t>(T) * 4;
  if (smem > 200 * 1024) return Unsupported("mla_attention: ", T, " new tokens need more shared memory than a block has; split the call");
  const int max_chunks = static_cast<int>((a.base + T + kAttnChunk - 1) / kAttnChunk);
  if ((static_cast<size_t>(R) + max_chunks) * 4 > 48 * 1024) return Unsupported("mla_attention: ", a.base + T, " keys need more chunk weights than the merge keeps in shared memory (", (48 * 1024 / 4 - R) * kAttnChunk, " at most)");
  // scratch: key counts i64 [T * H], q_lat f32 [T * H, R], partial f32 [T * H, max_chunks, R + 2]
  const size_t q_lat_floats = static_cast<size_t>(T) * H * R;
  const size_t counts_bytes = (static_cast<size_t>(T) * H * sizeof(int64_t) + 255) / 256 * 256;
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(counts_bytes + (q_lat_floats + static_cast<size_t>(T) * H * max_chunks * (R + 2)) * sizeof(float), s));
  int64_t* key_counts = static_cast<int64_t*>(scratch.ptr);
  float* q_lat = reinterpret_cast<float*>(static_cast<char*>(scratch.ptr) + counts_bytes);
  float* partial = q_lat + q_lat_floats;
  const uint8_t* mask = a.mask.present() ? a.mask.as<const uint8_t>() : nullptr;
  QLatentKernel<<<dim3(T * H, (R + kQLatR - 1) / kQLatR), kQLatR * kQLatSplit, 0, s>>>(a.q_nope.as<const float>(), a.kv_b.data, a.kv_b.dtype, H, dn, dv, R, q_lat);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("mla q_latent"));
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(AttendKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend: shared memory"));
  AttendKernel<<<dim3(T * H, max_chunks), kAttnWarps * 32, smem, s>>>(q_lat, a.q_pe.as<const float>(), a.cache_c.as<const float>(), a.cache_kpe.as<const float>(), mask, T, H, R,
                                                                   dr, a.base, static_cast<float>(a.scale), max_chunks, partial, key_counts);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("mla attend"));
  CombineOutKernel<<<dim3(T * H, (dv + kOutVPerBlock - 1) / kOutVPerBlock), 256, (static_cast<size_t>(R) + max_chunks) * 4, s>>>(partial, key_counts, max_chunks, H, R, a.kv_b.data, a.kv_b.dtype,
                                                                                                             dn, dv, a.out.as<float>());
  return LaunchStatus("mla combine + out");
}

}  // namespace cuda
}  // namespace kdtree
