#include "reshard/runtime/loader.h"

#include <algorithm>
#include <chrono>

#include "reshard/base/error.h"
#include "reshard/runtime/load_plan.h"
#include "runtime/read_pipeline.h"

namespace reshard {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The per-thread times of a run folded into the diagnostics (averages, extremes, counts).
void Summarize(const PipelineResult& run, LoadDiagnostics& d) {
  const size_t n = run.lanes.size();
  d.reads_done_seconds = run.reads_done;
  d.sync_seconds = run.sync;
  for (size_t t = 0; t < n; ++t) {
    const LaneTimes& l = run.lanes[t];
    d.wait_seconds += l.wait / n;
    d.read_seconds += l.read / n;
    d.lane_start_seconds = std::max(d.lane_start_seconds, l.start);
    d.lane_end_seconds += l.end / n;
    d.issue_seconds += l.issue / n;
    d.lane_cpu_seconds += l.cpu / n;
    d.lane_wall_seconds += (l.end - l.start) / n;
    d.preemptions += static_cast<uint64_t>(std::max(0L, l.involuntary));
    for (size_t u = 0; u < n; ++u) {
      if (u != t && l.start_cpu >= 0 && run.lanes[u].start_cpu == l.start_cpu) {
        ++d.lanes_on_shared_cpus;
        break;
      }
    }
    if (l.first_copy >= 0 && (d.first_copy_seconds == 0 || l.first_copy < d.first_copy_seconds)) {
      d.first_copy_seconds = l.first_copy;
    }
  }
}

}  // namespace

uint64_t SpanLimit(const LoadOptions& o, bool cold) {
  return cold && o.cold_span_bytes ? o.cold_span_bytes : o.span_bytes;
}

unsigned LaneCount(const LoadOptions& o, bool cold) {
  const unsigned threads = std::max(1u, o.threads);
  return cold && o.cold_threads ? std::min(o.cold_threads, threads) : threads;
}

uint64_t PreparedSlotBytes(const LoadOptions& o, uint64_t chunk_size) {
  // A slot holds one span, or one chunk when the chunk is longer.
  auto slot = [&](bool cold) {
    return AlignUp(std::max(SpanLimit(o, cold), chunk_size), kDataAlignment);
  };
  const unsigned lanes = LaneCount(o, false);
  const uint64_t need = std::max(uint64_t{lanes} * slot(false), uint64_t{LaneCount(o, true)} * slot(true));
  return AlignUp((need + lanes - 1) / lanes, kDataAlignment);
}

LoadStats LoadRankFile(const RankFileReader& file, std::span<const LoadTarget> targets,
                       DeviceCopier* copier, const LoadOptions& options,
                       LoadDiagnostics* diagnostics) {
  const auto t0 = Clock::now();
  LoadDiagnostics d;
  LoadJobs jobs = ResolveTargets(file.header(), targets, copier != nullptr, file.path());

  double resident = 1;
  if (options.io == IoMode::kAuto) {
    const auto tr = Clock::now();
    resident = PageCacheResidency(file.path());
    d.resident_fraction = resident;
    d.residency_seconds = Since(tr);
  }
  IoChoice io = ChooseIo(options.io, resident, jobs);
  File direct_file;
  if (io.direct) {
    try {
      direct_file = file.file().ReopenDirect();
    } catch (const Error&) {
      io.direct = false;  // e.g. tmpfs refuses O_DIRECT
      io.readahead = options.io == IoMode::kAuto;
    }
  }

  const LoadPlan plan =
      PlanLoad(std::move(jobs), file.header(), file.preamble().data_offset, options, io.cold());
  LoadStats stats;
  stats.bytes = plan.bytes;
  stats.stored_bytes = plan.stored_bytes;
  stats.tensors = plan.tensors;
  stats.threads = plan.lanes;
  stats.cold = plan.cold;
  stats.direct_io = io.direct;
  stats.staging_bytes = plan.staging_bytes;
  if (plan.any_device) {
    // Before the readers start: one allocation for every lane (a cached copier that has it
    // already, e.g. from reshard.prepare or an earlier load, returns at once).
    stats.staging_alloc_seconds = copier->Reserve(plan.slot_bytes, static_cast<int>(plan.lanes));
  }

  const PlanSource source{&file.path(), &file.file(), io.direct ? &direct_file : nullptr, io.readahead};
  const PipelineResult run = RunPlan(plan, source, copier, options.pool, diagnostics != nullptr, t0);
  stats.pooled = run.pooled;
  stats.seconds = Since(t0);
  if (diagnostics != nullptr) {
    d.span_bytes = plan.largest_span;
    d.readahead = io.readahead;
    Summarize(run, d);
    *diagnostics = d;
  }
  return stats;
}

}  // namespace reshard
