// The CPU twin of gqa_attention (cuda/gqa_attention.cu), kept beside cpu_backend.cc, which
// registers it.
#pragma once
#include "kdtree/ops.h"
#include "kdtree/status.h"
#include "thread_pool.h"

namespace kdtree {

// Runs a validated call (ValidateGqaAttention), parallel over the (query token, head) pairs.
Status CpuGqaAttention(const GqaAttentionArgs& a, ThreadPool& pool);

}  // namespace kdtree
