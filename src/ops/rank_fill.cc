#include "ops/rank_fill.h"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <span>
#include <thread>
#include <tuple>

#include "reshard/base/error.h"
#include "reshard/io/file_io.h"
#include "reshard/io/parallel_for.h"
#include "reshard/io/rank_file.h"
#include "reshard/io/rank_file_writer.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// One chunk of one tensor of one rank file: `length` bytes of the rank file, filled by the
// entry's byte map; (file_index, source_offset) is the first source byte it reads (for
// ordering the reads).
struct WorkItem {
  uint32_t writer = 0;  // index into the jobs
  uint32_t tensor = 0;  // index into the writer's entries
  uint64_t chunk = 0;
  uint64_t source_offset = 0;
  uint64_t length = 0;
  size_t file_index = 0;
};

}  // namespace

RankFillStats WriteRankFiles(std::vector<RankFileJob>& jobs, const SourceLookup& lookup,
                             const std::function<SourceRead()>& make_read,
                             const RankFillOptions& o) {
  RankFillStats stats;
  if (jobs.empty()) return stats;
  std::vector<RankFileWriter> writers;  // destroyed uncommitted, each removes its temporary
  writers.reserve(jobs.size());
  std::vector<WorkItem> items;
  RankFileWriterOptions wo;
  wo.codec = o.codec;
  wo.sync_directory = false;  // once, below
  for (size_t w = 0; w < jobs.size(); ++w) {
    RankFileJob& job = jobs[w];
    const uint64_t cs = job.header.chunk_size;
    writers.push_back(RankFileWriter::Create(job.path, job.header, wo));
    const std::vector<TensorEntry>& entries = writers.back().header().tensors;  // sizes laid out
    if (job.maps.size() != entries.size()) {
      Fail(ErrorCode::kInvalidArgument, job.path.string() + ": " + std::to_string(job.maps.size()) +
                                     " byte maps for " + std::to_string(entries.size()) + " entries");
    }
    for (uint32_t ti = 0; ti < entries.size(); ++ti) {
      const TensorEntry& e = entries[ti];
      if (job.maps[ti].nbytes != e.nbytes) {
        Fail(ErrorCode::kInvalidArgument, job.path.string() + ": tensor \"" + e.name + "\": its map covers " +
                                       std::to_string(job.maps[ti].nbytes) + " bytes, the entry " +
                                       std::to_string(e.nbytes));
      }
      for (uint64_t c = 0; c < e.ChunkCount(cs); ++c) {
        const uint64_t begin = c * cs;  // a multiple of 4096: whole elements
        WorkItem it{static_cast<uint32_t>(w), ti, c, 0, std::min(cs, e.nbytes - begin), 0};
        std::tie(it.file_index, it.source_offset) = FirstSourceByte(job.maps[ti], lookup, begin);
        items.push_back(it);
      }
    }
  }
  const bool zstd = o.codec == Codec::kZstd;
  if (!zstd) {
    // Raw chunks go to fixed places: read the source in order.
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
      return a.file_index != b.file_index ? a.file_index < b.file_index
                                          : a.source_offset < b.source_offset;
    });
  } else {
    // zstd frames are appended, and a rank file's tensors must lie in header order (formats/
    // rank-file.md): items go tensor by tensor, chunk by chunk, the ranks' pieces of one
    // chunk side by side (so the source is still read roughly in order). Source order is not
    // header order under FSDP1 (flat parameters gather pieces of many source tensors), a
    // conversion (renamed, stacked keys) or another layout's files.
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
      return a.tensor != b.tensor ? a.tensor < b.tensor : a.chunk < b.chunk;
    });
  }

  // Workers take items in that order from one counter: no barrier between chunks. Each
  // chunk is filled, hashed and encoded (zstd: compressed) in parallel; raw chunks go
  // straight to their places. zstd frames are appended to their rank file in item order: a
  // worker whose frame is not next for that file waits (blocking, not spinning) until it
  // is; the smallest unwritten item is always held by a running worker, so this cannot
  // deadlock.
  std::vector<uint64_t> seq(items.size());
  {
    std::vector<uint64_t> per_writer(writers.size(), 0);
    for (size_t i = 0; i < items.size(); ++i) seq[i] = per_writer[items[i].writer]++;
  }
  std::vector<uint64_t> next_seq(writers.size(), 0);
  std::mutex write_mu;
  std::condition_variable write_cv;
  std::atomic<bool> failed{false};  // an item failed: wakes the workers waiting to write
  std::atomic<uint64_t> stored{0}, read{0};
  ParallelForOptions po;
  po.threads = std::max(1u, o.threads);
  if (o.progress) po.progress = [&](uint64_t) { o.progress(); };
  // Each thread's buffers are sized by the longest chunk of these ranks, not chunk_size: a
  // large --chunk-size over small tensors costs no memory.
  uint64_t longest = 1;
  for (const WorkItem& it : items) longest = std::max(longest, it.length);
  ParallelFor(items.size(), po, [&] {
    return [&, buf = std::unique_ptr<char[]>(new char[longest]),
            scratch = std::vector<char>(),  // source elements of a converting chunk
            read_source = make_read(),
            encoder = ChunkEncoder(o.codec, longest, o.zstd_level)](size_t i) mutable -> uint64_t {
      if (failed.load()) return 0;  // the loop is ending
      try {
        const WorkItem& it = items[i];
        RankFileWriter& file = writers[it.writer];
        const uint64_t cs = jobs[it.writer].header.chunk_size;
        const uint64_t source_bytes = FillEntry(jobs[it.writer].maps[it.tensor], lookup, read_source,
                                                it.chunk * cs, it.length, buf.get(), scratch);
        const std::span<const char> data = file.EncodeChunk(it.tensor, it.chunk, buf.get(), encoder);
        if (!zstd) {
          file.WriteChunk(it.tensor, it.chunk, data);
        } else {
          std::unique_lock<std::mutex> lock(write_mu);
          write_cv.wait(lock, [&] { return next_seq[it.writer] == seq[i] || failed.load(); });
          if (failed.load()) return 0;
          // Written under the lock: file order is the order of `seq`.
          file.WriteChunk(it.tensor, it.chunk, data);
          ++next_seq[it.writer];
          lock.unlock();
          write_cv.notify_all();
        }
        stored += data.size();
        read += source_bytes;
        if (o.done_bytes) *o.done_bytes += it.length;
        return it.length;
      } catch (...) {
        {
          std::lock_guard<std::mutex> g(write_mu);
          failed = true;
        }
        write_cv.notify_all();
        throw;  // the loop's first error
      }
    };
  });
  stats.bytes_read = read.load();
  stats.bytes_stored = stored.load();
  for (RankFileWriter& w : writers) {
    for (const auto& e : w.header().tensors) stats.bytes_decoded += e.nbytes;
    w.Commit();
  }
  SyncDirectory(jobs.front().path.parent_path());
  return stats;
}

bool RankFileUpToDate(const fs::path& path, const RankFileHeader& want, Codec codec, bool check_data,
                      unsigned threads, std::string* damage) {
  if (damage != nullptr) damage->clear();
  std::error_code ec;
  if (!fs::exists(path, ec)) return false;
  std::optional<RankFileReader> opened;
  try {
    opened.emplace(RankFileReader::Open(path));
    const RankFileReader& r = *opened;
    const RankFileHeader& h = r.header();
    if (!(h.source == want.source) || h.layout_key != want.layout_key || h.rank != want.rank ||
        h.world_size != want.world_size || h.dtype_policy != want.dtype_policy ||
        h.chunk_size != want.chunk_size || h.kind != want.kind || h.wrap != want.wrap ||
        h.use_orig_params != want.use_orig_params || h.param_dtype != want.param_dtype ||
        h.tensors.size() != want.tensors.size()) {
      return false;
    }
    for (size_t i = 0; i < want.tensors.size(); ++i) {
      const TensorEntry& w = want.tensors[i];
      const TensorEntry& t = h.tensors[i];
      if (t.nbytes > 0 && t.codec != codec) return false;
      if (t.name != w.name || t.dtype != w.dtype || t.sharded != w.sharded ||
          t.global_shape != w.global_shape || t.local_shape != w.local_shape ||
          (t.sharded && !(t.rows.start == w.rows.start && t.rows.end == w.rows.end)) ||
          (w.flat == nullptr) != (t.flat == nullptr) || (w.flat && !(*w.flat == *t.flat))) {
        return false;
      }
    }
  } catch (const Error&) {
    return false;
  }
  if (!check_data) return true;
  // The header is what a re-run would write; now the bytes it describes.
  const RankFileReader& r = *opened;
  const RankFileHeader& h = r.header();
  std::vector<std::pair<uint32_t, uint64_t>> chunks;  // (entry, chunk)
  uint64_t longest = 0;  // buffers sized by the longest real chunk, not chunk_size (up to 1 GiB)
  for (uint32_t t = 0; t < h.tensors.size(); ++t) {
    for (uint64_t c = 0; c < h.tensors[t].ChunkCount(h.chunk_size); ++c) {
      chunks.emplace_back(t, c);
      longest = std::max(longest, ChunkLength(h.tensors[t], h.chunk_size, c));
    }
  }
  try {
    r.CheckPadding();
    ParallelForOptions po;
    // At most one reader per core: each holds a buffer of the longest chunk.
    po.threads = std::clamp(threads, 1u, std::max(1u, std::thread::hardware_concurrency()));
    ParallelFor(chunks.size(), po, [&] {
      return [&r, &h, &chunks, buf = std::make_unique<char[]>(std::max<uint64_t>(longest, 1)),
              scratch = std::string()](size_t i) mutable {
        r.ReadChunk(h.tensors[chunks[i].first], chunks[i].second, buf.get(), scratch);
        return uint64_t{1};
      };
    });
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kCancelled) throw;  // Ctrl-C is not damage
    if (damage != nullptr) *damage = e.what();
    return false;
  }
  return true;
}

}  // namespace reshard
