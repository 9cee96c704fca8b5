// The small ops of a forward pass: embedding, RMSNorm, RoPE/YaRN, SiLU-and-multiply, residual
// add, the MoE router, argmax and top-k, and the latent-cache write. Reductions use fixed trees
// (no atomics), so every result is deterministic and independent of the batch.
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

// Block-wide sum in a fixed order (warp trees, then warp 0 over the warp sums).
__device__ float BlockSum(float v, float* shared32) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) shared32[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x + 31) / 32; ++w) total += shared32[w];
    shared32[0] = total;
  }
  __syncthreads();
  total = shared32[0];
  __syncthreads();
  return total;
}

__global__ void EmbeddingKernel(const void* table, DType dtype, int64_t rows, int H, const int32_t* ids, float* out) {
  PdlWait();
  PdlLaunchDependents();
  const int t = blockIdx.x;
  const int id = ids[t];
  for (int j = threadIdx.x; j < H; j += blockDim.x) {
    out[static_cast<int64_t>(t) * H + j] = id >= 0 && id < rows ? LoadAsF32(table, dtype, static_cast<int64_t>(id) * H + j) : 0.f;
  }
}

__global__ void RmsNormKernel(const float* x, const void* w, DType wt, int H, float eps, float* out) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float red[32];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * H;
  float ss = 0.f;
  for (int j = threadIdx.x; j < H; j += blockDim.x) ss = fmaf(row[j], row[j], ss);
  ss = BlockSum(ss, red);
  const float inv = 1.f / sqrtf(ss / static_cast<float>(H) + eps);
  for (int j = threadIdx.x; j < H; j += blockDim.x) out[static_cast<int64_t>(blockIdx.x) * H + j] = row[j] * inv * LoadAsF32(w, wt, j);
}

// Angles in f64: position x inv_freq reaches ~1e5 rad at long context, beyond f32's precision.
__global__ void RopeKernel(float* x, const int32_t* pos, const double* inv_freq, int T, int heads, int hd, int half, int64_t offset, double factor, bool interleave) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * heads * half) return;
  const int f = static_cast<int>(i % half);
  const int64_t th = i / half;
  const int t = static_cast<int>(th / heads);
  double sn, cs;
  sincos(static_cast<double>(pos[t]) * inv_freq[f], &sn, &cs);
  cs *= factor;
  sn *= factor;
  float* v = x + th * hd + offset;
  const int a = interleave ? 2 * f : f, b = interleave ? 2 * f + 1 : f + half;
  const double x0 = v[a], x1 = v[b];
  v[a] = static_cast<float>(x0 * cs - x1 * sn);
  v[b] = static_cast<float>(x1 * cs + x0 * sn);
}

__global__ void SiluMulKernel(const void* x, DType xt, int64_t T, int I, void* out, DType ot) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * I) return;
  const int64_t r = i / I, j = i % I;
  StoreFromF32(out, ot, i, SiluMulValue(LoadAsF32(x, xt, r * 2 * I + j), LoadAsF32(x, xt, r * 2 * I + I + j)));
}

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// One block per token; the selection itself is sequential (<= 1024 experts x <= 32 picks) on
// thread 0: simple, deterministic, and tiny next to the expert GEMMs it feeds.
__global__ void RouterKernel(const float* logits, const float* bias, int E, int topk, int n_group, int topk_group, bool norm, float scaling,
                             int32_t* ids, float* weights) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float score[1024], choice[1024];
  __shared__ unsigned char allowed[1024];
  const int t = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    score[e] = 1.f / (1.f + expf(-logits[static_cast<int64_t>(t) * E + e]));
    choice[e] = score[e] + bias[e];
    allowed[e] = n_group == 1;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (n_group > 1) {
    const int per = E / n_group;
    float gscore[64];
    for (int g = 0; g < n_group && g < 64; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (choice[e] > b1) { b2 = b1; b1 = choice[e]; } else if (choice[e] > b2) b2 = choice[e];
      }
      gscore[g] = b1 + b2;
    }
    for (int pick = 0; pick < topk_group; ++pick) {
      int best = -1;
      for (int g = 0; g < n_group; ++g) if (gscore[g] != -INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
      gscore[best] = -INFINITY;
      for (int e = best * per; e < (best + 1) * per; ++e) allowed[e] = 1;
    }
  }
  int chosen[32];
  for (int pick = 0; pick < topk; ++pick) {
    int best = -1;
    for (int e = 0; e < E; ++e) if (allowed[e] == 1 && (best < 0 || choice[e] > choice[best])) best = e;
    chosen[pick] = best;
    allowed[best] = 2;  // taken
  }
  for (int i = 1; i < topk; ++i) {  // ascending expert ids: the order their outputs are summed in
    const int v = chosen[i];
    int j = i - 1;
    while (j >= 0 && chosen[j] > v) { chosen[j + 1] = chosen[j]; --j; }
    chosen[j + 1] = v;
  }
  float sum = 0.f;
  for (int i = 0; i < topk; ++i) sum += score[chosen[i]];
  for (int i = 0; i < topk; ++i) {
    float w = score[chosen[i]];
    if (norm) w = w / (sum + 1e-20f);
    ids[static_cast<int64_t>(t) * topk + i] = chosen[i];
    weights[static_cast<int64_t>(t) * topk + i] = w * scaling;
  }
}

// argmax per row: the largest value, the lowest index among equal ones.
__global__ void ArgmaxKernel(const float* x, int64_t V, int32_t* out) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float bv[1024];
  __shared__ int bi[1024];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * V;
  float best = -INFINITY;
  int idx = -1;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    if (idx < 0 || row[i] > best) {
      best = row[i];
      idx = static_cast<int>(i);
    }
  }
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float ov = bv[threadIdx.x + stride];
      const int oi = bi[threadIdx.x + stride];
      if (oi >= 0 && (bi[threadIdx.x] < 0 || ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x]))) {
        bv[threadIdx.x] = ov;
        bi[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

// f32 rows into an f32 or bf16 cache (rounded to nearest even, as @kdtree/format does).
__global__ void KvWriteKernel(const float* c, const float* kpe, void* cache_c, void* cache_kpe, DType cache_dtype, const int32_t* slots, int T, int R, int dr, int64_t S) {
  PdlWait();
  PdlLaunchDependents();
  const int t = blockIdx.x;
  const int slot = slots[t];
  if (slot < 0 || slot >= S) return;  // out-of-range slots are not written
  for (int j = threadIdx.x; j < R; j += blockDim.x) StoreFromF32(cache_c, cache_dtype, static_cast<int64_t>(slot) * R + j, c[static_cast<int64_t>(t) * R + j]);
  for (int j = threadIdx.x; j < dr; j += blockDim.x) StoreFromF32(cache_kpe, cache_dtype, static_cast<int64_t>(slot) * dr + j, kpe[static_cast<int64_t>(t) * dr + j]);
}

unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace

Status LaunchEmbedding(const EmbeddingArgs& a, cudaStream_t s) {
  if (a.ids.dim(0) == 0) return Status::Ok();
  return LaunchPdl("embedding", EmbeddingKernel, dim3(static_cast<unsigned>(a.ids.dim(0))), dim3(256), 0, s, a.table.data, a.table.dtype, a.table.dim(0),
                   static_cast<int>(a.table.dim(1)), a.ids.as<const int32_t>(), a.out.as<float>());
}
Status LaunchRmsNorm(const RmsNormArgs& a, cudaStream_t s) {
  if (a.x.dim(0) == 0) return Status::Ok();
  return LaunchPdl("rms_norm", RmsNormKernel, dim3(static_cast<unsigned>(a.x.dim(0))), dim3(256), 0, s, a.x.as<const float>(), a.weight.data, a.weight.dtype,
                   static_cast<int>(a.x.dim(1)), static_cast<float>(a.eps), a.out.as<float>());
}
Status LaunchRope(const RopeArgs& a, cudaStream_t s) {
  const int64_t n = a.x.dim(0) * a.x.dim(1) * a.inv_freq.dim(0);
  if (n == 0) return Status::Ok();
  return LaunchPdl("rope", RopeKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, a.x.as<float>(), a.positions.as<const int32_t>(), a.inv_freq.as<const double>(),
                   static_cast<int>(a.x.dim(0)), static_cast<int>(a.x.dim(1)), static_cast<int>(a.x.dim(2)), static_cast<int>(a.inv_freq.dim(0)), a.offset,
                   a.attention_factor, a.interleave);
}
Status LaunchSiluMul(const SiluMulArgs& a, cudaStream_t s) {
  const int64_t n = a.out.numel();
  if (n == 0) return Status::Ok();
  return LaunchPdl("silu_mul", SiluMulKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, static_cast<const void*>(a.x.data), a.x.dtype, a.out.dim(0), static_cast<int>(a.out.dim(1)),
                   a.out.data, a.out.dtype);
}
Status LaunchAdd(const AddArgs& a, cudaStream_t s) {
  const int64_t n = a.out.numel();
  if (n == 0) return Status::Ok();
  return LaunchPdl("add", AddKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, a.a.as<const float>(), a.b.as<const float>(), a.out.as<float>(), n);
}
Status LaunchRouter(const RouterArgs& a, cudaStream_t s) {
  if (a.logits.dim(0) == 0) return Status::Ok();
  if (a.n_group > 64) return Unsupported("router: up to 64 expert groups are supported, got ", a.n_group);
  return LaunchPdl("router", RouterKernel, dim3(static_cast<unsigned>(a.logits.dim(0))), dim3(256), 0, s, a.logits.as<const float>(), a.bias.as<const float>(),
                   static_cast<int>(a.logits.dim(1)), a.topk, a.n_group, a.topk_group, a.norm_topk_prob, static_cast<float>(a.scaling), a.ids.as<int32_t>(),
                   a.weights.as<float>());
}
Status LaunchArgmax(const ArgmaxArgs& a, cudaStream_t s) {
  if (a.x.dim(0) == 0) return Status::Ok();
  return LaunchPdl("argmax", ArgmaxKernel, dim3(static_cast<unsigned>(a.x.dim(0))), dim3(1024), 0, s, a.x.as<const float>(), a.x.dim(1), a.out.as<int32_t>());
}
Status LaunchTopk(const TopkArgs& a, cudaStream_t s, Scratch& scratch) {
  if (a.x.dim(0) == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(TopkScratchBytes(a.x.dim(0), a.k, a.x.dim(1)), s));
  return LaunchRowTopk(a.x.as<const float>(), a.x.dim(0), a.x.dim(1), a.k, a.values.as<float>(), a.ids.as<int32_t>(), scratch.ptr, s);
}
Status LaunchKvWrite(const KvWriteArgs& a, cudaStream_t s) {
  if (a.c.dim(0) == 0) return Status::Ok();
  return LaunchPdl("kv_write", KvWriteKernel, dim3(static_cast<unsigned>(a.c.dim(0))), dim3(256), 0, s, a.c.as<const float>(), a.kpe.as<const float>(), a.cache_c.data,
                   a.cache_kpe.data, a.cache_c.dtype, a.slots.as<const int32_t>(), static_cast<int>(a.c.dim(0)), static_cast<int>(a.c.dim(1)), static_cast<int>(a.kpe.dim(1)),
                   a.cache_c.dim(0));
}

}  // namespace cuda
}  // namespace kdtree
