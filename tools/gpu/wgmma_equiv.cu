// Does Hopper's warpgroup MMA round like the warp MMA the W4A16 kernel uses? A 9+-token W4A16
// kernel on `wgmma` (x in shared memory, read by the tensor cores) keeps batch invariance with
// the `mma.sync` decode kernel only if, for the same operands, both give the same f32 bits. This
// checks that on the operands the kernel feeds them: A = exact int4 codes (-8..7) as bf16, B = bf16
// activations over a wide exponent range, f32 accumulation chained over 1-8 k16 slices (a group of
// 32-128 k starts fresh, then accumulates), B 8, 16 and 32 columns wide (the W4A16 warpgroup kernel,
// native/src/cuda/w4a16_wgmma.cu, runs m64n32k16).
//
// Per trial a warpgroup computes D[64 x N] = sum_s A_s[64 x 16] . B_s[16 x N] three ways:
// mma.sync.m16n8k16 (each warp its 16 rows, as the GEMM), wgmma.m64n8k16, m64n16k16 and m64n32k16
// (A from registers in the same fragments, B from shared memory through a no-swizzle descriptor),
// and compares the bits; a double-precision sum of the same products checks that the layouts are
// right (and the wider wgmmas' other columns, which mma.sync does not compute).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/gpu/wgmma_equiv.cu -o /tmp/wgmma_equiv && /tmp/wgmma_equiv [trials per block, 64]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

struct Counts {
  unsigned long long elements;       // compared f32 outputs (n8 columns)
  unsigned long long mma_vs_wg8;     // bit differences mma.sync vs wgmma n8
  unsigned long long mma_vs_wg16;    // ... vs wgmma n16 (its first 8 columns)
  unsigned long long mma_vs_wg32;     // ... vs wgmma n32 (its first 8 columns)
  unsigned long long wg16_hi_bad;    // wgmma n16 columns 8-15 off the double reference by > 1e-5 rel
  unsigned long long wg32_hi_bad;    // wgmma n32 columns 8-31 off it
  unsigned long long ref_bad;        // mma.sync off the double reference by > 1e-5 relative
};

__device__ __forceinline__ unsigned Hash(unsigned a, unsigned b, unsigned c, unsigned d) {
  unsigned h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du ^ (d + 0x27D4EB2Fu) * 0x94D049BBu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return h;
}
// A: an int4 code q in -8..7 (exact in bf16)
__device__ __forceinline__ float CodeAt(unsigned trial, int s, int row, int k) { return static_cast<float>(static_cast<int>(Hash(trial, s, row, k + 1000) & 15u) - 8); }
// B: a bf16 activation; even trials spread exponents over 2^-24..2^24, odd ones over 2^-6..2^3
__device__ __forceinline__ float XAt(unsigned trial, int s, int k, int n) {
  const unsigned h = Hash(trial, s, k + 5000, n);
  const int span = trial & 1 ? 10 : 49, lo = trial & 1 ? -6 : -24;
  const unsigned exp = static_cast<unsigned>(127 + lo + static_cast<int>((h >> 8) % span));
  const unsigned bits = (h & 0x8000u) << 16 | exp << 23 | (h & 0x7Fu) << 16;
  return __uint_as_float(bits);  // 8 significant bits: exact in bf16
}
__device__ __forceinline__ unsigned Pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned long long Descriptor(const void* smem, unsigned lbo, unsigned sbo) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) | static_cast<unsigned long long>(lbo >> 4) << 16 | static_cast<unsigned long long>(sbo >> 4) << 32;
}

__global__ void __launch_bounds__(128) EquivKernel(int trials, int steps, int control, Counts* out) {
  // B of one slice, no-swizzle core matrices (8 columns x 8 k, 16 bytes per column):
  // [k block 0..1][column block 0..3][8 columns][8 k]; n8 and n16 use the first column blocks
  __shared__ __align__(256) __nv_bfloat16 b_smem[2][4][8][8];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  Counts c{};
  for (int it = 0; it < trials; ++it) {
    const unsigned trial = blockIdx.x * trials + it;
    float dm[4] = {0, 0, 0, 0}, d8[4] = {0, 0, 0, 0}, d16[8] = {0, 0, 0, 0, 0, 0, 0, 0}, d32[16] = {};
    for (int s = 0; s < steps; ++s) {
      const int r0 = 16 * warp + g, r1 = r0 + 8;
      const unsigned a[4] = {Pack(CodeAt(trial, s, r0, 2 * t), CodeAt(trial, s, r0, 2 * t + 1)), Pack(CodeAt(trial, s, r1, 2 * t), CodeAt(trial, s, r1, 2 * t + 1)),
                             Pack(CodeAt(trial, s, r0, 2 * t + 8), CodeAt(trial, s, r0, 2 * t + 9)), Pack(CodeAt(trial, s, r1, 2 * t + 8), CodeAt(trial, s, r1, 2 * t + 9))};
      const unsigned b0 = Pack(XAt(trial, s, 2 * t, g), XAt(trial, s, 2 * t + 1, g)), b1 = Pack(XAt(trial, s, 2 * t + 8, g), XAt(trial, s, 2 * t + 9, g));
      // 512 elements of B (16 k x 32 columns), four per thread
      for (int e = tid; e < 512; e += 128) {
        const int k = e & 15, n = e >> 4;
        // control run: the tensor cores get B with its lowest bf16 bit flipped in one column
        const float v = XAt(trial, s, k, n);
        b_smem[k >> 3][n >> 3][n & 7][k & 7] = __float2bfloat16_rn(control && n == 3 && k == 5 ? __uint_as_float(__float_as_uint(v) ^ 0x10000u) : v);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> tensor core reads
      __syncthreads();
      if (s == 0) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                     : "=f"(dm[0]), "=f"(dm[1]), "=f"(dm[2]), "=f"(dm[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
      } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(dm[0]), "+f"(dm[1]), "+f"(dm[2]), "+f"(dm[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
      }
      // LBO: the next 8-k core matrix (one k block), SBO: the next 8 columns (one column block)
      const unsigned long long desc8 = Descriptor(&b_smem[0][0][0][0], sizeof(b_smem[0]), sizeof(b_smem[0][0]));
      const int accumulate = s > 0;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      asm volatile(
          "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
          " wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
          : "+f"(d8[0]), "+f"(d8[1]), "+f"(d8[2]), "+f"(d8[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc8), "r"(accumulate)
          : "memory");
      asm volatile(
          "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
          " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
          : "+f"(d16[0]), "+f"(d16[1]), "+f"(d16[2]), "+f"(d16[3]), "+f"(d16[4]), "+f"(d16[5]), "+f"(d16[6]), "+f"(d16[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc8), "r"(accumulate)
          : "memory");
      asm volatile(
          "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
          " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
          : "+f"(d32[0]), "+f"(d32[1]), "+f"(d32[2]), "+f"(d32[3]), "+f"(d32[4]), "+f"(d32[5]), "+f"(d32[6]), "+f"(d32[7]), "+f"(d32[8]), "+f"(d32[9]), "+f"(d32[10]),
            "+f"(d32[11]), "+f"(d32[12]), "+f"(d32[13]), "+f"(d32[14]), "+f"(d32[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc8), "r"(accumulate)
          : "memory");
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      __syncthreads();  // every warpgroup read of b_smem is done before the next slice's writes
    }
    // element i of a lane: row 16 warp + g + 8 (i >> 1), column 2 t + (i & 1); n16: i >= 4 -> column + 8
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + g + 8 * (i >> 1), col = 2 * t + (i & 1);
      double ref = 0, ref_hi = 0, mag = 0, mag_hi = 0;
      for (int s = 0; s < steps; ++s)
        for (int k = 0; k < 16; ++k) {
          const double p = static_cast<double>(CodeAt(trial, s, row, k)) * XAt(trial, s, k, col);
          const double q = static_cast<double>(CodeAt(trial, s, row, k)) * XAt(trial, s, k, col + 8);
          ref += p, mag += fabs(p), ref_hi += q, mag_hi += fabs(q);
        }
      ++c.elements;
      c.mma_vs_wg8 += __float_as_uint(dm[i]) != __float_as_uint(d8[i]);
      c.mma_vs_wg16 += __float_as_uint(dm[i]) != __float_as_uint(d16[i]);
      c.ref_bad += fabs(dm[i] - ref) > 1e-5 * mag + 1e-30;
      c.wg16_hi_bad += fabs(d16[4 + i] - ref_hi) > 1e-5 * mag_hi + 1e-30;
      // n32: element 4 j + i is column 8 j + 2 t + (i & 1)
      c.mma_vs_wg32 += __float_as_uint(dm[i]) != __float_as_uint(d32[i]);
      for (int j = 1; j < 4; ++j) {
        double r = 0, m = 0;
        for (int s = 0; s < steps; ++s)
          for (int k = 0; k < 16; ++k) {
            const double q = static_cast<double>(CodeAt(trial, s, row, k)) * XAt(trial, s, k, col + 8 * j);
            r += q, m += fabs(q);
          }
        c.wg32_hi_bad += fabs(d32[4 * j + i] - r) > 1e-5 * m + 1e-30;
      }
    }
  }
  atomicAdd(&out->elements, c.elements);
  atomicAdd(&out->mma_vs_wg8, c.mma_vs_wg8);
  atomicAdd(&out->mma_vs_wg16, c.mma_vs_wg16);
  atomicAdd(&out->wg16_hi_bad, c.wg16_hi_bad);
  atomicAdd(&out->mma_vs_wg32, c.mma_vs_wg32);
  atomicAdd(&out->wg32_hi_bad, c.wg32_hi_bad);
  atomicAdd(&out->ref_bad, c.ref_bad);
}

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 64;  // per block of one warpgroup, 264 blocks
  const int control = argc > 2 ? std::atoi(argv[2]) : 0;  // 1: perturb wgmma's B (must report differences)
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  Counts* d;
  CHECK(cudaMalloc(&d, sizeof(Counts)));
  std::printf("| k16 slices chained | outputs compared | mma.sync vs wgmma n8 (bits differ) | vs wgmma n16 | vs wgmma n32 | mma.sync off the double sum | wgmma n16 cols 8-15 off it | wgmma n32 cols 8-31 off it | ms |\n|---|---|---|---|---|---|---|---|---|\n");
  int status = 0;
  for (int steps : {1, 2, 4, 8}) {
    CHECK(cudaMemset(d, 0, sizeof(Counts)));
    CHECK(cudaEventRecord(e0));
    EquivKernel<<<264, 128>>>(trials, steps, control, d);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    Counts h;
    CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
    std::printf("| %d | %llu | %llu | %llu | %llu | %llu | %llu | %llu | %.1f |\n", steps, h.elements, h.mma_vs_wg8, h.mma_vs_wg16, h.mma_vs_wg32, h.ref_bad, h.wg16_hi_bad, h.wg32_hi_bad, ms);
    status |= h.mma_vs_wg8 || h.mma_vs_wg16 || h.mma_vs_wg32 || h.ref_bad || h.wg16_hi_bad || h.wg32_hi_bad;
  }
  return control ? !status : status;
}
