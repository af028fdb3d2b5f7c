#include "reshard/io/rank_file_writer.h"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

struct StateFree {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

std::string RankFileTempSuffix() { return TempSuffix(); }

void RemoveStaleTemporaries(const fs::path& dir, std::string_view for_file) {
  const std::string prefix = for_file.empty() ? std::string(".rank-") : "." + std::string(for_file) + ".tmp-";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto at = name.find(".tmp-");
    if (!name.starts_with(prefix) || at == std::string::npos) continue;
    if (!OwnerIsDeadLocalProcess(std::string_view(name).substr(at + 5), true)) continue;
    std::error_code rm;
    fs::remove(e.path(), rm);
  }
}

// ---- ChunkEncoder ------------------------------------------------------------------------

struct ChunkEncoder::Zstd {
  struct FreeCCtx {
    void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  };
  std::unique_ptr<ZSTD_CCtx, FreeCCtx> cctx;
  size_t bound = 0;
  std::unique_ptr<char[]> frame;
};

ChunkEncoder::ChunkEncoder(Codec codec, uint64_t chunk_size, int zstd_level)
    : codec_(codec), chunk_size_(chunk_size), level_(zstd_level) {
  if (codec_ == Codec::kZstd) {
    zstd_ = std::make_unique<Zstd>();
    zstd_->cctx.reset(ZSTD_createCCtx());
    if (!zstd_->cctx) Fail(ErrorCode::kIo, "out of memory for a zstd compression context");
    zstd_->bound = ZSTD_compressBound(chunk_size_);
    zstd_->frame.reset(new char[zstd_->bound]);
  }
}

ChunkEncoder::ChunkEncoder(ChunkEncoder&&) noexcept = default;
ChunkEncoder& ChunkEncoder::operator=(ChunkEncoder&&) noexcept = default;
ChunkEncoder::~ChunkEncoder() = default;

std::span<const char> ChunkEncoder::Encode(const void* data, uint64_t n) {
  if (n > chunk_size_) {
    Fail(ErrorCode::kInvalidArgument, "a chunk of " + std::to_string(n) +
                                          " bytes is larger than the chunk size " +
                                          std::to_string(chunk_size_));
  }
  if (codec_ == Codec::kRaw) return {static_cast<const char*>(data), n};
  const size_t size =
      ZSTD_compressCCtx(zstd_->cctx.get(), zstd_->frame.get(), zstd_->bound, data, n, level_);
  if (ZSTD_isError(size)) {
    Fail(ErrorCode::kIo, std::string("zstd compression failed: ") + ZSTD_getErrorName(size));
  }
  return {zstd_->frame.get(), size};
}

// ---- RankFileWriter ----------------------------------------------------------------------

struct RankFileWriter::Progress {
  std::atomic<uint64_t> written{0};
  std::unique_ptr<XXH3_state_t, StateFree> state;  // for chunks that arrive in pieces
};

RankFileWriter::RankFileWriter() = default;

RankFileWriter::RankFileWriter(RankFileWriter&& other) noexcept
    : final_path_(std::move(other.final_path_)),
      tmp_path_(std::move(other.tmp_path_)),
      header_(std::move(other.header_)),
      options_(other.options_),
      data_size_(other.data_size_),
      cursor_(other.cursor_),
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
    options_ = other.options_;
    data_size_ = other.data_size_;
    cursor_ = other.cursor_;
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

RankFileWriter RankFileWriter::Create(const fs::path& final_path, RankFileHeader header,
                                      const RankFileWriterOptions& options) {
  const std::string where = final_path.string();
  if (header.writer.empty()) header.writer = std::string(WriterString());
  if (header.chunk_size == 0 || header.chunk_size % kDataAlignment != 0) {
    Fail(ErrorCode::kInvalidArgument, where + ": chunk_size " + std::to_string(header.chunk_size) +
                                          " is not a positive multiple of 4096");
  }
  // The raw layout: zstd offsets, sizes and frames are only known as the frames arrive.
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
  // The reader's rules decide what a valid header is: check the one we will write (its raw
  // layout, with placeholder checksums) before any byte goes to disk.
  try {
    ParseHeader(SerializeHeader(header), data_size, where);
  } catch (const Error& e) {
    Fail(ErrorCode::kInvalidArgument, std::string("cannot write ") + e.what());
  }
  if (options.codec == Codec::kZstd) {
    for (auto& e : header.tensors) {
      if (e.nbytes == 0) continue;  // no chunks: raw
      e.codec = Codec::kZstd;
      e.frames.resize(e.chunk_xxh3.size());
    }
  }

  RankFileWriter w;
  w.final_path_ = final_path;
  w.tmp_path_ = final_path.parent_path() /
                ("." + final_path.filename().string() + RankFileTempSuffix());
  w.header_ = std::move(header);
  w.options_ = options;
  w.data_size_ = data_size;
  w.progress_.reset(new Progress[w.header_.tensors.size()]);
  w.file_ = File::Create(w.tmp_path_);
  if (options.codec == Codec::kRaw) {
    w.file_.Truncate(kDataOffset + data_size);  // holes are zeros: the padding the spec asks for
  }
  return w;
}

size_t RankFileWriter::IndexOf(std::string_view name) const {
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    if (header_.tensors[i].name == name) return i;
  }
  Fail(ErrorCode::kInvalidArgument,
       final_path_.string() + ": the file has no tensor \"" + std::string(name) + "\"");
}

uint64_t RankFileWriter::Written(size_t index) const {
  if (index >= header_.tensors.size()) {
    Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": tensor index " +
                                          std::to_string(index) + " out of range");
  }
  return progress_[index].written.load();
}

void RankFileWriter::Append(size_t index, const void* data, uint64_t n) {
  if (committed_) Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": already committed");
  if (options_.codec != Codec::kRaw) {
    Fail(ErrorCode::kInvalidArgument,
         final_path_.string() + ": Append writes raw files; zstd chunks go through WriteChunk");
  }
  if (index >= header_.tensors.size()) {
    Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": tensor index " +
                                          std::to_string(index) + " out of range");
  }
  TensorEntry& e = header_.tensors[index];
  Progress& p = progress_[index];
  uint64_t written = p.written.load();
  if (n > e.nbytes - written) {
    Fail(ErrorCode::kInvalidArgument,
         final_path_.string() + ": tensor \"" + e.name + "\": appending " + std::to_string(n) +
             " bytes after " + std::to_string(written) + " of " + std::to_string(e.nbytes));
  }
  if (n == 0) return;
  // In pieces, each handed to the disk as soon as it is written (StartWriteback), so that
  // Commit's fsync finds little left to write: a save is durable near the disk's speed.
  for (uint64_t at = 0; at < n; at += kWritebackPiece) {
    const uint64_t len = std::min<uint64_t>(kWritebackPiece, n - at);
    const uint64_t off = kDataOffset + e.offset + written + at;
    file_.PWriteExact(static_cast<const char*>(data) + at, len, off);
    file_.StartWriteback(off, len);
  }
  const uint64_t cs = header_.chunk_size;
  const char* d = static_cast<const char*>(data);
  uint64_t left = n;
  while (left > 0) {
    const uint64_t chunk = written / cs;
    const uint64_t in_chunk = written % cs;
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
    written += take;
    p.written.store(written);
  }
}

std::span<const char> RankFileWriter::EncodeChunk(size_t index, uint64_t chunk, const void* data,
                                                  ChunkEncoder& encoder) {
  if (index >= header_.tensors.size() ||
      chunk >= header_.tensors[index].ChunkCount(header_.chunk_size)) {
    Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": no chunk " +
                                          std::to_string(chunk) + " of tensor index " +
                                          std::to_string(index));
  }
  if (encoder.codec() != options_.codec) {
    Fail(ErrorCode::kInvalidArgument,
         final_path_.string() + ": a " + std::string(CodecName(encoder.codec())) +
             " encoder for a " + std::string(CodecName(options_.codec)) + " file");
  }
  TensorEntry& e = header_.tensors[index];
  const uint64_t n = ChunkLength(e, header_.chunk_size, chunk);
  e.chunk_xxh3[chunk] = Xxh3(data, n);
  return encoder.Encode(data, n);
}

void RankFileWriter::WriteChunk(size_t index, uint64_t chunk, std::span<const char> stored) {
  if (committed_) Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": already committed");
  if (index >= header_.tensors.size() ||
      chunk >= header_.tensors[index].ChunkCount(header_.chunk_size)) {
    Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": no chunk " +
                                          std::to_string(chunk) + " of tensor index " +
                                          std::to_string(index));
  }
  TensorEntry& e = header_.tensors[index];
  const uint64_t cs = header_.chunk_size;
  const uint64_t n = ChunkLength(e, cs, chunk);
  if (options_.codec == Codec::kRaw) {
    if (stored.size() != n) {
      Fail(ErrorCode::kInvalidArgument,
           final_path_.string() + ": tensor \"" + e.name + "\" chunk " + std::to_string(chunk) +
               ": " + std::to_string(stored.size()) + " bytes, expected " + std::to_string(n));
    }
    file_.PWriteExact(stored.data(), n, kDataOffset + e.offset + ChunkBegin(cs, chunk));
  } else {
    if (chunk == 0) {
      cursor_ = AlignUp(cursor_, kDataAlignment);
      e.offset = cursor_;
    }
    const uint64_t at = cursor_;
    cursor_ += stored.size();
    e.frames[chunk] = {at - e.offset, stored.size()};
    e.stored_size = cursor_ - e.offset;
    file_.PWriteExact(stored.data(), stored.size(), kDataOffset + at);
  }
  progress_[index].written += n;
}

uint64_t RankFileWriter::Commit(bool verify_data) {
  if (committed_) Fail(ErrorCode::kInvalidArgument, final_path_.string() + ": already committed");
  try {
    for (size_t i = 0; i < header_.tensors.size(); ++i) {
      const TensorEntry& e = header_.tensors[i];
      const uint64_t written = progress_[i].written.load();
      if (written != e.nbytes) {
        Fail(ErrorCode::kInvalidArgument,
             final_path_.string() + ": tensor \"" + e.name + "\" is incomplete: " +
                 std::to_string(written) + " of " + std::to_string(e.nbytes) + " bytes written");
      }
    }
    uint64_t data_size = data_size_;
    if (options_.codec == Codec::kZstd) {
      // Place empty tensors (no chunks) right after their predecessor, keeping offsets sorted.
      uint64_t end = 0;
      for (auto& e : header_.tensors) {
        if (e.nbytes == 0) e.offset = AlignUp(end, kDataAlignment);
        end = e.offset + e.stored_size;
      }
      data_size = AlignUp(cursor_, kDataAlignment);
    }
    for (auto& e : header_.tensors) e.xxh3 = CombineChunkChecksums(e.chunk_xxh3);
    const std::string text = SerializeHeader(header_);
    Preamble p;
    p.data_size = data_size;
    p.header_offset = kDataOffset + data_size;
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
    if (options_.sync_directory) SyncDirectory(final_path_.parent_path());
    return size;
  } catch (...) {
    Abort();
    throw;
  }
}

}  // namespace reshard
