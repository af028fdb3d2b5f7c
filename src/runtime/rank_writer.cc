#include "reshard/runtime/rank_writer.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <set>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/io/file_io.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

struct StateFree {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

std::string RankFileTempSuffix() {
  return TempSuffix();
}

struct RankFileWriter::Progress {
  uint64_t written = 0;
  std::unique_ptr<XXH3_state_t, StateFree> state;  // for chunks that arrive in pieces
};

RankFileWriter::RankFileWriter(RankFileWriter&& other) noexcept
    : final_path_(std::move(other.final_path_)),
      tmp_path_(std::move(other.tmp_path_)),
      header_(std::move(other.header_)),
      data_size_(other.data_size_),
      file_(std::move(other.file_)),
      progress_(std::move(other.progress_)),
      committed_(other.committed_) {
  other.committed_ = true;  // nothing left for `other` to remove
  other.tmp_path_.clear();
}
RankFileWriter& RankFileWriter::operator=(RankFileWriter&& other) noexcept {
  if (this != &other) {
    Abort();
    final_path_ = std::move(other.final_path_);
    tmp_path_ = std::move(other.tmp_path_);
    header_ = std::move(other.header_);
    data_size_ = other.data_size_;
    file_ = std::move(other.file_);
    progress_ = std::move(other.progress_);
    committed_ = other.committed_;
    other.committed_ = true;  // nothing left for `other` to remove
    other.tmp_path_.clear();
  }
  return *this;
}

RankFileWriter::~RankFileWriter() { Abort(); }

void RankFileWriter::Abort() noexcept {
  if (committed_ || tmp_path_.empty()) return;
  try {
    file_.Close();
  } catch (...) {
  }
  std::error_code ec;
  fs::remove(tmp_path_, ec);
  tmp_path_.clear();
}

RankFileWriter RankFileWriter::Create(const fs::path& final_path, RankFileHeader header) {
  const std::string where = final_path.string();
  if (header.writer.empty()) header.writer = std::string(WriterString());
  if (header.chunk_size == 0 || header.chunk_size % kDataAlignment != 0) {
    Fail(ErrorCode::kInvalidArgument, where + ": chunk_size " + std::to_string(header.chunk_size) +
                                          " is not a positive multiple of 4096");
  }
  uint64_t cursor = 0;
  for (auto& e : header.tensors) {
    uint64_t numel = 1;
    for (uint64_t d : e.local_shape) numel = CheckedMul(numel, d, where + ": " + e.name + " numel");
    auto bytes = BytesFor(e.dtype, numel);
    if (!bytes) {
      Fail(ErrorCode::kInvalidArgument,
           where + ": tensor \"" + e.name + "\": " + std::to_string(numel) + " elements of " +
               std::string(Name(e.dtype)) + " are not a whole number of bytes");
    }
    e.nbytes = *bytes;
    e.codec = Codec::kRaw;
    e.stored_size = e.nbytes;
    e.offset = AlignUp(cursor, kDataAlignment);
    cursor = CheckedAdd(e.offset, e.nbytes, where + ": data size");
    e.chunk_xxh3.assign(e.ChunkCount(header.chunk_size), 0);
    e.frames.clear();
    e.xxh3 = CombineChunkChecksums(e.chunk_xxh3);
  }
  const uint64_t data_size = AlignUp(cursor, kDataAlignment);
  // The reader's rules decide what a valid header is: check the one we will write, with
  // placeholder checksums, before any byte goes to disk.
  try {
    ParseHeader(SerializeHeader(header), data_size, where);
  } catch (const Error& e) {
    Fail(ErrorCode::kInvalidArgument, std::string("cannot write ") + e.what());
  }

  RankFileWriter w;
  w.final_path_ = final_path;
  w.tmp_path_ = final_path.parent_path() /
                ("." + final_path.filename().string() + RankFileTempSuffix());
  w.header_ = std::move(header);
  w.data_size_ = data_size;
  w.progress_.resize(w.header_.tensors.size());
  w.file_ = File::Create(w.tmp_path_);
  w.file_.Truncate(kDataOffset + data_size);  // holes are zeros: the padding the spec asks for
  return w;
}

size_t RankFileWriter::IndexOf(std::string_view name) const {
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    if (header_.tensors[i].name == name) return i;
  }
  Fail(ErrorCode::kInvalidArgument,
       final_path_.string() + ": the file has no tensor \"" + std::string(name) + "\"");
}

uint64_t RankFileWriter::Written(size_t index) const { return progress_.at(index).written; }

void RankFileWriter::Append(size_t index, const void* data, uint64_t n) {
  if (committed_) Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": already committed");
  if (index >= header_.tensors.size()) {
    Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": tensor index " +
                                          std::to_string(index) + " out of range");
  }
  TensorEntry& e = header_.tensors[index];
  Progress& p = progress_[index];
  if (n > e.nbytes - p.written) {
    Fail(ErrorCode::kInvalidArgument,
         final_path_.string() + ": tensor \"" + e.name + "\": appending " + std::to_string(n) +
             " bytes after " + std::to_string(p.written) + " of " + std::to_string(e.nbytes));
  }
  if (n == 0) return;
  file_.PWriteExact(data, n, kDataOffset + e.offset + p.written);
  const uint64_t cs = header_.chunk_size;
  const char* d = static_cast<const char*>(data);
  uint64_t left = n;
  while (left > 0) {
    const uint64_t chunk = p.written / cs;
    const uint64_t in_chunk = p.written % cs;
    const uint64_t chunk_len = std::min(cs, e.nbytes - chunk * cs);
    const uint64_t take = std::min(left, chunk_len - in_chunk);
    if (in_chunk == 0 && take == chunk_len) {
      e.chunk_xxh3[chunk] = Xxh3(d, take);
    } else {
      if (!p.state) {
        p.state.reset(XXH3_createState());
        if (!p.state) Fail(ErrorCode::kIo, "out of memory for a checksum state");
      }
      if (in_chunk == 0) XXH3_64bits_reset(p.state.get());
      XXH3_64bits_update(p.state.get(), d, take);
      if (in_chunk + take == chunk_len) e.chunk_xxh3[chunk] = XXH3_64bits_digest(p.state.get());
    }
    d += take;
    left -= take;
    p.written += take;
  }
}

uint64_t RankFileWriter::Commit(bool verify_data) {
  if (committed_) Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": already committed");
  try {
    for (size_t i = 0; i < header_.tensors.size(); ++i) {
      const TensorEntry& e = header_.tensors[i];
      if (progress_[i].written != e.nbytes) {
        Fail(ErrorCode::kInvalidArgument,
             final_path_.string() + ": tensor \"" + e.name + "\" is incomplete: " +
                 std::to_string(progress_[i].written) + " of " + std::to_string(e.nbytes) +
                 " bytes written");
      }
    }
    for (auto& e : header_.tensors) e.xxh3 = CombineChunkChecksums(e.chunk_xxh3);
    const std::string text = SerializeHeader(header_);
    Preamble p;
    p.data_size = data_size_;
    p.header_offset = kDataOffset + data_size_;
    p.header_size = text.size();
    p.header_xxh3 = Xxh3(text);
    file_.PWriteExact(text.data(), text.size(), p.header_offset);
    file_.Truncate(p.header_offset + p.header_size);
    const auto pre = EncodePreamble(p);
    file_.PWriteExact(pre.data(), pre.size(), 0);
    file_.Sync();
    file_.Close();
    // What lands under the final name has passed the reader's checks.
    RankFileReader reader = RankFileReader::Open(tmp_path_);
    if (verify_data) {
      std::unique_ptr<char[]> buf(new char[header_.chunk_size]);
      std::string scratch;
      for (const auto& e : reader.header().tensors) {
        for (uint64_t c = 0; c < e.ChunkCount(header_.chunk_size); ++c) {
          reader.ReadChunk(e, c, buf.get(), scratch);
        }
      }
    }
    const uint64_t size = reader.file_size();
    if (std::rename(tmp_path_.c_str(), final_path_.c_str()) != 0) {
      Fail(ErrorCode::kIo, final_path_.string() + ": cannot rename " + tmp_path_.string() +
                               " into place");
    }
    committed_ = true;
    SyncDirectory(final_path_.parent_path());
    return size;
  } catch (...) {
    Abort();
    throw;
  }
}

SaveReport SaveRankFile(const fs::path& path, RankFileHeader header,
                        std::span<const SaveSource> sources, DeviceCopier* copier,
                        const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  RankFileWriter w = RankFileWriter::Create(path, std::move(header));
  const auto& entries = w.header().tensors;
  std::vector<const SaveSource*> by_entry(entries.size(), nullptr);
  bool any_device = false;
  for (const auto& s : sources) {
    const size_t i = w.IndexOf(s.name);
    if (by_entry[i]) {
      Fail(ErrorCode::kInvalidArgument, path.string() + ": tensor \"" + s.name + "\" given twice");
    }
    if (s.nbytes != entries[i].nbytes) {
      Fail(ErrorCode::kInvalidArgument,
           path.string() + ": tensor \"" + s.name + "\": the source has " +
               std::to_string(s.nbytes) + " bytes, the entry " + std::to_string(entries[i].nbytes));
    }
    if (s.nbytes > 0 && s.ptr == nullptr) {
      Fail(ErrorCode::kInvalidArgument, path.string() + ": tensor \"" + s.name + "\": null pointer");
    }
    by_entry[i] = &s;
    any_device |= s.on_device && s.nbytes > 0;
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!by_entry[i]) {
      Fail(ErrorCode::kInvalidArgument,
           path.string() + ": no source for tensor \"" + entries[i].name + "\"");
    }
  }
  SaveReport report;
  char* staging[2] = {nullptr, nullptr};
  uint64_t half = 0;
  if (any_device) {
    if (!copier) {
      Fail(ErrorCode::kInvalidArgument,
           path.string() + ": device tensors need a device copier (a CUDA build)");
    }
    half = AlignUp(std::max<uint64_t>(options.staging_bytes, 8192) / 2, kDataAlignment);
    copier->BindThread(0);
    copier->Reserve(half, 1);
    for (int s = 0; s < 2; ++s) staging[s] = static_cast<char*>(copier->Staging(0, s, half));
    report.staging_bytes = 2 * half;
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (options.before_tensor) options.before_tensor(i);
    const SaveSource& s = *by_entry[i];
    if (s.nbytes == 0) continue;
    if (!s.on_device) {
      w.Append(i, s.ptr, s.nbytes);
    } else {
      // Piece k is copied into slot k % 2 while piece k - 1 is written from the other.
      const char* src = static_cast<const char*>(s.ptr);
      const uint64_t pieces = CeilDiv(s.nbytes, half);
      for (uint64_t k = 0; k <= pieces; ++k) {
        if (k < pieces) {
          const uint64_t len = std::min(half, s.nbytes - k * half);
          copier->CopyToHostAsync(0, static_cast<int>(k % 2), staging[k % 2], src + k * half, len);
        }
        if (k > 0) {
          const uint64_t prev = k - 1;
          const int slot = static_cast<int>(prev % 2);
          copier->WaitSlot(0, slot);
          w.Append(i, staging[slot], std::min(half, s.nbytes - prev * half));
        }
      }
    }
    report.bytes += s.nbytes;
  }
  if (any_device) copier->Synchronize();
  report.file_size = w.Commit(options.verify_data);
  RankFileReader r = RankFileReader::Open(path);
  report.header_xxh3 = r.preamble().header_xxh3;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

ManifestLayout WriteSavedManifest(const fs::path& out, const LayoutSpec& layout,
                                  const SourceFingerprint& source,
                                  const std::vector<std::string>& aux_files) {
  DirectoryLock lock(out / kLockName, 60);
  std::optional<Manifest> existing = ReadManifest(out);
  if (existing && !(existing->source == source)) {
    Fail(ErrorCode::kMismatch,
         out.string() + ": already holds a checkpoint of another source (fingerprint " +
             Hex16(existing->source.fingerprint) + ", this save is " + Hex16(source.fingerprint) +
             "); save into an empty directory");
  }
  ManifestLayout entry = ScanLayout(out, layout, source);
  if (!entry.complete) {
    std::set<uint32_t> present;
    for (const auto& r : entry.ranks) present.insert(r.rank);
    std::string missing;
    for (uint32_t r = 0; r < layout.world_size; ++r) {
      if (!present.count(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    Fail(ErrorCode::kDataLoss, (out / entry.key).string() + ": rank file(s) of rank " + missing +
                                   " missing; the save did not complete");
  }
  Manifest m = existing.value_or(Manifest{});
  m.writer = std::string(WriterString());
  m.source = source;
  for (const auto& a : aux_files) {
    if (std::find(m.aux_files.begin(), m.aux_files.end(), a) == m.aux_files.end()) {
      m.aux_files.push_back(a);
    }
  }
  m.layouts[entry.key] = entry;
  WriteManifest(out, m);
  return entry;
}

}  // namespace reshard
