// Finds the runs of pages that several sequences of a step hold in common at the front of their
// page tables: prefix-cache hits point different sequences at the same physical pages, so equal
// page ids mean equal keys and values. Cascade attention reads such a run once for all of its
// sequences instead of once per sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

struct SharedPrefixGroup {
  std::vector<int32_t> seqs;  // sequence indices of the plan, ascending
  int32_t num_pages = 0;      // leading pages all of them hold
};

// Groups of at least two sequences whose first `num_pages` page ids agree, num_pages >=
// min_pages. Only whole pages that lie before every member's first new token count, so all of
// a member's queries see all of the group's keys; a sequence whose table begins with the null
// page (StepPlan::null_page) joins no group. Sequences are grouped by their first page;
// a group's run is the longest prefix common to all its members.
std::vector<SharedPrefixGroup> find_shared_prefixes(const StepPlan& plan, int32_t min_pages);

}  // namespace pagedlm
