// CPU parallelism: OpenMP loops plus one place that sets how many threads everything uses
// (our loops and OpenBLAS), so `--threads` means the same thing everywhere.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace pagedlm {

// n <= 0 means "all hardware threads".
void set_num_threads(int n);
int num_threads();

// Runs fn(i) for every i of `items` on the OpenMP threads, for independent per-sequence work
// on the host (structured output's token masks and grammar advances). The first exception is
// rethrown on the calling thread (one must not leave an OpenMP region).
void parallel_for_each(const std::vector<int32_t>& items, const std::function<void(int32_t)>& fn);

}  // namespace pagedlm
