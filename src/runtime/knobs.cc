#include "reshard/runtime/knobs.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "reshard/base/error.h"

namespace reshard {

uint64_t Knob(std::optional<uint64_t> arg, const char* env, uint64_t fallback, uint64_t max) {
  uint64_t n = fallback;
  if (arg) {
    n = *arg;
  } else if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {
    const std::string text = v;
    bool digits = text.size() <= 19;
    for (char c : text) digits &= c >= '0' && c <= '9';
    if (!digits) {
      Fail(ErrorCode::kInvalidArgument,
           std::string(env) + "=\"" + text + "\": expected a whole number of at most 19 digits");
    }
    n = std::stoull(text);
  }
  if (n > max) {
    Fail(ErrorCode::kInvalidArgument, std::string(arg ? "" : "environment ") + env + " = " +
                                          std::to_string(n) + ": at most " + std::to_string(max));
  }
  return n;
}

unsigned SlotsKnob(std::optional<unsigned> arg) {
  return static_cast<unsigned>(std::max<uint64_t>(
      1, Knob(arg ? std::optional<uint64_t>(*arg) : std::nullopt, "RESHARD_SLOTS", 2, 64)));
}

LoadOptions KnobbedLoadOptions(unsigned threads, unsigned slots, const LoadKnobArgs& a) {
  constexpr uint64_t kMaxSpan = 1ull << 30;  // a staging slot of 1 GiB is already absurd
  LoadOptions o;
  o.threads = threads;
  o.slots_per_thread = slots;
  o.span_bytes = Knob(a.span_bytes, "RESHARD_SPAN_BYTES", o.span_bytes, kMaxSpan);
  o.cold_span_bytes = Knob(a.cold_span_bytes, "RESHARD_COLD_SPAN_BYTES", o.cold_span_bytes, kMaxSpan);
  o.cold_threads = static_cast<unsigned>(
      Knob(a.cold_threads ? std::optional<uint64_t>(*a.cold_threads) : std::nullopt,
           "RESHARD_COLD_THREADS", o.cold_threads, 1024));
  o.hash_piece_bytes = Knob(a.hash_piece_bytes, "RESHARD_HASH_PIECE_BYTES", o.hash_piece_bytes, kMaxSpan);
  o.lead_in_bytes = Knob(a.lead_in_bytes, "RESHARD_LEAD_IN_BYTES", o.lead_in_bytes, kMaxSpan);
  return o;
}

CopierKnobs CopierKnobsFromEnv() {
  CopierKnobs k;
  k.streams = static_cast<int>(Knob(std::nullopt, "RESHARD_STREAMS", 0, 1024));
  const char* pinned = std::getenv("RESHARD_PINNED");
  k.pinned_host_alloc = pinned != nullptr && std::strcmp(pinned, "hostalloc") == 0;
  return k;
}

bool WarmupKnob() { return Knob(std::nullopt, "RESHARD_WARMUP", 1, 1) != 0; }

}  // namespace reshard
