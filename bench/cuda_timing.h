// CUDA event timing shared by the CUDA benches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "pagedlm/ops/cuda/check.h"

namespace pagedlm::bench {

// Milliseconds between two events recorded on `stream` around `fn` (which enqueues work there).
template <typename Fn>
double timed_ms(cudaStream_t stream, Fn& fn) {
  cudaEvent_t begin, end;
  cuda::check(cudaEventCreate(&begin), "cudaEventCreate");
  cuda::check(cudaEventCreate(&end), "cudaEventCreate");
  cuda::check(cudaEventRecord(begin, stream), "cudaEventRecord");
  fn();
  cuda::check(cudaEventRecord(end, stream), "cudaEventRecord");
  cuda::check(cudaEventSynchronize(end), "cudaEventSynchronize");
  float ms = 0;
  cuda::check(cudaEventElapsedTime(&ms, begin, end), "cudaEventElapsedTime");
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return ms;
}

// Mean milliseconds per call of `fn` over `iters` calls back to back, after one untimed call.
template <typename Fn>
double mean_ms(cudaStream_t stream, Fn&& fn, int iters) {
  fn();
  auto all = [&] {
    for (int i = 0; i < iters; ++i) fn();
  };
  return timed_ms(stream, all) / iters;
}

// Median milliseconds of `iters` calls timed one by one, after `warmup` untimed calls.
template <typename Fn>
double median_ms(cudaStream_t stream, Fn&& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) times.push_back(timed_ms(stream, fn));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// mean_ms of `fn`'s work captured once as a CUDA graph (after one eager call) and replayed.
template <typename Fn>
double graph_mean_ms(cudaStream_t stream, Fn&& fn, int iters) {
  fn();
  cuda::check(cudaStreamSynchronize(stream), "warm-up");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cuda::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  fn();
  cuda::check(cudaStreamEndCapture(stream, &graph), "capture");
  cuda::check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const double ms = mean_ms(
      stream, [&] { cuda::check(cudaGraphLaunch(exec, stream), "launch"); }, iters);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms;
}

}  // namespace pagedlm::bench
