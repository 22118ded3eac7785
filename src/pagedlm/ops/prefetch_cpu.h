// Software prefetch for the CPU kernels that stream a weight matrix once per step (one-row
// decode passes), where the hardware prefetcher alone leaves their loads waiting on memory.
#pragma once

#include <cstdint>

namespace pagedlm::ops::cpu {

// How far ahead of the weights a pass multiplies it asks for the next. A 1B-shaped Q4_0 decode
// under 8-bit activations on a 2-core AMD EPYC: 4 KiB ahead took a step from about 55 to 47 ms
// (2 to 8 KiB measured alike within the noise).
inline constexpr int64_t kPrefetchAhead = 4096;

// A prefetch of the line at `address` into every cache level. On x86 an asm statement with the
// address in a register: GCC 12 counts __builtin_prefetch as a memory reference that may alias a
// kernel's accumulator array, and then stores every accumulator to the stack on each pass of
// the loop around it (linear_cpu.cc's decode kernels did so on every block step).
inline void prefetch_line(uintptr_t address) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(address));
#else
  __builtin_prefetch(reinterpret_cast<const void*>(address),  // NOLINT(performance-no-int-to-ptr)
                     0, 3);
#endif
}

// Asks for the cache lines of [begin, end) kPrefetchAhead bytes on (an address, not a pointer
// into the weights: past their end the hint is simply dropped). Consecutive calls cover
// consecutive ranges, so a line a range only starts is asked for by the next.
inline void prefetch_ahead(const uint8_t* begin, const uint8_t* end) {
  const auto ahead = reinterpret_cast<uintptr_t>(begin) + kPrefetchAhead;
  for (int64_t at = 0; at < end - begin; at += 64) prefetch_line(ahead + at);
}

}  // namespace pagedlm::ops::cpu
