// Argument checks shared by both backends: every op's dtypes, ranks, shape relations and buffer
// sizes, with messages that name the op and list every tensor involved.
#pragma once
#include "kdtree/ops.h"
#include "kdtree/status.h"

namespace kdtree {

Status ValidateW4A16Pack(const W4A16PackArgs& a);
// What a validated pack writes into qw_packed (scales = false) and sc_packed.
PackedWeightInfo PackedWeightInfoOf(const W4A16PackArgs& a);
Status ValidateW4A16Gemm(const W4A16GemmArgs& a);
Status ValidateGemm(const GemmArgs& a);
Status ValidateMoeGemm(const MoeGemmArgs& a, int64_t* experts, int64_t* topk);
Status ValidateMlaAttention(const MlaAttentionArgs& a);
Status ValidateEmbedding(const EmbeddingArgs& a);
Status ValidateRmsNorm(const RmsNormArgs& a);
Status ValidateRope(const RopeArgs& a);
Status ValidateSiluMul(const SiluMulArgs& a);
Status ValidateGqaAttention(const GqaAttentionArgs& a);
Status ValidateAdd(const AddArgs& a);
Status ValidateRouter(const RouterArgs& a);
Status ValidateArgmax(const ArgmaxArgs& a);
Status ValidateTopk(const TopkArgs& a);
Status ValidateKvWrite(const KvWriteArgs& a);
Status ValidateMlaInputs(const MlaInputsArgs& a);
Status ValidateMlaQuery(const MlaQueryArgs& a);
Status ValidateDdtreeBuild(const DdtreeBuildArgs& a);
Status ValidateDdtreeAccept(const DdtreeAcceptArgs& a);
Status ValidateKvCommit(const KvCommitArgs& a);
Status ValidateArange(const ArangeArgs& a);

}  // namespace kdtree
