#pragma once
// Cancellation of long operations by a signal (Ctrl-C): the CLI's handler records the signal
// (async-signal-safe), and the work loops (ParallelFor) stop at their next item with an
// Error of code kCancelled; the usual unwinding then removes what was not committed.

#include <string>

namespace reshard {

/// Records that signal `signal` asks the running operation to stop. Async-signal-safe.
void RequestCancel(int signal) noexcept;

/// The signal that asked to stop, or 0.
int CancelSignal() noexcept;

/// The signal that asked to stop, by name ("SIGINT", "SIGTERM", "signal N"); "" when none.
std::string CancelSignalName();

}  // namespace reshard
