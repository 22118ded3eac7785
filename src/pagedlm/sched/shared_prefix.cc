#include "pagedlm/sched/shared_prefix.h"

#include <algorithm>
#include <unordered_map>

namespace pagedlm {

std::vector<SharedPrefixGroup> find_shared_prefixes(const StepPlan& plan, int32_t min_pages) {
  const int32_t B = plan.num_seqs();
  // Pages of sequence b that precede its first new token; none when its table begins with the
  // null page (released entries lead a table, and equal null entries are no shared content).
  auto eligible_pages = [&](int32_t b) {
    const int32_t pages = plan.kv_indptr[b + 1] - plan.kv_indptr[b];
    if (pages == 0 || plan.kv_page_indices[plan.kv_indptr[b]] == plan.null_page) return 0;
    const int32_t n_kv = (pages - 1) * plan.page_size + plan.kv_last_page_len[b];
    const int32_t n_new = plan.q_indptr[b + 1] - plan.q_indptr[b];
    return (n_kv - n_new) / plan.page_size;
  };
  // First pages that two or more eligible sequences begin with: only those can start a group
  // (most steps have none, and then nothing below allocates per sequence).
  std::vector<int32_t> firsts;
  firsts.reserve(B);
  for (int32_t b = 0; b < B; ++b) {
    if (eligible_pages(b) >= std::max(min_pages, 1)) {
      firsts.push_back(plan.kv_page_indices[plan.kv_indptr[b]]);
    }
  }
  std::sort(firsts.begin(), firsts.end());
  auto held_by_several = [&](int32_t page) {
    const auto [lo, hi] = std::equal_range(firsts.begin(), firsts.end(), page);
    return hi - lo >= 2;
  };
  std::unordered_map<int32_t, size_t> group_of_first_page;
  std::vector<SharedPrefixGroup> groups;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t usable = eligible_pages(b);
    if (usable < std::max(min_pages, 1)) continue;
    const int32_t first = plan.kv_page_indices[plan.kv_indptr[b]];
    if (!held_by_several(first)) continue;
    auto [it, inserted] = group_of_first_page.emplace(first, groups.size());
    if (inserted) {
      groups.push_back({{b}, usable});
      continue;
    }
    SharedPrefixGroup& g = groups[it->second];
    const int32_t* lead = plan.kv_page_indices.data() + plan.kv_indptr[g.seqs.front()];
    const int32_t* mine = plan.kv_page_indices.data() + plan.kv_indptr[b];
    const int32_t limit = std::min(g.num_pages, usable);
    int32_t common = 0;
    while (common < limit && lead[common] == mine[common]) ++common;
    g.num_pages = common;
    g.seqs.push_back(b);
  }
  std::erase_if(groups, [&](const SharedPrefixGroup& g) {
    return g.seqs.size() < 2 || g.num_pages < std::max(min_pages, 1);
  });
  return groups;
}

}  // namespace pagedlm
