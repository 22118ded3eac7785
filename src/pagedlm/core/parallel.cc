#include "pagedlm/core/parallel.h"

#include <omp.h>

#include <thread>

extern "C" void openblas_set_num_threads(int);

namespace pagedlm {

void set_num_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  omp_set_num_threads(n);
  // Our OpenMP loops split GEMMs into fixed single-threaded OpenBLAS calls (batch invariance,
  // see ops/linear_cpu.cc), so OpenBLAS itself must not spawn threads.
  openblas_set_num_threads(1);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace pagedlm
