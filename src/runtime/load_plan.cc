#include "reshard/runtime/load_plan.h"

#include <algorithm>
#include <map>
#include <string>

#include "reshard/base/error.h"

namespace reshard {

LoadJobs ResolveTargets(const RankFileHeader& h, std::span<const LoadTarget> targets,
                        bool have_copier, std::string_view path) {
  std::map<std::string_view, const TensorEntry*> by_name;
  for (const auto& e : h.tensors) by_name[e.name] = &e;
  std::map<std::string_view, bool> seen;
  LoadJobs out;
  out.jobs.reserve(targets.size());
  for (const auto& t : targets) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      Fail(ErrorCode::kMismatch, std::string(path) + ": has no tensor \"" + t.name + "\"");
    }
    if (!seen.emplace(t.name, true).second) {
      Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\" is a load target twice");
    }
    const TensorEntry& e = *it->second;
    if (e.nbytes != t.nbytes) {
      Fail(ErrorCode::kMismatch, std::string(path) + ": tensor \"" + t.name + "\" holds " +
                                     std::to_string(e.nbytes) + " bytes, the destination has " +
                                     std::to_string(t.nbytes));
    }
    if (t.nbytes > 0 && t.ptr == nullptr) {
      Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\": null destination");
    }
    if (t.on_device && !have_copier) {
      Fail(ErrorCode::kInvalidArgument,
           "tensor \"" + t.name + "\" goes to device memory but no device copier was given");
    }
    out.any_device |= t.on_device && t.nbytes > 0;
    out.all_device &= t.on_device || e.nbytes == 0;
    out.jobs.push_back({&e, &t});
    out.bytes += e.nbytes;
    out.stored_bytes += e.stored_size;
  }
  std::sort(out.jobs.begin(), out.jobs.end(),
            [](const LoadJob& a, const LoadJob& b) { return a.entry->offset < b.entry->offset; });
  return out;
}

// Files in the page cache are read with plain buffered reads. Files on disk, measured on the
// GPU machine's virtual disk (bench/HISTORY.md §7, bench/bench_loader_knobs.py): O_DIRECT
// spans of several MiB from a few threads reach the sequential-read ceiling (0.95-1.02×),
// buffered reads with kernel read-ahead 0.63-0.96×; so kAuto picks kDirect for device
// targets (host targets are read into place, unaligned: kReadahead).
IoChoice ChooseIo(IoMode io, double resident_fraction, const LoadJobs& jobs) {
  IoChoice c;
  c.readahead = io == IoMode::kReadahead;
  if (io == IoMode::kDirect) {
    c.direct = jobs.any_device;
  } else if (io == IoMode::kAuto && resident_fraction < 0.5) {
    c.direct = jobs.any_device && jobs.all_device;
    c.readahead = !c.direct;
  }
  return c;
}

LoadPlan PlanLoad(LoadJobs in, const RankFileHeader& h, uint64_t data_offset,
                  const LoadOptions& options, bool cold) {
  const uint64_t cs = h.chunk_size;
  LoadPlan plan;
  plan.jobs = std::move(in.jobs);
  plan.bytes = in.bytes;
  plan.stored_bytes = in.stored_bytes;
  plan.tensors = plan.jobs.size();
  plan.any_device = in.any_device;
  plan.cold = cold;

  for (uint32_t j = 0; j < plan.jobs.size(); ++j) {
    const TensorEntry& e = *plan.jobs[j].entry;
    char* dst = static_cast<char*>(plan.jobs[j].target->ptr);
    for (uint64_t c = 0; c < e.ChunkCount(cs); ++c) {
      PlannedChunk k;
      k.job = j;
      k.chunk = c;
      k.length = ChunkLength(e, cs, c);
      const bool raw = e.codec == Codec::kRaw;
      k.at = data_offset + e.offset + (raw ? ChunkBegin(cs, c) : e.frames[c].offset);
      k.stored = raw ? k.length : e.frames[c].size;
      k.dst = dst + ChunkBegin(cs, c);
      plan.chunks.push_back(k);
    }
  }

  // Spans: what one reader thread takes at once (see PlanLoad in the header).
  plan.span_limit = SpanLimit(options, cold);
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const PlannedChunk& k = plan.chunks[i];
    const LoadJob& job = plan.jobs[k.job];
    const bool raw = job.entry->codec == Codec::kRaw;
    const bool device = job.target->on_device;
    if (device && raw && !plan.spans.empty()) {
      LoadSpan& last = plan.spans.back();
      if (plan.span_limit > 0 && last.kind == SpanKind::kDeviceRaw && k.at >= last.end &&
          k.at - last.end < kDataAlignment && k.at + k.stored - last.begin <= plan.span_limit) {
        last.chunk_count += 1;
        last.end = k.at + k.stored;
        continue;
      }
    }
    LoadSpan s;
    s.kind = device ? (raw ? SpanKind::kDeviceRaw : SpanKind::kDeviceZstd)
                    : (raw ? SpanKind::kHostRaw : SpanKind::kHostZstd);
    s.first_chunk = i;
    s.chunk_count = 1;
    s.begin = k.at;
    s.end = k.at + k.stored;
    plan.spans.push_back(s);
  }
  // A device raw span's copies: one per run of chunks of one tensor (contiguous on both
  // sides: a tensor's raw chunks follow each other in the file as in the destination).
  for (LoadSpan& s : plan.spans) {
    if (s.kind != SpanKind::kDeviceRaw) continue;
    s.first_copy = plan.copies.size();
    for (size_t i = s.first_chunk; i < s.first_chunk + s.chunk_count; ++i) {
      const PlannedChunk& k = plan.chunks[i];
      if (s.copy_count > 0 && plan.chunks[i - 1].job == k.job && plan.copies.back().end == k.at) {
        plan.copies.back().end = k.at + k.stored;
        continue;
      }
      plan.copies.push_back({k.at, k.at + k.stored, k.dst});
      ++s.copy_count;
    }
  }

  // Cold loads use at most `threads` too: a copier has one lane per thread of `threads`.
  const unsigned want_threads = LaneCount(options, cold);
  plan.lanes = static_cast<unsigned>(
      std::max<size_t>(1, std::min<size_t>(want_threads ? want_threads : 1, plan.spans.size())));
  plan.slots = static_cast<int>(std::max(1u, options.slots_per_thread));
  // A staging slot holds one span (raw) or one decoded chunk (zstd); sized by the largest.
  plan.slot_bytes = kDataAlignment;
  for (const LoadSpan& s : plan.spans) {
    if (s.kind == SpanKind::kDeviceRaw) {
      plan.slot_bytes = std::max(plan.slot_bytes, AlignUp(s.bytes(), kDataAlignment));
      plan.largest_span = std::max(plan.largest_span, s.bytes());
    } else if (s.kind == SpanKind::kDeviceZstd) {
      const TensorEntry& e = *plan.jobs[plan.chunks[s.first_chunk].job].entry;
      plan.slot_bytes = std::max(plan.slot_bytes, std::min(cs, AlignUp(e.nbytes, kDataAlignment)));
    }
  }
  if (plan.any_device) plan.staging_bytes = uint64_t{plan.lanes} * plan.slots * plan.slot_bytes;
  plan.verify_checksums = options.verify_checksums;
  plan.progress = options.progress;
  plan.hash_piece =
      !cold && options.verify_checksums && options.hash_piece_bytes > 0 ? options.hash_piece_bytes : 0;
  // Lead-in (warm loads): a lane's first span is copied in parts as it is read.
  plan.lead_in = cold ? 0 : options.lead_in_bytes;
  plan.read_step = plan.hash_piece ? plan.hash_piece : kLeadInReadBytes;
  return plan;
}

LoadPlan PlanLoad(const RankFileHeader& header, uint64_t data_offset,
                  std::span<const LoadTarget> targets, const LoadOptions& options, bool cold,
                  bool have_copier, std::string_view path) {
  return PlanLoad(ResolveTargets(header, targets, have_copier, path), header, data_offset,
                  options, cold);
}

std::vector<uint64_t> LeadInCuts(const LoadPlan& plan, const LoadSpan& span) {
  std::vector<uint64_t> cuts;
  if (plan.lead_in == 0 || span.kind != SpanKind::kDeviceRaw) return cuts;
  LeadIn lead(plan.lead_in);
  uint64_t copied = span.begin;
  for (size_t i = span.first_chunk; i < span.first_chunk + span.chunk_count; ++i) {
    const PlannedChunk& k = plan.chunks[i];
    for (uint64_t off = 0; off < k.stored; off += plan.read_step) {
      const uint64_t pos = k.at + off + std::min(plan.read_step, k.stored - off);
      if (lead.Due(copied, pos, span.end)) {
        cuts.push_back(pos);
        copied = pos;
      }
    }
  }
  return cuts;
}

}  // namespace reshard
