#include "pagedlm/cli/interrupt.h"

#include <signal.h>

#include <atomic>

namespace pagedlm::cli {

namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

void on_stop_signal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) return;
  // The second one: the default action, delivered once this handler returns.
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void catch_stop_signals() {
  g_stop_signal = 0;
  signal(SIGINT, on_stop_signal);
  signal(SIGTERM, on_stop_signal);
}

int stop_signal() { return g_stop_signal; }

int stop_exit_status() { return 128 + g_stop_signal; }

}  // namespace pagedlm::cli
