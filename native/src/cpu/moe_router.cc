// The CPU twin of the MoE router (cuda/moe_router.cu): sigmoid scores, the bias for the choice,
// group-limited top-k (ties to the lower expert id), then the weights of the chosen experts.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

Status Router(const RouterArgs& a, ThreadPool& pool) {
  const int64_t t = a.logits.dim(0), e = a.logits.dim(1), per = e / a.n_group;
  std::vector<float> scores(static_cast<size_t>(e)), choice(static_cast<size_t>(e));
  std::vector<int> order(static_cast<size_t>(e));
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t i = 0; i < e; ++i) {
      scores[i] = 1.f / (1.f + std::exp(-a.logits.as<const float>()[r * e + i]));
      choice[i] = scores[i] + a.bias.as<const float>()[i];
    }
    std::vector<char> allowed(static_cast<size_t>(e), 1);
    if (a.n_group > 1) {
      std::vector<float> gscore(static_cast<size_t>(a.n_group));
      for (int g = 0; g < a.n_group; ++g) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t i = g * per; i < (g + 1) * per; ++i) {
          if (choice[i] > b1) { b2 = b1; b1 = choice[i]; } else if (choice[i] > b2) b2 = choice[i];
        }
        gscore[g] = b1 + b2;
      }
      std::vector<int> gorder(static_cast<size_t>(a.n_group));
      std::iota(gorder.begin(), gorder.end(), 0);
      std::stable_sort(gorder.begin(), gorder.end(), [&](int x, int y) { return gscore[x] > gscore[y]; });
      std::fill(allowed.begin(), allowed.end(), 0);
      for (int g = 0; g < a.topk_group; ++g) std::fill(allowed.begin() + gorder[g] * per, allowed.begin() + (gorder[g] + 1) * per, 1);
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      if (allowed[x] != allowed[y]) return allowed[x] > allowed[y];
      return choice[x] > choice[y];
    });
    std::vector<int> chosen(order.begin(), order.begin() + a.topk);
    std::sort(chosen.begin(), chosen.end());
    float sum = 0.f;
    for (int c : chosen) sum += scores[c];
    for (int j = 0; j < a.topk; ++j) {
      float w = scores[chosen[j]];
      if (a.norm_topk_prob) w = w / (sum + 1e-20f);
      a.ids.as<int32_t>()[r * a.topk + j] = chosen[j];
      a.weights.as<float>()[r * a.topk + j] = w * static_cast<float>(a.scaling);
    }
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
