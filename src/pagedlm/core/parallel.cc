#include "pagedlm/core/parallel.h"

#include <omp.h>

#include <exception>
#include <mutex>
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

void parallel_for_each(const std::vector<int32_t>& items, const std::function<void(int32_t)>& fn) {
  const auto n = static_cast<int64_t>(items.size());
  std::exception_ptr error;
  std::mutex mu;
#pragma omp parallel for schedule(dynamic, 4) if (n > 4)
  for (int64_t i = 0; i < n; ++i) {
    try {
      fn(items[i]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace pagedlm
