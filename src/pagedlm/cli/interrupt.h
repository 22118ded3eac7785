// Ctrl-C (SIGINT) and SIGTERM as a request to stop, for commands that run the engine step by
// step: the first signal only records itself, and the command looks between steps; a second
// one ends the process at once, as if it had not been caught (for a step too long to wait for).
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

}  // namespace pagedlm::cli
