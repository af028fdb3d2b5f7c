#include "reshard/format/manifest.h"

#include <algorithm>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

using internal::GetArray;
using internal::GetBool;
using internal::GetHex16;
using internal::GetString;
using internal::GetU64;
using internal::Member;
using nlohmann::json;

LayoutSpec ManifestLayout::Layout() const {
  LayoutSpec spec;
  spec.kind = kind;
  spec.world_size = world_size;
  spec.dtype = dtype;
  spec.wrap = wrap;
  spec.use_orig_params = use_orig_params;
  spec.param_dtype = param_dtype;
  spec.mesh = mesh;
  spec.plan_name = plan_name;
  spec.plan_xxh3 = plan_xxh3;
  return spec;
}

std::string SerializeManifest(const Manifest& m) {
  json j;
  j["format"] = kManifestFormatName;
  j["format_version"] = kManifestVersion;
  j["writer"] = m.writer.empty() ? std::string(WriterString()) : m.writer;
  j["source"] = internal::SourceToJson(m.source);
  j["aux_files"] = m.aux_files;
  json layouts = json::object();
  for (const auto& [key, l] : m.layouts) {
    json ranks = json::array();
    for (const auto& r : l.ranks) {
      ranks.push_back({{"rank", r.rank},
                       {"file", r.file},
                       {"size", r.size},
                       {"header_xxh3", Hex16(r.header_xxh3)}});
    }
    layouts[key] = {{"kind", l.Layout().KindName()}, {"world_size", l.world_size},
                    {"dtype", l.dtype},        {"dir", l.dir},
                    {"ranks", ranks},          {"complete", l.complete}};
    if (l.kind == LayoutKind::kFsdp1) {
      layouts[key]["wrap"] = l.wrap;
      layouts[key]["use_orig_params"] = l.use_orig_params;
      layouts[key]["param_dtype"] = l.param_dtype;
    }
    if (l.kind == LayoutKind::kDTensor) {
      layouts[key]["mesh"] = {{"names", l.mesh.names}, {"shape", l.mesh.shape}};
      layouts[key]["plan"] = {{"name", l.plan_name}, {"xxh3", Hex16(l.plan_xxh3)}};
    }
    if (!l.from.empty()) layouts[key]["from"] = l.from;
    if (!l.parts.empty()) layouts[key]["parts"] = l.parts;
  }
  j["layouts"] = layouts;
  return j.dump(2) + "\n";
}

Manifest ParseManifest(std::string_view text, const std::string& path) {
  json j = internal::ParseStrictJson(text, path, "manifest");
  Manifest m;
  std::string format = GetString(Member(j, "format", path, "manifest"), path, "format");
  if (format != kManifestFormatName) {
    FailField(path, "format", "\"" + format + "\"", "\"reshard.manifest\"");
  }
  uint64_t v = GetU64(Member(j, "format_version", path, "manifest"), path, "format_version");
  if (v != kManifestVersion) {
    FailField(path, "format_version", std::to_string(v), std::to_string(kManifestVersion));
  }
  if (j.contains("writer")) m.writer = GetString(j["writer"], path, "writer");
  m.source = internal::SourceFromJson(Member(j, "source", path, "manifest"), path);
  const json& aux = GetArray(Member(j, "aux_files", path, "manifest"), path, "aux_files");
  for (size_t i = 0; i < aux.size(); ++i) {
    const std::string f = "aux_files[" + std::to_string(i) + "]";
    std::string name = GetString(aux[i], path, f);
    // Copied by reshard.save and export from the manifest's directory into another one: a
    // name that is a path (or the manifest's own name) would read or write outside it.
    if (!internal::PlainFileName(name) || name == kManifestName || name == kLockName ||
        name == kConvertClaimName) {
      FailField(path, f, "\"" + Printable(name) + "\"",
                "a plain file name in the manifest's directory (no '/', '\\', \"..\", NUL or "
                "control characters; not reshard.json, .reshard.lock or .reshard.convert)");
    }
    m.aux_files.push_back(std::move(name));
  }
  const json& layouts =
      internal::GetObject(Member(j, "layouts", path, "manifest"), path, "layouts");
  for (const auto& [key, jl] : layouts.items()) {
    const std::string f = "layouts[\"" + key + "\"]";
    if (!internal::ValidLayoutKey(key)) {
      FailField(path, f, "the key \"" + key + "\"", "a directory name of [A-Za-z0-9._-]");
    }
    ManifestLayout l;
    l.key = key;
    std::string kind = GetString(Member(jl, "kind", path, f), path, f + ".kind");
    auto k = ParseLayoutKind(kind);
    if (!k) FailField(path, f + ".kind", "\"" + kind + "\"", "\"fsdp2\", \"fsdp1\" or \"dtensor\"");
    l.kind = *k;
    if (l.kind == LayoutKind::kDTensor) {
      const json& mesh = internal::GetObject(Member(jl, "mesh", path, f), path, f + ".mesh");
      const json& names = GetArray(Member(mesh, "names", path, f + ".mesh"), path, f + ".mesh.names");
      const json& shape = GetArray(Member(mesh, "shape", path, f + ".mesh"), path, f + ".mesh.shape");
      for (size_t i = 0; i < names.size(); ++i) {
        l.mesh.names.push_back(GetString(names[i], path, f + ".mesh.names[" + std::to_string(i) + "]"));
      }
      for (size_t i = 0; i < shape.size(); ++i) {
        const uint64_t v = GetU64(shape[i], path, f + ".mesh.shape[" + std::to_string(i) + "]");
        if (v == 0 || v > (1u << 20)) {
          FailField(path, f + ".mesh.shape[" + std::to_string(i) + "]", std::to_string(v), "1 to 2^20");
        }
        l.mesh.shape.push_back(static_cast<uint32_t>(v));
      }
      try {
        l.mesh.Check(f + ".mesh");
      } catch (const Error& e) {
        Fail(ErrorCode::kDataLoss, path + ": " + e.what());
      }
      const json& plan = internal::GetObject(Member(jl, "plan", path, f), path, f + ".plan");
      l.plan_name = GetString(Member(plan, "name", path, f + ".plan"), path, f + ".plan.name");
      l.plan_xxh3 = internal::GetHex16(Member(plan, "xxh3", path, f + ".plan"), path, f + ".plan.xxh3");
    }
    if (l.kind == LayoutKind::kFsdp1) {
      const json& wrap = GetArray(Member(jl, "wrap", path, f), path, f + ".wrap");
      for (size_t i = 0; i < wrap.size(); ++i) {
        l.wrap.push_back(GetString(wrap[i], path, f + ".wrap[" + std::to_string(i) + "]"));
      }
      l.use_orig_params =
          GetBool(Member(jl, "use_orig_params", path, f), path, f + ".use_orig_params");
      l.param_dtype = GetString(Member(jl, "param_dtype", path, f), path, f + ".param_dtype");
    }
    uint64_t ws = GetU64(Member(jl, "world_size", path, f), path, f + ".world_size");
    if (ws == 0 || ws > 1u << 24) FailField(path, f + ".world_size", std::to_string(ws), "1..2^24");
    l.world_size = static_cast<uint32_t>(ws);
    l.dtype = GetString(Member(jl, "dtype", path, f), path, f + ".dtype");
    l.dir = GetString(Member(jl, "dir", path, f), path, f + ".dir");
    if (jl.contains("from")) {
      l.from = GetString(jl["from"], path, f + ".from");
      if (!internal::ValidLayoutKey(l.from) || l.from == key) {
        FailField(path, f + ".from", "\"" + Printable(l.from) + "\"", "the key of another layout of this manifest");
      }
    }
    if (jl.contains("parts")) {
      const json& parts = GetArray(jl["parts"], path, f + ".parts");
      for (size_t i = 0; i < parts.size(); ++i) {
        l.parts.push_back(GetString(parts[i], path, f + ".parts[" + std::to_string(i) + "]"));
      }
      const bool sorted_unique = std::adjacent_find(l.parts.begin(), l.parts.end(),
                                                    [](const std::string& a, const std::string& b) {
                                                      return a >= b;
                                                    }) == l.parts.end();
      const bool valid = std::all_of(l.parts.begin(), l.parts.end(),
                                     [](const std::string& k) { return internal::ValidLayoutKey(k); });
      if (l.parts.size() < 2 || !sorted_unique || !valid ||
          std::find(l.parts.begin(), l.parts.end(), key) == l.parts.end()) {
        std::string found;
        for (const auto& k : l.parts) found += (found.empty() ? "" : ", ") + Printable(k);
        FailField(path, f + ".parts", "[" + found + "]",
                  "two or more layout keys, sorted, each once, \"" + key + "\" among them");
      }
    }
    if (l.dir != key) FailField(path, f + ".dir", "\"" + l.dir + "\"", "\"" + key + "\"");
    const json& ranks = GetArray(Member(jl, "ranks", path, f), path, f + ".ranks");
    for (size_t i = 0; i < ranks.size(); ++i) {
      const std::string rf = f + ".ranks[" + std::to_string(i) + "]";
      ManifestRank r;
      // Checked before narrowing, so that 2^32 + 1 is not taken for rank 1.
      const uint64_t rank = GetU64(Member(ranks[i], "rank", path, rf), path, rf + ".rank");
      r.file = GetString(Member(ranks[i], "file", path, rf), path, rf + ".file");
      r.size = GetU64(Member(ranks[i], "size", path, rf), path, rf + ".size");
      r.header_xxh3 = GetHex16(Member(ranks[i], "header_xxh3", path, rf), path, rf + ".header_xxh3");
      if (rank >= l.world_size ||
          r.file != RankFileName(static_cast<uint32_t>(rank), l.world_size)) {
        FailField(path, rf, "rank " + std::to_string(rank) + " file " + r.file,
                  "a rank below world_size and its canonical file name");
      }
      r.rank = static_cast<uint32_t>(rank);
      if (!l.ranks.empty() && r.rank <= l.ranks.back().rank) {
        FailField(path, rf + ".rank", std::to_string(r.rank),
                  "more than " + std::to_string(l.ranks.back().rank) +
                      " (ranks sorted, each listed once)");
      }
      l.ranks.push_back(r);
    }
    l.complete = GetBool(Member(jl, "complete", path, f), path, f + ".complete");
    if (l.complete != (l.ranks.size() == l.world_size)) {
      FailField(path, f + ".complete", l.complete ? "true" : "false",
                std::string(l.ranks.size() == l.world_size ? "true" : "false") + " (" +
                    std::to_string(l.ranks.size()) + " of " + std::to_string(l.world_size) +
                    " ranks listed)");
    }
    m.layouts[key] = std::move(l);
  }
  // The layouts of one save listed as parts name the same parts (a part not listed yet is
  // allowed: a save of several layouts adds them to its manifest one after the other).
  for (const auto& [key, l] : m.layouts) {
    for (const auto& other : l.parts) {
      const auto it = m.layouts.find(other);
      if (it != m.layouts.end() && it->second.parts != l.parts) {
        FailField(path, "layouts[\"" + other + "\"].parts",
                  it->second.parts.empty() ? "none" : std::to_string(it->second.parts.size()) + " other keys",
                  "the parts of layouts[\"" + key + "\"] (the layouts of one save list the same parts)");
      }
    }
  }
  return m;
}

}  // namespace reshard
