#include "reshard/base/cancel.h"

#include <atomic>
#include <csignal>
#include <string>

namespace reshard {
namespace {

std::atomic<int> g_cancel_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "set from a signal handler");

}  // namespace

void RequestCancel(int signal) noexcept { g_cancel_signal.store(signal, std::memory_order_relaxed); }

int CancelSignal() noexcept { return g_cancel_signal.load(std::memory_order_relaxed); }

std::string CancelSignalName() {
  const int s = CancelSignal();
  if (s == 0) return "";
  return s == SIGINT ? "SIGINT" : s == SIGTERM ? "SIGTERM" : "signal " + std::to_string(s);
}

}  // namespace reshard
