// The CPU twin of every CUDA op: the same semantics, written plainly (cpu_backend.cc registers
// them). One file per cuda op family, named as the cuda file:
//   w4a16_pack.cc   w4a16Pack               gemm.cc        gemm
//   w4a16_gemm.cc   w4a16Gemm, moeGemm (INT4 experts)      moe_bf16.cc    moeGemm (bf16 experts)
//   mla_attention.cc  mlaAttention          gqa_attention.cc  gqaAttention
//   moe_router.cc   router                  ddtree.cc      ddtreeBuild, ddtreeAccept, kvCommit
//   small_ops.cc    embedding, rmsNorm, rope, siluMul, add, argmax, topk, kvWrite, mlaInputs,
//                   mlaQuery, arange
// Each runs a validated call (common/validate.cc), multi-threaded over independent outputs where it
// pays; each output is one fixed-order sum, so results are batch-invariant and independent of the
// thread count.
#pragma once
#include "kdtree/ops.h"
#include "kdtree/status.h"
#include "thread_pool.h"

namespace kdtree {
namespace cpu {

void W4A16Pack(const W4A16PackArgs& a, ThreadPool& pool);
Status W4A16Gemm(const W4A16GemmArgs& a, ThreadPool& pool);
Status MoeGemm(const MoeGemmArgs& a, ThreadPool& pool);      // packed INT4 experts (a.qw)
Status MoeGemmBf16(const MoeGemmArgs& a, ThreadPool& pool);  // bf16 experts as stored (a.w)
Status Gemm(const GemmArgs& a, ThreadPool& pool);
Status MlaAttention(const MlaAttentionArgs& a, ThreadPool& pool);
Status GqaAttention(const GqaAttentionArgs& a, ThreadPool& pool);
Status Router(const RouterArgs& a, ThreadPool& pool);
Status DdtreeBuild(const DdtreeBuildArgs& a, ThreadPool& pool);
Status DdtreeAccept(const DdtreeAcceptArgs& a, ThreadPool& pool);
Status KvCommit(const KvCommitArgs& a, ThreadPool& pool);
Status Embedding(const EmbeddingArgs& a, ThreadPool& pool);
Status RmsNorm(const RmsNormArgs& a, ThreadPool& pool);
Status Rope(const RopeArgs& a, ThreadPool& pool);
Status SiluMul(const SiluMulArgs& a, ThreadPool& pool);
Status Add(const AddArgs& a, ThreadPool& pool);
Status Argmax(const ArgmaxArgs& a, ThreadPool& pool);
Status Topk(const TopkArgs& a, ThreadPool& pool);
Status KvWrite(const KvWriteArgs& a, ThreadPool& pool);
Status MlaInputs(const MlaInputsArgs& a, ThreadPool& pool);
Status MlaQuery(const MlaQueryArgs& a, ThreadPool& pool);
Status Arange(const ArangeArgs& a, ThreadPool& pool);

}  // namespace cpu
}  // namespace kdtree
