#include "reshard/runtime/rank_writer.h"

#include <algorithm>
#include <chrono>
#include <set>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/io/file_io.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace fs = std::filesystem;

SaveReport SaveRankFile(const fs::path& path, RankFileHeader header,
                        std::span<const SaveSource> sources, DeviceCopier* copier,
                        const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  RemoveStaleTemporaries(path.parent_path().empty() ? fs::path(".") : path.parent_path(),
                         path.filename().string());
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
                                  const std::vector<std::string>& aux_files,
                                  const std::vector<std::string>& parts) {
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
  entry.parts = parts;
  std::sort(entry.parts.begin(), entry.parts.end());
  m.layouts[entry.key] = entry;
  WriteManifest(out, m);
  return entry;
}

}  // namespace reshard
