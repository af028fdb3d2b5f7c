#include "reshard/io/manifest.h"

#include <algorithm>
#include <charconv>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/file_io.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// Parses "rank-00003-of-00008.reshard"; nullopt for other names.
std::optional<std::pair<uint32_t, uint32_t>> ParseRankFileName(const std::string& name) {
  if (name.size() != 27 || !name.starts_with("rank-") || name.substr(10, 4) != "-of-" ||
      !name.ends_with(kRankFileExtension)) {
    return std::nullopt;
  }
  uint32_t r = 0, w = 0;
  auto a = std::from_chars(name.data() + 5, name.data() + 10, r);
  auto b = std::from_chars(name.data() + 14, name.data() + 19, w);
  if (a.ptr != name.data() + 10 || b.ptr != name.data() + 19) return std::nullopt;
  return std::make_pair(r, w);
}

}  // namespace

std::optional<Manifest> ReadManifest(const fs::path& out) {
  const fs::path p = out / kManifestName;
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;
  return ParseManifest(ReadWholeFile(p, 256ull << 20), p.string());
}

void WriteManifest(const fs::path& out, const Manifest& manifest) {
  WriteFileAtomic(out / kManifestName, SerializeManifest(manifest));
}

ManifestLayout ScanLayout(const fs::path& out, const LayoutSpec& layout,
                          const SourceFingerprint& source) {
  ManifestLayout l;
  l.key = layout.Key();
  l.kind = layout.kind;
  l.world_size = layout.world_size;
  l.dtype = layout.dtype;
  l.wrap = layout.wrap;
  l.use_orig_params = layout.use_orig_params;
  l.param_dtype = layout.param_dtype;
  l.mesh = layout.mesh;
  l.plan_name = layout.plan_name;
  l.plan_xxh3 = layout.plan_xxh3;
  l.dir = l.key;
  const fs::path dir = out / l.key;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      auto parsed = ParseRankFileName(name);
      if (!parsed || parsed->second != layout.world_size || parsed->first >= layout.world_size) {
        continue;
      }
      RankFileReader reader = RankFileReader::Open(e.path());
      const RankFileHeader& h = reader.header();
      if (h.layout_key != l.key || h.world_size != layout.world_size ||
          h.dtype_policy != layout.dtype || h.rank != parsed->first || h.kind != layout.kind ||
          h.wrap != layout.wrap || h.use_orig_params != layout.use_orig_params ||
          h.param_dtype != layout.param_dtype || h.mesh != layout.mesh || h.plan_name != layout.plan_name ||
          h.plan_xxh3 != layout.plan_xxh3) {
        Fail(ErrorCode::kMismatch, e.path().string() + ": holds layout " + h.layout_key +
                                       " rank " + std::to_string(h.rank) + ", expected " +
                                       l.key + " rank " + std::to_string(parsed->first));
      }
      if (!(h.source == source)) {
        Fail(ErrorCode::kMismatch, e.path().string() + ": was converted from another source (" +
                                       Hex16(h.source.fingerprint) + ", expected " +
                                       Hex16(source.fingerprint) + ")");
      }
      l.ranks.push_back({h.rank, name, reader.file_size(), reader.preamble().header_xxh3});
    }
  }
  std::sort(l.ranks.begin(), l.ranks.end(),
            [](const ManifestRank& a, const ManifestRank& b) { return a.rank < b.rank; });
  l.complete = l.ranks.size() == layout.world_size;
  return l;
}

ModelManifest ReadModelManifest(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    Fail(ErrorCode::kNotFound, path.string() + ": no such model manifest");
  }
  return ParseModelManifest(ReadWholeFile(path, 256ull << 20), path.string());
}

void CheckListed(const RankFileReader& reader, const Manifest& manifest, const std::string& key,
                 uint32_t rank, const std::string& manifest_path) {
  const RankFileHeader& h = reader.header();
  const std::string path = reader.path();
  const std::string again = "; convert again into this OUT (reshard convert SRC -o OUT ...) and "
                            "check it with reshard verify OUT --source SRC";
  const auto lit = manifest.layouts.find(key);
  if (lit == manifest.layouts.end()) {
    Fail(ErrorCode::kMismatch, path + ": " + manifest_path + " lists no layout " + key);
  }
  const ManifestLayout& ml = lit->second;
  if (h.layout_key != key || h.dtype_policy != ml.dtype || h.world_size != ml.world_size ||
      h.rank != rank) {
    Fail(ErrorCode::kMismatch, path + ": holds rank " + std::to_string(h.rank) + " of layout " +
                                   h.layout_key + " (dtype " + h.dtype_policy + ", world size " +
                                   std::to_string(h.world_size) + "), but " + manifest_path +
                                   " lists it as rank " + std::to_string(rank) + " of " + key +
                                   " (dtype " + ml.dtype + ", world size " +
                                   std::to_string(ml.world_size) + ")" + again);
  }
  if (!(h.source == manifest.source)) {
    Fail(ErrorCode::kMismatch, path + ": converted from source " + Hex16(h.source.fingerprint) +
                                   ", but " + manifest_path + " names source " +
                                   Hex16(manifest.source.fingerprint) +
                                   " (two conversions of different sources into one OUT?)" + again);
  }
  const auto rit = std::find_if(ml.ranks.begin(), ml.ranks.end(),
                                [&](const ManifestRank& r) { return r.rank == h.rank; });
  if (rit == ml.ranks.end()) {
    Fail(ErrorCode::kMismatch, path + ": rank " + std::to_string(h.rank) + " of " + key +
                                   " is not listed in " + manifest_path + again);
  }
  if (reader.file_size() != rit->size || reader.preamble().header_xxh3 != rit->header_xxh3) {
    Fail(ErrorCode::kMismatch,
         path + ": differs from " + manifest_path + "'s entry (size " +
             std::to_string(reader.file_size()) + ", header " + Hex16(reader.preamble().header_xxh3) +
             "; the manifest says " + std::to_string(rit->size) + ", " + Hex16(rit->header_xxh3) +
             "): it was rewritten after the conversion" + again);
  }
}

}  // namespace reshard
