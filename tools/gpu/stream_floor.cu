// What a pure read stream can reach on this GPU: the floor under the W4A16 decode GEMM, measured
// the way tools/gpu/bench.ts times the GEMM (back-to-back launches on a held stream, weights
// rotating over copies larger than L2, programmatic dependent launch), on the bytes of the
// benchmark's shapes (packed int4 codes + bf16 scales).
//
// Each warp reads 1 KB "steps" (two 16-byte loads per lane, a warp load = 512 contiguous bytes),
// three steps in flight, as the W4A16 kernel does. Configurations (see `configs` in main):
//   ranges   warp w reads one contiguous range of steps: stream-K over the tile-major packed
//            layout, W4A16's pattern (2112 warps = 2112 fronts through memory)
//   sweep    warp w reads steps w, w + W, w + 2W, ...: all warps advance through one window
//   tiles    a step-major layout [step][tile] with K cut into segments: warp (tile, segment)
//            reads step s of its tile at (s * tiles + tile) KB
//   groups   a layout of rows of 8 steps (8 adjacent tiles at one k: [tile group][step][8] KB);
//            8 consecutive warps read one range of rows, warp w its column w, so at each step
//            they read 8 adjacent KB (2112 warps = 264 fronts of 8 KB)
//   and, on the ranges pattern, what W4A16 adds beyond reading: 4 blocks per SM of either launch
//   (its 128 registers per thread leave no room for the next launch's blocks), and the split-tile
//   fixup at the end of each range (park a partial, fence, count in, the last sums).
// It also records when each warp ends, to show the tail.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 tools/gpu/stream_floor.cu -o /tmp/stream_floor && /tmp/stream_floor
#include <cuda_runtime.h>

#include "cuda_check.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kRing = 3;
constexpr int kWarpsPerBlock = 4;

enum Pattern { kRanges, kSweep, kTiles, kGroups };

struct Args {
  const uint4* w;
  long long steps;  // 1 KB each
  int warps;
  int tiles;        // kTiles: rows of 16 (steps = tiles * k_steps)
  unsigned* sink;
  unsigned long long* times;  // [warps][2] globaltimer at start and end
  int epilogue;               // 0 none; 1 split-tile fixup as W4A16 does it; 2 the same with acq_rel ordering
  float* partial;             // [warps][2 slots][128 floats]
  int* tile_counters;         // [warps] arrivals per shared tile (warp w's last = warp w + 1's first)
  float* out;                 // [warps][128]
};

__device__ __forceinline__ uint4 LoadStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned long long Now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The sequence of steps one warp reads: arithmetic runs (ranges, sweep: one; tiles: one per unit).
template <int P>
struct Cursor {
  long long next = -1, end = 0, stride = 1;
  int unit = 0, seg_len = 0, segs = 0, k_steps = 0;
  __device__ void Init(const Args& a, int w) {
    if (P == kRanges) {
      const long long len = (a.steps + a.warps - 1) / a.warps;
      next = w * len;
      end = min(a.steps, next + len);
    } else if (P == kSweep) {
      next = w;
      end = a.steps;
      stride = a.warps;
    } else if (P == kGroups) {
      const long long rows = (a.steps + 7) / 8, groups = (a.warps + 7) / 8;
      const long long len = (rows + groups - 1) / groups;
      const long long r0 = (w / 8) * len, r1 = min(rows, r0 + len);
      next = r0 * 8 + w % 8;
      end = min(a.steps, r1 * 8);
      stride = 8;
    } else {
      k_steps = static_cast<int>(a.steps / a.tiles);
      segs = (a.warps + a.tiles - 1) / a.tiles;
      seg_len = (k_steps + segs - 1) / segs;
      unit = w;
      StartTileUnit(a);
    }
  }
  __device__ void StartTileUnit(const Args& a) {  // unit = (segment, tile) index, or past the end
    const long long units = static_cast<long long>(a.tiles) * segs;
    while (unit < units) {
      const int tile = unit % a.tiles, seg = unit / a.tiles;
      const int s0 = seg * seg_len, s1 = min(k_steps, s0 + seg_len);
      if (s0 < s1) {
        next = static_cast<long long>(s0) * a.tiles + tile;
        end = static_cast<long long>(s1) * a.tiles + tile;
        stride = a.tiles;
        return;
      }
      unit += a.warps;
    }
    next = end = 0;
  }
  // The next step to load, or -1 when done.
  __device__ long long Take(const Args& a) {
    if (next < end) {
      const long long s = next;
      next += stride;
      return s;
    }
    if (P == kTiles) {
      unit += a.warps;
      StartTileUnit(a);
      return next < end ? Take(a) : -1;
    }
    return -1;
  }
};

// The end of a W4A16 stream-K range: warp w shares its first tile with warp w - 1 and its last
// with warp w + 1. It parks a 512-byte partial per shared tile, fences, counts itself in, and the
// second to arrive sums both partials and stores the tile (16 rows x 8 tokens of f32).
__device__ void Arrive(const Args& a, int counter, int mine, int other, int lane) {
  int arrived = 0;
  if (lane == 0) {
    if (a.epilogue == 1) {
      arrived = atomicAdd(&a.tile_counters[counter], 1);
    } else {
      asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;\n" : "=r"(arrived) : "l"(&a.tile_counters[counter]) : "memory");
    }
  }
  arrived = __shfl_sync(0xffffffffu, arrived, 0);
  if (arrived != 1) return;
  if (a.epilogue == 1) __threadfence();
  float4 v = __ldcg(reinterpret_cast<const float4*>(a.partial + mine * 128) + lane);
  const float4 u = __ldcg(reinterpret_cast<const float4*>(a.partial + other * 128) + lane);
  v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
  reinterpret_cast<float4*>(a.out + counter * 128)[lane] = v;
  if (lane == 0) a.tile_counters[counter] = 0;
}
__device__ void SplitTileFixup(const Args& a, int warp, int lane, float x) {
  const float4 v = make_float4(x, x, x, x);
  reinterpret_cast<float4*>(a.partial + (2 * warp) * 128)[lane] = v;
  reinterpret_cast<float4*>(a.partial + (2 * warp + 1) * 128)[lane] = v;
  if (a.epilogue == 1) {
    __threadfence();
  } else {
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  }
  __syncwarp();
  if (warp > 0) Arrive(a, warp - 1, 2 * warp, 2 * (warp - 1) + 1, lane);
  if (warp + 1 < a.warps) Arrive(a, warp, 2 * warp + 1, 2 * (warp + 1), lane);
}

template <int P>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 4) ReadKernel(const Args a) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (warp >= a.warps) return;
  const unsigned long long t0 = Now();
  Cursor<P> c;
  c.Init(a, warp);
  uint4 ring[kRing][2];
  bool full[kRing];
#pragma unroll
  for (int s = 0; s < kRing; ++s) {
    const long long i = c.Take(a);
    full[s] = i >= 0;
    if (full[s]) {
      ring[s][0] = LoadStream(a.w + i * 64 + lane);
      ring[s][1] = LoadStream(a.w + i * 64 + 32 + lane);
    }
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  unsigned acc = 0;
  for (bool more = full[0]; more;) {
#pragma unroll
    for (int s = 0; s < kRing; ++s) {
      if (!full[s]) {
        more = false;
        break;
      }
      acc ^= ring[s][0].x ^ ring[s][0].y ^ ring[s][0].z ^ ring[s][0].w ^ ring[s][1].x ^ ring[s][1].y ^ ring[s][1].z ^ ring[s][1].w;
      const long long i = c.Take(a);
      full[s] = i >= 0;
      if (full[s]) {
        ring[s][0] = LoadStream(a.w + i * 64 + lane);
        ring[s][1] = LoadStream(a.w + i * 64 + 32 + lane);
      }
    }
  }
  if (acc == 0x12345678u) a.sink[0] = acc;  // keeps the loads
  if (a.epilogue != 0) SplitTileFixup(a, warp, lane, __uint_as_float(acc & 0x3fffffffu));
  if (lane == 0) {
    a.times[2 * warp] = t0;
    a.times[2 * warp + 1] = Now();
  }
}

__global__ void SpinKernel(long long ns) {
  const unsigned long long t0 = Now();
  while (Now() - t0 < static_cast<unsigned long long>(ns)) {
  }
}

template <int P>
void Launch(const Args& a, cudaStream_t s, bool pdl, int smem) {
  cudaLaunchConfig_t config{};
  config.dynamicSmemBytes = smem;
  config.gridDim = dim3((a.warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  config.blockDim = dim3(kWarpsPerBlock * 32);
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&config, ReadKernel<P>, a));
}
void LaunchPattern(int p, const Args& a, cudaStream_t s, bool pdl, int smem) {
  switch (p) {
    case kRanges: return Launch<kRanges>(a, s, pdl, smem);
    case kSweep: return Launch<kSweep>(a, s, pdl, smem);
    case kTiles: return Launch<kTiles>(a, s, pdl, smem);
    default: return Launch<kGroups>(a, s, pdl, smem);
  }
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t arena_bytes = size_t(3) << 30;
  uint4* arena;
  CHECK(cudaMalloc(&arena, arena_bytes));
  CHECK(cudaMemset(arena, 0x5a, arena_bytes));
  unsigned* sink;
  constexpr int kReps = 20;
  CHECK(cudaMalloc(&sink, 64));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // copy ceiling: 1 GiB each way, read + write counted
  double copy_gbs = 0;
  {
    const size_t half = size_t(1) << 30;
    float best = 1e9f;
    for (int r = 0; r < 5; ++r) {
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(arena) + half, arena, half, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best = std::min(best, ms);
    }
    copy_gbs = 2.0 * half / best / 1e6;
    std::printf("device: %s, %d SMs; copy 1 GiB: %.1f GB/s (read + write)\n", prop.name, sms, copy_gbs);
  }

  struct Shape {
    const char* name;
    long long n, k;
  };
  // packed W4A16 bytes of the benchmark's shapes: 16-row tiles x 128-k steps (1 KB) + bf16 scales of group 32
  const Shape shapes[] = {{"7168x2048", 7168, 2048}, {"4096x7168", 4096, 7168}, {"18432x7168", 18432, 7168}, {"7168x18432", 7168, 18432}};
  // 50 KB of shared memory per block: 4 blocks per SM, as W4A16's 128 registers per thread allow,
  // so the next launch's blocks cannot start on an SM before one of ours leaves it
  constexpr int kOccupancySmem = 50 << 10;
  struct Config {
    int pattern, warps_per_sm;
    bool pdl;
    int smem, epilogue;
    const char* what;
  };
  const Config configs[] = {
      {kRanges, 16, true, 0, 0, "W4A16's pattern: a range per warp, 16 warps/SM, PDL"},
      {kRanges, 16, false, 0, 0, "same, no PDL"},
      {kRanges, 16, true, kOccupancySmem, 0, "same, 4 blocks/SM of either launch (W4A16's registers)"},
      {kRanges, 16, true, kOccupancySmem, 1, "+ split-tile fixup at range end (fence.sc + atomic, as W4A16)"},
      {kRanges, 16, true, kOccupancySmem, 2, "+ split-tile fixup with acq_rel ordering"},
      {kSweep, 16, true, 0, 0, "all warps sweep one window"},
      {kTiles, 24, true, 0, 0, "step-major layout, warp = (tile, K segment), 24 warps/SM"},
      {kGroups, 16, true, kOccupancySmem, 0, "tile groups: 8 warps read 8 adjacent KB per step, 4 blocks/SM"},
      {kGroups, 16, true, 0, 0, "tile groups, 16 warps/SM, PDL"},
  };
  for (const void* fn : {(const void*)ReadKernel<kRanges>, (const void*)ReadKernel<kSweep>, (const void*)ReadKernel<kTiles>, (const void*)ReadKernel<kGroups>}) {
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kOccupancySmem));
  }
  const int max_warps = sms * 24 * 2;
  unsigned long long* times;
  float *partial, *out;
  int* tile_counters;
  CHECK(cudaMalloc(&times, sizeof(unsigned long long) * 2 * max_warps));
  CHECK(cudaMalloc(&partial, sizeof(float) * 256 * max_warps));
  CHECK(cudaMalloc(&out, sizeof(float) * 128 * max_warps));
  CHECK(cudaMalloc(&tile_counters, sizeof(int) * max_warps));
  CHECK(cudaMemset(tile_counters, 0, sizeof(int) * max_warps));
  std::printf("\n| shape | MB | configuration | us | GB/s | of copy | tail us (last warp end - median end) |\n|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes) {
    const int tiles = static_cast<int>(sh.n / 16);
    const long long k_steps = sh.k / 128;
    const long long steps = tiles * k_steps + (sh.n * sh.k / 32 * 2) / 1024;  // scales streamed as extra steps
    for (const Config& c : configs) {
      const int warps = sms * c.warps_per_sm;
      // tiles: whole (tile, segment) units, as many as fit the resident warps
      const int tile_warps = tiles * std::max(1, warps / tiles);
      Args a{arena, c.pattern == kTiles ? tiles * k_steps : steps, c.pattern == kTiles ? tile_warps : warps, tiles, sink, times, c.epilogue, partial, tile_counters, out};
      const long long read_bytes = a.steps * 1024;
      const long long copies = static_cast<long long>(arena_bytes / read_bytes);
      auto batch = [&](int reps) {
        SpinKernel<<<1, 1, 0, stream>>>(300000);  // queue the batch behind a device wait
        CHECK(cudaEventRecord(e0, stream));
        for (int r = 0; r < reps; ++r) {
          Args ar = a;
          ar.w = arena + (r % copies) * (read_bytes / 16);
          LaunchPattern(c.pattern, ar, stream, c.pdl, c.smem);
        }
        CHECK(cudaEventRecord(e1, stream));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        return ms * 1e3f / reps;
      };
      batch(kReps);
      std::vector<float> t;
      for (int b = 0; b < 5; ++b) t.push_back(batch(kReps));
      std::sort(t.begin(), t.end());
      const float us = t[2];
      // tail of the last launch of the last batch
      std::vector<unsigned long long> h(2 * a.warps);
      CHECK(cudaMemcpy(h.data(), times, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
      std::vector<double> en;
      for (int w = 0; w < a.warps; ++w) en.push_back(static_cast<double>(h[2 * w + 1]));
      std::sort(en.begin(), en.end());
      std::printf("| %s | %.1f | %s | %.2f | %.0f | %.0f%% | %.2f |\n", sh.name, read_bytes / 1e6, c.what, us, read_bytes / us / 1e3, 100.0 * read_bytes / us / 1e3 / copy_gbs,
                  (en.back() - en[en.size() / 2]) / 1e3);
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
