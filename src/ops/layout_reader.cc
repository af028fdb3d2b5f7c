#include "reshard/ops/layout_reader.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/io/manifest.h"
#include "reshard/io/parallel_for.h"

namespace reshard {

namespace fs = std::filesystem;

bool LayoutBytes::Locate(uint64_t offset, Spot& spot) const {
  const auto it = std::upper_bound(starts.begin(), starts.end(), offset);
  if (it == starts.begin()) return false;
  const size_t ti = static_cast<size_t>(it - starts.begin()) - 1;
  const TensorLocation& t = tensors[ti];
  const uint64_t at = offset - starts[ti];
  if (at >= t.nbytes) return false;
  const auto pit = std::upper_bound(t.pieces.begin(), t.pieces.end(), at,
                                    [](uint64_t v, const TensorPiece& p) { return v < p.dst_offset; });
  spot.piece = &*(pit - 1);
  spot.pos = spot.piece->src_offset + (at - spot.piece->dst_offset);
  spot.left = spot.piece->length - (at - spot.piece->dst_offset);
  return true;
}

Checkpoint LayoutBytes::Index(const fs::path& dir, const SourceFingerprint& source) {
  Checkpoint view;
  starts.clear();
  uint64_t at = 0;
  for (const TensorLocation& t : tensors) {
    SourceTensor s;
    s.name = t.name;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.file_index = 0;
    s.offset = at;
    s.nbytes = t.nbytes;
    starts.push_back(at);
    at += t.nbytes;
    view.tensors.push_back(std::move(s));
  }
  std::sort(view.tensors.begin(), view.tensors.end(),
            [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  view.dir = dir;
  view.fingerprint = source;
  return view;
}

void LayoutByteReader::Read(uint64_t offset, size_t size, void* dst) {
  auto* out = static_cast<char*>(dst);
  while (size > 0) {
    LayoutBytes::Spot at;
    if (!b_.Locate(offset, at)) Fail(ErrorCode::kDataLoss, "read outside the layout's tensors");
    const uint64_t n = std::min<uint64_t>(size, at.left);
    ReadEntry(at.piece->rank, at.piece->entry, at.pos, n, out);
    out += n;
    offset += n;
    size -= n;
  }
}

// Decoded bytes [pos, pos + n) of entry `entry` of rank file `rank`, chunk by chunk.
void LayoutByteReader::ReadEntry(uint32_t rank, size_t entry, uint64_t pos, uint64_t n, char* out) {
  const RankFileReader& r = b_.readers[rank];
  const TensorEntry& e = r.header().tensors[entry];
  const uint64_t cs = r.header().chunk_size;
  while (n > 0) {
    const uint64_t chunk = pos / cs;
    const uint64_t c0 = chunk * cs;
    const uint64_t clen = ChunkLength(e, cs, chunk);
    const uint64_t take = std::min(n, c0 + clen - pos);
    // Read O_DIRECT: whole raw chunks that follow one another in one request (the disk is
    // faster with fewer, larger ones), each checked after.
    const uint64_t run_end = pos + n >= e.nbytes ? e.nbytes : (pos + n) / cs * cs;
    if (direct_ && e.codec == Codec::kRaw && pos == c0 && run_end > c0 + clen) {
      reader_.Read((*direct_)[rank], out, run_end - pos, r.preamble().data_offset + e.offset + pos);
      for (uint64_t c = chunk, at = c0; verify_ && at < run_end; ++c, at += cs) {
        r.CheckChunk(e, c, Xxh3(out + (at - pos), ChunkLength(e, cs, c)));
      }
      out += run_end - pos;
      n -= run_end - pos;
      pos = run_end;
      continue;
    }
    if (pos == c0 && take == clen && (verify_ || e.codec != Codec::kRaw)) {
      r.ReadChunk(e, chunk, out, frame_, hash_piece_, Direct(rank));  // a whole chunk: straight to its destination
    } else if (!verify_ && e.codec == Codec::kRaw) {
      const uint64_t at = r.preamble().data_offset + e.offset + pos;
      if (direct_) {
        reader_.Read((*direct_)[rank], out, take, at);
      } else {
        r.file().PReadExact(out, take, at);
      }
    } else {
      Cached* hit = nullptr;
      for (Cached& c : cache_) {
        if (c.rank == rank && c.entry == entry && c.chunk == chunk) hit = &c;
      }
      if (!hit) {
        // A chunk read in part before and evicted since: the reads interleave chunks (a
        // Shard(1) tensor's rows), so keep up to kCachedChunks from now on. Until then one
        // buffer, reused: a load reads most partial chunks once, and fresh buffers per chunk
        // cost their page faults on every load (run AP: 0.90x -> 0.53x the rank file, warm).
        const ChunkKey key{rank, entry, chunk};
        if (std::find(seen_.begin(), seen_.end(), key) != seen_.end()) limit_ = kCachedChunks;
        if (seen_.size() < kCachedChunks) {
          seen_.push_back(key);
        } else {
          seen_[seen_next_] = key;
          seen_next_ = (seen_next_ + 1) % kCachedChunks;
        }
        uint64_t held = clen;
        for (const Cached& c : cache_) held += c.bytes.size();
        std::vector<char> storage;  // an evicted chunk's, reused
        while (!cache_.empty() && (cache_.size() >= limit_ || held > kCachedBytes)) {
          auto lru = std::min_element(cache_.begin(), cache_.end(),
                                      [](const Cached& a, const Cached& b) { return a.used < b.used; });
          held -= lru->bytes.size();
          if (lru->bytes.capacity() > storage.capacity()) storage = std::move(lru->bytes);
          cache_.erase(lru);
        }
        Cached c;
        c.bytes = std::move(storage);
        c.bytes.resize(clen);
        r.ReadChunk(e, chunk, c.bytes.data(), frame_, hash_piece_, Direct(rank));  // kept only when read and checked
        ++partial_reads_;
        c.rank = rank, c.entry = entry, c.chunk = chunk;
        cache_.push_back(std::move(c));
        hit = &cache_.back();
      }
      hit->used = ++clock_;
      std::memcpy(out, hit->bytes.data() + (pos - c0), take);
    }
    out += take;
    pos += take;
    n -= take;
  }
}

void OpenLayout(const fs::path& out, const Manifest& manifest, const std::string& key,
                OpenedLayout& opened, HeaderCache* cache) {
  opened.description = "layout " + key + " of " + out.string();
  const std::string mpath = (out / kManifestName).string();
  const auto lit = manifest.layouts.find(key);
  if (lit == manifest.layouts.end()) Fail(ErrorCode::kNotFound, mpath + ": no layout \"" + key + "\"");
  const ManifestLayout& ml = lit->second;
  if (!ml.complete || ml.ranks.size() != ml.world_size) {
    Fail(ErrorCode::kMismatch, opened.description + " is incomplete: " + std::to_string(ml.ranks.size()) +
                                   " of " + std::to_string(ml.world_size) + " rank files");
  }
  opened.dir = out / (ml.dir.empty() ? key : ml.dir);
  LayoutBytes& bytes = opened.bytes;
  std::vector<std::optional<RankFileReader>> readers(ml.ranks.size());
  ParallelForOptions po;
  po.threads = static_cast<unsigned>(std::min<size_t>(ml.ranks.size(), 64));
  ParallelFor(ml.ranks.size(), po, [&] {
    return [&](size_t i) -> uint64_t {
      const ManifestRank& mr = ml.ranks[i];
      readers[i].emplace(RankFileReader::Open(opened.dir / mr.file, cache));
      CheckListed(*readers[i], manifest, key, mr.rank, mpath);
      return 0;
    };
  });
  for (auto& r : readers) bytes.readers.push_back(std::move(*r));
  std::vector<const RankFileHeader*> headers;
  std::vector<std::string> paths;
  for (const RankFileReader& r : bytes.readers) {
    headers.push_back(&r.header());
    paths.push_back(r.path());
  }
  bytes.tensors = DescribeLayoutTensors(headers, paths);
  opened.view = bytes.Index(out, manifest.source);
}

}  // namespace reshard
