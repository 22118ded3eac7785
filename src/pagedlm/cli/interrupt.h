// Ctrl-C (SIGINT) and SIGTERM as a request to stop, for commands that run the engine step by
// step: the first signal only records itself, and the command looks between steps (and has the
// engine look between the layers of a long CPU step: Engine::set_abandon_check); a second one
// ends the process at once, as if it had not been caught (for a step too long to wait for).
// Before the first step, while the model loads or its random weights are drawn, there is nothing
// to stop cleanly and nothing to report: a signal then ends the process at once
// (StopSignalsEndAtOnce).
#pragma once

namespace pagedlm::cli {

// Installs the handlers (and forgets any earlier signal). Library threads (OpenBLAS, OpenMP)
// exist before main and may be the ones to receive a signal, so the handler only sets a flag.
void catch_stop_signals();
// The signal that asked to stop; 0 while none has.
int stop_signal();
// The exit status of a command that stopped on that signal, the one a shell shows for a process
// the signal ended: 128 + its number (130 for Ctrl-C).
int stop_exit_status();

// While one lives, a stop signal (caught by catch_stop_signals) ends the process at once with
// stop_exit_status() and a line on stderr, as does one that came before it began: for work that
// writes nothing and has nothing to show when cut short (a model's load, random weights, the
// engine's start-up), however long it takes and wherever it is.
class StopSignalsEndAtOnce {
 public:
  StopSignalsEndAtOnce();
  ~StopSignalsEndAtOnce();
  StopSignalsEndAtOnce(const StopSignalsEndAtOnce&) = delete;
  StopSignalsEndAtOnce& operator=(const StopSignalsEndAtOnce&) = delete;
};

}  // namespace pagedlm::cli
