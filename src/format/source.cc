#include "reshard/format/source.h"

#include <algorithm>
#include <string>

#include "reshard/base/checksum.h"

namespace reshard {

SourceFingerprint SourceFingerprint::FromFiles(std::vector<SourceFile> files) {
  std::sort(files.begin(), files.end(),
            [](const SourceFile& a, const SourceFile& b) { return a.name < b.name; });
  std::string canonical;
  for (const auto& f : files) {
    canonical += f.name;
    canonical += '\0';
    canonical += std::to_string(f.size);
    canonical += '\0';
    canonical += Hex16(f.header_xxh3);
    canonical += '\0';
    canonical += Hex16(f.sample_xxh3);
    canonical += '\n';
  }
  SourceFingerprint fp;
  fp.files = std::move(files);
  fp.fingerprint = Xxh3(canonical);
  return fp;
}

SourceFingerprint SourceFingerprint::FromSaved(const SavedSource& saved) {
  // formats/rank-file.md: the canonical string of a saved source (it has no files).
  std::string canonical = "saved";
  canonical += '\0';
  canonical += Hex16(saved.id);
  canonical += '\0';
  if (saved.step) canonical += std::to_string(*saved.step);
  canonical += '\n';
  SourceFingerprint fp;
  fp.saved = saved;
  fp.fingerprint = Xxh3(canonical);
  return fp;
}

bool SourceFingerprint::operator==(const SourceFingerprint& other) const {
  if (fingerprint != other.fingerprint || files.size() != other.files.size() ||
      saved != other.saved) {
    return false;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].name != other.files[i].name || files[i].size != other.files[i].size ||
        files[i].header_xxh3 != other.files[i].header_xxh3 ||
        files[i].sample_xxh3 != other.files[i].sample_xxh3) {
      return false;
    }
  }
  return true;
}

}  // namespace reshard
