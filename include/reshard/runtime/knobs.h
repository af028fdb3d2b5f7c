// The loader's and the copy engine's tuning knobs from the environment: every RESHARD_*
// variable they read is read here, and nowhere else (the Python binding and the copier cache
// call these). The variables are for measuring (README.md, "Tuning"); an argument given by
// the caller wins over its variable. RESHARD_XXH3 (the checksum implementation) is read by
// the base layer itself (src/base/checksum.cc), which this layer sits above.
#pragma once

#include <cstdint>
#include <optional>

#include "reshard/runtime/loader.h"

namespace reshard {

/// `arg` when given, else the environment variable `env` (a whole number of at most 19
/// digits; unset or empty: `fallback`). Throws kInvalidArgument naming the variable for text
/// that is not a whole number, and for a value above `max` (naming it "environment NAME" when
/// it came from the environment).
uint64_t Knob(std::optional<uint64_t> arg, const char* env, uint64_t fallback, uint64_t max);

/// Staging slots per reader thread: `arg`, else RESHARD_SLOTS, else 2; in [1, 64].
unsigned SlotsKnob(std::optional<unsigned> arg);

/// Knobs of one load given by the caller (unset: the environment's, else the default).
struct LoadKnobArgs {
  std::optional<uint64_t> span_bytes;        // RESHARD_SPAN_BYTES
  std::optional<uint64_t> cold_span_bytes;   // RESHARD_COLD_SPAN_BYTES
  std::optional<unsigned> cold_threads;      // RESHARD_COLD_THREADS
  std::optional<uint64_t> hash_piece_bytes;  // RESHARD_HASH_PIECE_BYTES
  std::optional<uint64_t> lead_in_bytes;     // RESHARD_LEAD_IN_BYTES
};

/// LoadOptions of `threads` reader threads and `slots` slots each, the other knobs from
/// `args`, else the environment, else LoadOptions' defaults (spans at most 1 GiB, cold threads
/// at most 1024). Read at every call: a load sees the environment as it is when it starts.
LoadOptions KnobbedLoadOptions(unsigned threads, unsigned slots, const LoadKnobArgs& args = {});

/// How a copy engine is made, from the environment; read when a copier is made (so once per
/// process and (device, lanes, slots)).
struct CopierKnobs {
  int streams = 0;                 // RESHARD_STREAMS: lanes share this many streams (0: one each)
  bool pinned_host_alloc = false;  // RESHARD_PINNED=hostalloc: cudaHostAlloc, not mmap + register
};
CopierKnobs CopierKnobsFromEnv();

/// RESHARD_WARMUP (0 or 1, default 1): whether a prepare warms each lane up.
bool WarmupKnob();

}  // namespace reshard
