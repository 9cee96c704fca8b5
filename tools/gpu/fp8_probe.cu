// The FP8 route to 3x over dense bf16 at 16 tokens (docs/gpu/notes.md, session 23) rested on three
// properties of Hopper's mma.sync.m16n8k32 with e4m3 operands that no document states. This probe
// measures them, for the owner's decision on the M = 16 target:
//  1. Codes: an int4 code u in 0..15 as an e4m3 byte is u x 2^-9 (subnormal below 8). With B = 1.0
//     and C = 0, D must be exactly 2^-9 x (the sum of a row's 32 codes).
//  2. Accumulation: with random e4m3 B (both signs, every finite exponent) and a C the size of the
//     per-group correction 8 x sum(x), how far D is from the exact sum, in units of the largest
//     term (full f32 accumulation: < 2^-23; DeepSeek-V3 reports ~14 bits kept by FP8 GEMMs on H800).
//  3. Rate: e4m3 m16n8k32 against the bf16 m16n8k16 the W4A16 kernels issue (and f16), per SM
//     and cycle, and the latency of each (one dependent chain per warp, one warp per SM
//     sub-partition).
// The exact sums are doubles on the host (every product and sum of these operands is exact there).
// Outcome (runs 308 and 311, session 24): 1 and 2 hold exactly (every output is the exact sum
// rounded once to f32) because on sm_90 ptxas lowers the e4m3 mma.sync to F2FP.F16.E4M3.UNPACK
// conversions and two f16 HMMA.16816 (run 310's SASS): there is no FP8 tensor-core path in
// mma.sync on Hopper, only in wgmma. In a kernel the conversions cost more than the dequantization
// they replace (run 309: 18432x7168 at 16 tokens 33.7 -> 50 us); the rate row of e4m3 here has them
// hoisted out of the loop, so it is not the rate a kernel sees.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/gpu/fp8_probe.cu -o /tmp/fp8_probe && /tmp/fp8_probe
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kM = 16, kN = 8, kK = 32;

// One MMA per warp and trial: A [16][32] and B [8][32] (k fastest) as e4m3 bytes, C and D [16][8].
// Fragments (PTX ISA, m16n8k32 with 8-bit types): lane = 4 g + t; A regs 0-3 hold rows g, g + 8, g,
// g + 8 at k 4t + {0..3}, 4t + {0..3}, 16 + 4t + {0..3}, 16 + 4t + {0..3}; B regs 0-1 hold column
// g at k 4t + {0..3} and 16 + 4t + {0..3}; C/D regs hold (g, 2t), (g, 2t + 1), (g + 8, 2t),
// (g + 8, 2t + 1). The host check below would show a wrong layout as large errors everywhere.
__global__ void OneMma(const uint8_t* a, const uint8_t* b, const float* c, float* d, int trials) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (warp >= trials) return;
  const uint8_t* A = a + static_cast<size_t>(warp) * kM * kK;
  const uint8_t* B = b + static_cast<size_t>(warp) * kN * kK;
  const float* C = c + static_cast<size_t>(warp) * kM * kN;
  float* D = d + static_cast<size_t>(warp) * kM * kN;
  uint32_t ar[4], br[2];
  std::memcpy(&ar[0], A + g * kK + 4 * t, 4);
  std::memcpy(&ar[1], A + (g + 8) * kK + 4 * t, 4);
  std::memcpy(&ar[2], A + g * kK + 16 + 4 * t, 4);
  std::memcpy(&ar[3], A + (g + 8) * kK + 16 + 4 * t, 4);
  std::memcpy(&br[0], B + g * kK + 4 * t, 4);
  std::memcpy(&br[1], B + g * kK + 16 + 4 * t, 4);
  float d0 = C[g * kN + 2 * t], d1 = C[g * kN + 2 * t + 1], d2 = C[(g + 8) * kN + 2 * t], d3 = C[(g + 8) * kN + 2 * t + 1];
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
               : "r"(ar[0]), "r"(ar[1]), "r"(ar[2]), "r"(ar[3]), "r"(br[0]), "r"(br[1]));
  D[g * kN + 2 * t] = d0;
  D[g * kN + 2 * t + 1] = d1;
  D[(g + 8) * kN + 2 * t] = d2;
  D[(g + 8) * kN + 2 * t + 1] = d3;
}

// Rate: one block of `warps` warps per SM, each warp `iters` rounds of kChains independent MMA
// chains (the operands stay in registers, given at run time so that nothing folds; only the issue
// rate and the tensor pipe are measured). With one chain and 4 warps, cycles per MMA is the MMA's
// latency. On sm_90 ptxas turns an e4m3 mma.sync into F2FP.F16.E4M3.UNPACK conversions and two f16
// HMMA.16816 (run 310's SASS); here the conversions of the loop-invariant operands are hoisted.
enum class Kind { kE4m3, kBf16, kF16 };
template <Kind kKind, int kChains>
__global__ void MmaRate(int iters, uint32_t a_bits, uint32_t b_bits, float* sink) {
  const uint32_t a0 = a_bits, a1 = a_bits ^ (threadIdx.x & 1), a2 = a_bits, a3 = a1, b0 = b_bits, b1 = b_bits;
  float acc[kChains][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      if constexpr (kKind == Kind::kE4m3) {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      } else if constexpr (kKind == Kind::kBf16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
  }
  float s = 0.f;
  for (int j = 0; j < kChains; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  if (s == 1234.5f) *sink = s;  // keeps the MMAs
}

double E4m3(uint8_t v) {
  const int sign = v >> 7, e = (v >> 3) & 15, m = v & 7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return sign ? -mag : mag;
}

struct Result {
  long long outputs = 0, inexact = 0;  // outputs not equal to the exact sum rounded to f32
  double worst = 0;                    // max |D - exact| / max |term| (terms: the products and C)
};

// trials warps of OneMma on A from `code`, B from `x`, C from `offset`; compared on the host.
template <typename CodeFn, typename XFn, typename OffsetFn>
Result Trial(int trials, CodeFn code, XFn x, OffsetFn offset) {
  std::vector<uint8_t> a(static_cast<size_t>(trials) * kM * kK), b(static_cast<size_t>(trials) * kN * kK);
  std::vector<float> c(static_cast<size_t>(trials) * kM * kN), d(c.size());
  for (auto& v : a) v = code();
  for (auto& v : b) v = x();
  for (auto& v : c) v = offset();
  uint8_t *da, *db;
  float *dc, *dd;
  CHECK(cudaMalloc(&da, a.size()));
  CHECK(cudaMalloc(&db, b.size()));
  CHECK(cudaMalloc(&dc, c.size() * 4));
  CHECK(cudaMalloc(&dd, d.size() * 4));
  CHECK(cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
  OneMma<<<(trials + 7) / 8, 256>>>(da, db, dc, dd, trials);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
  Result r;
  for (int w = 0; w < trials; ++w) {
    for (int i = 0; i < kM; ++i) {
      for (int j = 0; j < kN; ++j) {
        const double cv = c[(static_cast<size_t>(w) * kM + i) * kN + j];
        double exact = cv, largest = std::fabs(cv);
        for (int k = 0; k < kK; ++k) {
          const double p = E4m3(a[(static_cast<size_t>(w) * kM + i) * kK + k]) * E4m3(b[(static_cast<size_t>(w) * kN + j) * kK + k]);
          exact += p;
          largest = std::max(largest, std::fabs(p));
        }
        const float got = d[(static_cast<size_t>(w) * kM + i) * kN + j];
        ++r.outputs;
        if (got != static_cast<float>(exact)) ++r.inexact;
        if (largest > 0) r.worst = std::max(r.worst, std::fabs(got - exact) / largest);
      }
    }
  }
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dc));
  CHECK(cudaFree(dd));
  return r;
}

template <Kind kKind, int kChains = 4>
double MmasPerSmCycle(int sms, int clock_khz, uint32_t a_bits, uint32_t b_bits, int warps = 8) {
  const int iters = 1 << 16;
  float* sink;
  CHECK(cudaMalloc(&sink, 4));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  MmaRate<kKind, kChains><<<sms, warps * 32>>>(16, a_bits, b_bits, sink);  // warm-up
  CHECK(cudaEventRecord(start));
  MmaRate<kKind, kChains><<<sms, warps * 32>>>(iters, a_bits, b_bits, sink);
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaFree(sink));
  const double mmas_per_sm = static_cast<double>(iters) * kChains * warps;
  return mmas_per_sm / (ms * 1e-3 * clock_khz * 1e3);
}

// One row of the rate table: MMAs per SM and cycle with 4 chains x 8 warps, and the latency of a
// dependent chain (one warp per sub-partition: 4 MMAs in flight per SM, so latency = 4 / rate).
template <Kind kKind>
void RateRow(const char* what, int k, int sms, int clock_khz, uint32_t a_bits, uint32_t b_bits) {
  const double rate = MmasPerSmCycle<kKind>(sms, clock_khz, a_bits, b_bits);
  const double latency = 4 / MmasPerSmCycle<kKind, 1>(sms, clock_khz, a_bits, b_bits, 4);
  std::printf("| %s | %d | %.3f | %.1f |\n", what, k, rate, latency);
}

}  // namespace

int main() {
  int sms = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::mt19937 rng(7);
  const auto code = [&] { return static_cast<uint8_t>(rng() & 15); };
  const auto one = [] { return static_cast<uint8_t>(0x38); };
  const auto zero = [] { return 0.f; };
  const auto any_x = [&] {  // a finite e4m3 of either sign (0x7F / 0xFF are NaN)
    uint8_t v;
    do v = static_cast<uint8_t>(rng() & 0xFF); while ((v & 0x7F) == 0x7F);
    return v;
  };
  // C as large as a group's correction 8 x sum(x) gets with x scaled into e4m3's range (|x| <= 448)
  std::uniform_real_distribution<float> offset(-64.f, 64.f);
  const auto big_c = [&] { return std::ldexp(offset(rng), static_cast<int>(rng() % 9)); };
  const int trials = 4096;
  const Result codes = Trial(trials, code, one, zero);
  const Result wide = Trial(trials, code, any_x, zero);
  const Result with_c = Trial(trials, code, any_x, big_c);
  std::printf("## mma.sync.m16n8k32 e4m3 on %d SMs (%d trials of 16 x 8 outputs each)\n\n", sms, trials);
  std::printf("| operands | outputs | not the exact sum rounded to f32 | worst error / largest term |\n|---|---|---|---|\n");
  std::printf("| codes u x 2^-9 times 1.0, C = 0 | %lld | %lld | %.3g |\n", codes.outputs, codes.inexact, codes.worst);
  std::printf("| codes times random e4m3, C = 0 | %lld | %lld | %.3g |\n", wide.outputs, wide.inexact, wide.worst);
  std::printf("| codes times random e4m3, C = +-64 x 2^0..8 | %lld | %lld | %.3g |\n\n", with_c.outputs, with_c.inexact, with_c.worst);
  std::printf("| instruction, operands | k per MMA | MMAs per SM per cycle (at the reported %d MHz clock) | latency, cycles (a dependent chain) |\n|---|---|---|---|\n", clock_khz / 1000);
  RateRow<Kind::kE4m3>("e4m3 m16n8k32, 1.0 x 0.5", 32, sms, clock_khz, 0x38383838u, 0x30303030u);
  RateRow<Kind::kBf16>("bf16 m16n8k16, 1.0 x 0.5", 16, sms, clock_khz, 0x3F803F80u, 0x3F003F00u);
  RateRow<Kind::kF16>("f16 m16n8k16, 1.0 x 0.5", 16, sms, clock_khz, 0x3C003C00u, 0x38003800u);
  RateRow<Kind::kBf16>("bf16 m16n8k16, 2^-113 x 2^-15 (products below f32's normal range)", 16, sms, clock_khz, 0x07070707u, 0x38383838u);
  return 0;
}
