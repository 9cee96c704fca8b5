// `gemm` (16-bit weights as stored) for prefill-sized token counts on Hopper's warpgroup MMA
// (sm_90a only; gemm.cu decides when it runs).
//
// Why: the tiled form (gemm.cu) multiplies 64 weight rows by up to 64 tokens with mma.sync, each
// warp loading its x fragments from shared memory for every chunk and token group, and through L2
// it reads the weights once per 64 tokens and x once per 64 rows: lm_head's rank share at 512
// tokens moved ~4.7 GB through L2 in 589 us, 0.34x of cuBLAS (run 321). Here a block holds 128
// weight rows (two warpgroups of 64) and 128 tokens, and the tensor cores read x straight from
// shared memory as wgmma's B operand: a warp's work per 32-k chunk is two LDS.128 of its
// weight rows and two wgmmas, and the L2 traffic of 128 x 128 tiles is half the tiled form's.
// Measured (run 325): lm_head at 512 / 2048 tokens 432 / 1696 us (0.47x / 0.46x of cuBLAS, the
// tiled form 601 / 2371). Nsight (run 326, lm_head at 512 tokens): one block of 8 warps per SM (238
// registers), 0.31 eligible warps per scheduler, shared-memory pipe 36% busy, L2 34%, DRAM 13%:
// latency-bound on the block barrier and wgmma waits of each chunk, not on bandwidth. A deeper
// ring did not help (below); what would is the W4A16 prefill kernel's design: a producer warp and
// consumer warpgroups that pass stages through mbarriers instead of a block barrier per chunk.
//  * x is staged first (GemmWgmmaStageXKernel) in wgmma's B order. The split form's k order (a
//    lane's k 8t + 4h + {0..3} fill MMA h's k slots {2t, 2t + 1, 2t + 8, 2t + 9}) puts the 8 k of
//    one 16-byte core-matrix row in 4 words 16 bytes apart in x, which no async copy gathers.
//  * Weights and the staged x share a ring of kStages chunks in shared memory (cp.async); a lane
//    loads its A fragments (rows g and g + 8 of its warp's 16) with one LDS.128 each, the registers
//    the split form's lane holds, which wgmma takes in mma.m16n8k16's fragment layout.
//  * Batch invariance: wgmma rounds chained k16 sums as mma.sync does (tools/gpu/wgmma_equiv.cu);
//    each K range starts fresh (scale-d 0) and the ranges' partials are summed in order, as the
//    tiled form does, so the bits are the split form's.
#include <cstddef>
#include <type_traits>

#include "gemm_kernel.cuh"
#include "wgmma_ops.cuh"

namespace kdtree {
namespace cuda {
namespace gemm {
namespace {

constexpr int kWarpgroups = kWgmmaRows / 64;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kTokens = kWgmmaTokens;
constexpr int kChunkBytes = kChunkK * 2;            // one row's (or token's) chunk: 64 bytes
constexpr int kWBytes = kWgmmaRows * kChunkBytes;   // a chunk's weights, [128 rows][64 B]: 8 KB
constexpr int kXBytes = kTokens * kChunkBytes;      // a chunk's staged x, [4 units][128 tokens][16 B]: 8 KB
constexpr int kStageBytes = kWBytes + kXBytes;
// Chunks in the ring: a chunk's slot is refilled two chunks after its use (one wgmma group stays
// in flight past the block barrier), so kStages - 2 chunks (96 KB) stream in ahead. 13 stages were
// 3-7% slower (run 325: lm_head at 512 / 2048 tokens 431.8 / 1696 -> 462.1 / 1803 us).
constexpr int kStages = 8;
constexpr int kAhead = kStages - 2;
constexpr int kSmem = kStages * kStageBytes;

// x [M, K] -> xs [token tile][chunk][unit q][128 tokens][16 B]. Unit q of a token's chunk holds its
// words q, q + 4, q + 8 and q + 12 (k 8 i + 2 q + {0, 1}, i = 0..3): the k slots 8 kb .. 8 kb + 7
// of MMA h = q / 2 (kb = q % 2) in the split form's order. Zero past M and K.
__global__ void GemmWgmmaStageXKernel(Params p, int token_tiles, uint4* xs) {
  PdlWait();  // x is the previous kernel's, and the previous GEMM may still read xs
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (token tile, chunk, token)
  if (i >= static_cast<int64_t>(token_tiles) * p.chunks * kTokens) return;
  const int n = static_cast<int>(i % kTokens);
  const int64_t tc = i / kTokens;  // token tile x chunks + chunk
  const int c = static_cast<int>(tc % p.chunks), tt = static_cast<int>(tc / p.chunks);
  const int token = (p.token_tile0 + tt) * kTokens + n;
  uint4 u[4];
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    u[v] = make_uint4(0u, 0u, 0u, 0u);
    if (token < p.M && c * kChunkK + 8 * v < p.K) u[v] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(token) * p.K + c * kChunkK) + v);
  }
  uint4* dst = xs + tc * 4 * kTokens + n;
  dst[0] = make_uint4(u[0].x, u[1].x, u[2].x, u[3].x);
  dst[kTokens] = make_uint4(u[0].y, u[1].y, u[2].y, u[3].y);
  dst[2 * kTokens] = make_uint4(u[0].z, u[1].z, u[2].z, u[3].z);
  dst[3 * kTokens] = make_uint4(u[0].w, u[1].w, u[2].w, u[3].w);
}

#define KDTREE_F8(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7])
#define KDTREE_WGMMA_N128(TYPE)                                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                                                     \
               " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"     \
               : KDTREE_F8(0), KDTREE_F8(8), KDTREE_F8(16), KDTREE_F8(24), KDTREE_F8(32), KDTREE_F8(40), KDTREE_F8(48), KDTREE_F8(56) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(static_cast<int>(accumulate))                          \
               : "memory")
// d (+)= a . B for one k16 slice: A the warp's 16 rows in mma.m16n8k16's fragments, B 128 tokens
// of staged x in shared memory; d[4 j + i] is mma.m16n8k16's d[i] for tokens 8 j .. 8 j + 7.
template <typename W>
__device__ __forceinline__ void Wgmma(float (&d)[kTokens / 2], const uint32_t (&a)[4], uint64_t desc, bool accumulate) {
  if constexpr (std::is_same<W, __half>::value) {
    KDTREE_WGMMA_N128("f16");
  } else {
    KDTREE_WGMMA_N128("bf16");
  }
}
#undef KDTREE_WGMMA_N128
#undef KDTREE_F8

// Grid (token tiles of 128, groups of 128 rows); warp w holds rows 16 w .. 16 w + 15 of the group
// (warpgroup w / 4). A chunk's two wgmmas chain on acc, fresh at a range's first chunk, and stay in
// flight while the warp issues the next chunk's (one commit group in flight past each chunk); at a
// range's end acc is folded into the running sum ((p0 + p1) + p2) + ..., as in the tiled form.
// A fragments are loaded a chunk ahead, before the wgmmas of the current chunk are issued, into
// three register sets (the loop unrolled by 3 so that they never move): a set is rewritten while
// the chunk before is in flight, and with A loaded just before its own wgmma ptxas serialized
// every wgmma of the kernel (C7513), as with two sets.
template <typename W>
__global__ void __launch_bounds__(kThreads, 1) GemmWgmmaKernel(Params p, const uint4* xs) {
  extern __shared__ __align__(128) unsigned char ring[];  // [kStages][weights 8 KB, staged x 8 KB]
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // token tiles are the fastest grid index: the token tiles of one weight group run together and
  // read it from L2 rather than HBM (as in the rows and tiled forms)
  const int token_tile = blockIdx.x, row0 = blockIdx.y * kWgmmaRows;
  const int token0 = (p.token_tile0 + token_tile) * kTokens;
  // A thread's copies of a chunk: k unit tid % 4 of weight rows tid / 4 and tid / 4 + 64 (rows past
  // N copy nothing and are zero-filled), and 16-byte units tid + kThreads q of the staged x.
  const int cu = tid & 3, cr = tid >> 2;
  const bool row_ok0 = row0 + cr < p.N, row_ok1 = row0 + cr + 64 < p.N;
  const unsigned char* w_src = reinterpret_cast<const unsigned char*>(p.w) + static_cast<int64_t>(row_ok0 ? row0 + cr : 0) * p.K * 2 + 16 * cu;
  const uint32_t w_src1 = row_ok1 ? 64u * static_cast<uint32_t>(p.K) * 2u : 0u;  // 32-bit: WgmmaFits
  const uint32_t w_dst = cr * kChunkBytes + 16 * cu;
  const unsigned char* x_src = reinterpret_cast<const unsigned char*>(xs) + static_cast<int64_t>(token_tile) * p.chunks * kXBytes + 16 * tid;
  constexpr int kXCopies = kXBytes / 16 / kThreads;
  // chunk c into its slot; nothing past the last chunk, but a commit group all the same (the group
  // count stays uniform)
  auto copy_chunk = [&](int c, bool weights, bool x) {
    if (c < p.chunks) {
      const uint32_t slot = ring_base + (c % kStages) * kStageBytes;
      if (weights) {
        const bool k_ok = (4 * c + cu) * 8 < p.K;
        const unsigned char* src = w_src + static_cast<int64_t>(c) * kChunkBytes;
        CopyAsync16ZeroFill(slot + w_dst, src, k_ok && row_ok0 ? 16 : 0);
        CopyAsync16ZeroFill(slot + w_dst + 64 * kChunkBytes, src + w_src1, k_ok && row_ok1 ? 16 : 0);
      }
      if (x) {
        const unsigned char* src = x_src + static_cast<int64_t>(c) * kXBytes;
#pragma unroll
        for (int q = 0; q < kXCopies; ++q) CopyAsync16(slot + kWBytes + 16 * (tid + kThreads * q), src + 16 * kThreads * q);
      }
    }
  };
  // the first chunks' weights stream in while the previous kernel drains; x only after it
  for (int c = 0; c < kAhead; ++c) copy_chunk(c, true, false);
  PdlWait();
  for (int c = 0; c < kAhead; ++c) {
    copy_chunk(c, false, true);
    CopyAsyncCommit();
  }
  const uint32_t a_off = (warp * kTileRows + g) * kChunkBytes + 16 * t;
  // chunk c's A fragments (rows g and g + 8, k 8 t .. 8 t + 7) as MMA h = 0, 1 takes them
  auto load_a = [&](int c, uint32_t (&a)[2][4]) {
    const uint32_t slot = ring_base + (c % kStages) * kStageBytes;
    const uint4 ra = LoadShared16(slot + a_off), rb = LoadShared16(slot + a_off + 8 * kChunkBytes);
    a[0][0] = ra.x;
    a[0][1] = rb.x;
    a[0][2] = ra.y;
    a[0][3] = rb.y;
    a[1][0] = ra.z;
    a[1][1] = rb.z;
    a[1][2] = ra.w;
    a[1][3] = rb.w;
  };
  // B of MMA h of stage 0: units 2 h (k slots 0-7) and 2 h + 1 (LBO: slots 8-15), 8 tokens apart
  // by 128 bytes (SBO); a stage further is a fixed offset (the address field does not carry: < 228 KB)
  const uint64_t desc0 = Descriptor(ring_base + kWBytes, kTokens * 16, 8 * 16);
  constexpr uint64_t kDescH = 2 * kTokens * 16 >> 4;
  float acc[kTokens / 2], sum[kTokens / 2];
  uint32_t a_sets[3][2][4];
  CopyAsyncWait<kAhead - 1>();
  FenceProxyAsync();
  __syncthreads();
  load_a(0, a_sets[0]);
  int range = 0, range_begin = 0, range_end = min(p.range_chunks, p.chunks);
  for (int base = 0; base < p.chunks; base += 3) {
#pragma unroll
    for (int third = 0; third < 3; ++third) {
      const int c = base + third;
      if (c >= p.chunks) break;
      if (c + 1 < p.chunks) {
        // chunk c + 1 landed (kAhead - 2 younger copy groups may still be in flight); every
        // warpgroup is done with chunk c - 2, whose slot takes chunk c + kAhead
        CopyAsyncWait<kAhead - 2>();
        FenceProxyAsync();
        __syncthreads();
        copy_chunk(c + kAhead, true, true);
        CopyAsyncCommit();
        load_a(c + 1, a_sets[(third + 1) % 3]);
      }
      const uint64_t desc = desc0 + (static_cast<uint64_t>((c % kStages) * kStageBytes) >> 4);
      WgmmaFence();
      Wgmma<W>(acc, a_sets[third][0], desc, c != range_begin);
      Wgmma<W>(acc, a_sets[third][1], desc + kDescH, true);
      WgmmaCommit();
      WgmmaWait<1>();  // chunk c - 1's wgmmas are done
      if (c + 1 == range_end) {
        WgmmaWait<0>();
#pragma unroll
        for (int i = 0; i < kTokens / 2; ++i) sum[i] = range == 0 ? acc[i] : sum[i] + acc[i];
        ++range;
        range_begin = range_end;
        range_end = min(range_end + p.range_chunks, p.chunks);
      }
    }
  }
  WgmmaWait<0>();  // done already (the last range's fold); said here so that ptxas sees it before the stores
  CopyAsyncWaitAll();
  PdlLaunchDependents();
  const int tile = row0 / kTileRows + warp;
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) StoreOut(p, sum[4 * j + i], tile, token0, j, i, lane);
  }
}

template <typename W>
Status Launch(const Params& p, int token_tiles, void* xs, cudaStream_t s) {
  const int64_t units = static_cast<int64_t>(token_tiles) * p.chunks * kTokens;
  KDTREE_RETURN_IF_ERROR(LaunchPdl("gemm (wgmma form): stage x", GemmWgmmaStageXKernel, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), 0, s, p, token_tiles,
                                   static_cast<uint4*>(xs)));
  const auto kernel = GemmWgmmaKernel<W>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), "gemm (wgmma form): shared memory"));
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>((p.N + kWgmmaRows - 1) / kWgmmaRows));
  return LaunchPdl("gemm (wgmma form)", kernel, grid, dim3(kThreads), kSmem, s, p, static_cast<const uint4*>(xs));
}

}  // namespace

bool WgmmaAvailable() {
  static std::atomic<int> known[kMaxKnownDevices];
  return DeviceRunsKernel(reinterpret_cast<const void*>(GemmWgmmaKernel<__nv_bfloat16>), known);
}

size_t WgmmaStagedBytes(const Params& p) { return static_cast<size_t>(p.chunks) * kXBytes; }

Status LaunchWgmma(const Params& p, bool f16, int token_tiles, void* xs, cudaStream_t s) {
  return f16 ? Launch<__half>(p, token_tiles, xs, s) : Launch<__nv_bfloat16>(p, token_tiles, xs, s);
}

}  // namespace gemm
}  // namespace cuda
}  // namespace kdtree
