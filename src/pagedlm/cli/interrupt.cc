#include "pagedlm/cli/interrupt.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace pagedlm::cli {

namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_end_at_once{false};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
              "the signal handler needs lock-free flags");

// Only async-signal-safe calls: it may run inside any library call on any thread.
[[noreturn]] void end_now(int sig) {
  constexpr char kMessage[] = "\npagedlm: interrupted\n";
  static_cast<void>(write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1));
  _exit(128 + sig);
}

void on_stop_signal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) {
    if (g_end_at_once) end_now(sig);
    return;
  }
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

StopSignalsEndAtOnce::StopSignalsEndAtOnce() {
  g_end_at_once = true;
  // A signal recorded before the flag was up found it down: it ends the process here.
  if (const int sig = g_stop_signal; sig != 0) end_now(sig);
}

StopSignalsEndAtOnce::~StopSignalsEndAtOnce() { g_end_at_once = false; }

}  // namespace pagedlm::cli
