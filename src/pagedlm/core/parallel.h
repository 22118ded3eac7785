// CPU parallelism: OpenMP loops plus one place that sets how many threads everything uses
// (our loops and OpenBLAS), so `--threads` means the same thing everywhere.
#pragma once

namespace pagedlm {

// n <= 0 means "all hardware threads".
void set_num_threads(int n);
int num_threads();

}  // namespace pagedlm
