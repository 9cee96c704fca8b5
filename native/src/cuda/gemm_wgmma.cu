// `gemm` (16-bit weights as stored) for prefill-sized token counts on Hopper's warpgroup MMA
// (sm_90a only; gemm.cu decides when it runs).
//
// Why: the tiled form (gemm.cu) multiplies 64 weight rows by up to 64 tokens with mma.sync, each
// warp loading its x fragments from shared memory for every chunk and token group, and through L2
// it reads the weights once per 64 tokens and x once per 64 rows: lm_head's rank share at 512
// tokens moves ~4.7 GB through L2, and runs at a third of cuBLAS's speed. Here a block holds 128
// weight rows (two MMA warpgroups of 64) and 128 tokens, and the tensor cores read x straight from
// shared memory as wgmma's B operand: an MMA warp's work per 32-k chunk is two LDS.128 of its
// weight rows and two wgmmas, and the L2 traffic of 128 x 128 tiles is half the tiled form's
// (lm_head at 512-2048 tokens runs about twice as fast as the tiled form; docs/benchmarks/cuda.md).
//  * x is staged first (GemmWgmmaStageXKernel) in wgmma's B order. The split form's k order (a
//    lane's k 8t + 4h + {0..3} fill MMA h's k slots {2t, 2t + 1, 2t + 8, 2t + 9}) puts the 8 k of
//    one 16-byte core-matrix row in 4 words 16 bytes apart in x, which no async copy gathers.
//  * A copy warpgroup streams weights and the staged x through a ring of kStages chunks in shared
//    memory (cp.async) and hands them over through mbarriers; an MMA lane loads its A fragments
//    (rows g and g + 8 of its warp's 16) with one LDS.128 each, the registers the split form's lane
//    holds, which wgmma takes in mma.m16n8k16's fragment layout.
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

constexpr int kWarpgroups = kWgmmaRows / 64;  // MMA warpgroups
constexpr int kThreads = 128 * kWarpgroups;      // MMA threads
constexpr int kTokens = kWgmmaTokens;
constexpr int kChunkBytes = kChunkK * 2;            // one row's (or token's) chunk: 64 bytes
constexpr int kWBytes = kWgmmaRows * kChunkBytes;   // a chunk's weights, [128 rows][64 B]: 8 KB
constexpr int kXBytes = kTokens * kChunkBytes;      // a chunk's staged x, [4 units][128 tokens][16 B]: 8 KB
constexpr int kStageBytes = kWBytes + kXBytes;
// Chunks in the ring (128 KB); a deeper ring (13) was slower.
constexpr int kStages = 8;
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
    if (token < p.M && c * kChunkK + 8 * v < p.K) u[v] = LoadActivation(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(token) * p.K + c * kChunkK) + v);
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

// A chunk's copies by the copy warpgroup: thread i takes k unit i % 4 of weight rows i / 4 + 32 q
// (rows past N copy nothing and are zero-filled) and 16-byte units i + 128 q of the staged x; its
// row offsets are 32-bit (WgmmaFits). Set up once: per chunk a copy is an add, a select of its
// size and the LDGSTS.
struct ChunkCopier {
  static constexpr int kCopyThreads = 128;
  static constexpr int kRowStep = kCopyThreads / 4;
  static constexpr int kWCopies = kWBytes / 16 / kCopyThreads, kXCopies = kXBytes / 16 / kCopyThreads;
  const unsigned char* w_src;
  uint32_t w_off[kWCopies];
  bool w_ok[kWCopies];
  uint32_t w_dst;
  int cu;
  const unsigned char* x_src;
  uint32_t x_dst;
  __device__ void Init(const Params& p, const uint4* xs, int row0, int token_tile, int i) {
    cu = i & 3;
    const int r = i >> 2;
    w_src = reinterpret_cast<const unsigned char*>(p.w) + static_cast<int64_t>(row0 + r < p.N ? row0 + r : 0) * p.K * 2 + 16 * cu;
#pragma unroll
    for (int q = 0; q < kWCopies; ++q) {
      w_ok[q] = row0 + r + kRowStep * q < p.N;
      w_off[q] = w_ok[q] ? static_cast<uint32_t>(kRowStep * q) * static_cast<uint32_t>(p.K) * 2u : 0u;
    }
    w_dst = r * kChunkBytes + 16 * cu;
    x_src = reinterpret_cast<const unsigned char*>(xs) + static_cast<int64_t>(token_tile) * p.chunks * kXBytes + 16 * i;
    x_dst = kWBytes + 16 * i;
  }
  __device__ __forceinline__ void Weights(const Params& p, uint32_t slot, int c) const {
    const bool k_ok = (4 * c + cu) * 8 < p.K;
    const unsigned char* src = w_src + static_cast<int64_t>(c) * kChunkBytes;
#pragma unroll
    for (int q = 0; q < kWCopies; ++q) CopyAsync16ZeroFill(slot + w_dst + kRowStep * kChunkBytes * q, src + w_off[q], k_ok && w_ok[q] ? 16 : 0);
  }
  __device__ __forceinline__ void X(uint32_t slot, int c) const {
    const unsigned char* src = x_src + static_cast<int64_t>(c) * kXBytes;
#pragma unroll
    for (int q = 0; q < kXCopies; ++q) CopyAsync16(slot + x_dst + 16 * kCopyThreads * q, src + 16 * kCopyThreads * q);
  }
};

// The ring's mbarriers hand chunks from the copy warpgroup to the two MMA warpgroups (full: its
// 128 threads' copies of the chunk landed; empty: the MMA warpgroups' 256 threads are done with
// it). A chunk is published kPublishLag chunks after its copies are issued; the MMA warpgroups
// release chunk c - 1 once they are past chunk c, and need chunk c + 1 first, so a lag of up to
// kStages - 3 cannot deadlock.
constexpr int kPublishLag = 4;
static_assert(kPublishLag <= kStages - 3, "see kPublishLag");

// Grid (token tiles of 128, groups of 128 rows). Warpgroup 0 makes the copies (40 registers per
// thread); MMA warp w (warpgroups 1 and 2, 232 registers) holds rows 16 w .. 16 w + 15 of the group.
// A chunk's two wgmmas chain on acc, fresh at a range's first chunk, and stay in flight while the
// warp issues the next chunk's (one commit group in flight past each chunk); at a range's end acc
// is folded into the running sum ((p0 + p1) + p2) + ..., as in the tiled form. A fragments are
// loaded a chunk ahead, before the wgmmas of the current chunk are issued, into three register sets
// (the loop unrolled by 3 so that they never move): a set is rewritten while the chunk before is in
// flight, and with A loaded just before its own wgmma ptxas serialized every wgmma of the kernel
// (C7513), as with two sets.
// Why a copy warpgroup: with all 8 warps copying and meeting at a block barrier per chunk, the
// warps wait on each other and on the wgmmas (Nsight: 0.31 eligible warps per scheduler);
// decoupled through mbarriers, the kernel is ~1.26x faster.
template <typename W>
__global__ void __launch_bounds__(kThreads + 128, 1) GemmWgmmaKernel(Params p, const uint4* xs) {
  extern __shared__ __align__(128) unsigned char ring[];  // [kStages][weights 8 KB, staged x 8 KB], then [kStages] full and empty
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kSmem);
  uint64_t* empty = full + kStages;
  // token tiles are the fastest grid index: the token tiles of one weight group run together and
  // read it from L2 rather than HBM (as in the rows and tiled forms)
  const int token_tile = blockIdx.x, row0 = blockIdx.y * kWgmmaRows;
  const int token0 = (p.token_tile0 + token_tile) * kTokens;
  auto slot_of = [&](int c) { return ring_base + (c % kStages) * kStageBytes; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&full[s], 128);
      BarrierInit(&empty[s], kThreads);
    }
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    ChunkCopier copier;
    copier.Init(p, xs, row0, token_tile, threadIdx.x);
    // the first chunks' weights stream in while the previous kernel drains; x only after it
    for (int c = 0; c < min(kStages, p.chunks); ++c) copier.Weights(p, slot_of(c), c);
    PdlWait();
    for (int c = 0; c < p.chunks; ++c) {
      if (c >= kStages) {
        BarrierWait(&empty[c % kStages], (c / kStages - 1) & 1);
        copier.Weights(p, slot_of(c), c);
      }
      copier.X(slot_of(c), c);
      CopyAsyncCommit();
      if (c >= kPublishLag) {
        CopyAsyncWait<kPublishLag>();
        FenceProxyAsync();  // visible to the tensor cores
        BarrierArrive(&full[(c - kPublishLag) % kStages]);
      }
    }
    CopyAsyncWaitAll();
    FenceProxyAsync();
    for (int c = max(0, p.chunks - kPublishLag); c < p.chunks; ++c) BarrierArrive(&full[c % kStages]);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int tid = threadIdx.x - 128, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  PdlWait();  // they write y, which an earlier kernel may read
  const uint32_t a_off = (warp * kTileRows + g) * kChunkBytes + 16 * t;
  // chunk c's A fragments (rows g and g + 8, k 8 t .. 8 t + 7) as MMA h = 0, 1 takes them
  auto load_a = [&](int c, uint32_t (&a)[2][4]) {
    const uint32_t slot = slot_of(c);
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
  BarrierWait(&full[0], 0);
  load_a(0, a_sets[0]);
  int range = 0, range_begin = 0, range_end = min(p.range_chunks, p.chunks);
  for (int base = 0; base < p.chunks; base += 3) {
#pragma unroll
    for (int third = 0; third < 3; ++third) {
      const int c = base + third;
      if (c >= p.chunks) break;
      if (c + 1 < p.chunks) {
        BarrierWait(&full[(c + 1) % kStages], ((c + 1) / kStages) & 1);
        load_a(c + 1, a_sets[(third + 1) % 3]);
      }
      const uint64_t desc = desc0 + (static_cast<uint64_t>((c % kStages) * kStageBytes) >> 4);
      WgmmaFence();
      Wgmma<W>(acc, a_sets[third][0], desc, c != range_begin);
      Wgmma<W>(acc, a_sets[third][1], desc + kDescH, true);
      WgmmaCommit();
      WgmmaWait<1>();  // chunk c - 1's wgmmas are done: its slot goes back to the copy warpgroup
      if (c >= 1) BarrierArrive(&empty[(c - 1) % kStages]);
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
  constexpr int kShared = kSmem + 2 * kStages * static_cast<int>(sizeof(uint64_t));
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared), "gemm (wgmma form): shared memory"));
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>((p.N + kWgmmaRows - 1) / kWgmmaRows));
  return LaunchPdl("gemm (wgmma form)", kernel, grid, dim3(kThreads + 128), kShared, s, p, static_cast<const uint4*>(xs));
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
