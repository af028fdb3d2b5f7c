#include "reshard/format/model_manifest.h"

#include <set>

#include "format/json_util.h"
#include "reshard/base/error.h"

namespace reshard {

namespace {

using internal::GetArray;
using internal::GetBool;
using internal::GetString;
using internal::GetU64;
using internal::Member;
using nlohmann::json;

std::vector<uint64_t> ShapeOf(const json& v, const std::string& path, const std::string& field) {
  const json& a = GetArray(v, path, field);
  std::vector<uint64_t> shape;
  for (size_t i = 0; i < a.size(); ++i) {
    shape.push_back(GetU64(a[i], path, field + "[" + std::to_string(i) + "]"));
  }
  return shape;
}

uint64_t NumelOf(const std::vector<uint64_t>& shape, const std::string& what) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

std::string ParentName(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

ModelManifest ParseModelManifest(std::string_view text, const std::string& path) {
  json j = internal::ParseStrictJson(text, path, "model manifest");
  if (!j.is_object()) FailField(path, "model manifest", internal::Describe(j), "a JSON object");
  const std::string format = GetString(Member(j, "format", path, "model manifest"), path, "format");
  if (format != kModelManifestFormatName) {
    FailField(path, "format", "\"" + format + "\"", "\"reshard.model\"");
  }
  const uint64_t version =
      GetU64(Member(j, "format_version", path, "model manifest"), path, "format_version");
  if (version != kModelManifestVersion) {
    FailField(path, "format_version", std::to_string(version),
              std::to_string(kModelManifestVersion));
  }
  ModelManifest m;
  m.model_class = GetString(Member(j, "model_class", path, "model manifest"), path, "model_class");
  m.base_model_prefix =
      GetString(Member(j, "base_model_prefix", path, "model manifest"), path, "base_model_prefix");
  const json& nsm =
      GetArray(Member(j, "no_split_modules", path, "model manifest"), path, "no_split_modules");
  for (size_t i = 0; i < nsm.size(); ++i) {
    m.no_split_modules.push_back(
        GetString(nsm[i], path, "no_split_modules[" + std::to_string(i) + "]"));
  }
  const json& params = GetArray(Member(j, "params", path, "model manifest"), path, "params");
  std::set<std::string> param_names;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string f = "params[" + std::to_string(i) + "]";
    ModelParam p;
    const json& names = GetArray(Member(params[i], "names", path, f), path, f + ".names");
    if (names.empty()) FailField(path, f + ".names", "an empty list", "at least one name");
    for (size_t k = 0; k < names.size(); ++k) {
      p.names.push_back(GetString(names[k], path, f + ".names[" + std::to_string(k) + "]"));
      if (!param_names.insert(p.names.back()).second) {
        FailField(path, f + ".names", "\"" + p.names.back() + "\" a second time",
                  "each parameter name once");
      }
    }
    p.shape = ShapeOf(Member(params[i], "shape", path, f), path, f + ".shape");
    NumelOf(p.shape, path + ": " + f + ".shape");
    m.params.push_back(std::move(p));
  }
  const json& modules = GetArray(Member(j, "modules", path, "model manifest"), path, "modules");
  if (modules.empty()) FailField(path, "modules", "an empty list", "the root module first");
  std::set<std::string> module_names;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string f = "modules[" + std::to_string(i) + "]";
    ModelModule mod;
    mod.name = GetString(Member(modules[i], "name", path, f), path, f + ".name");
    mod.cls = GetString(Member(modules[i], "class", path, f), path, f + ".class");
    if ((i == 0) != mod.name.empty()) {
      FailField(path, f + ".name", "\"" + mod.name + "\"",
                i == 0 ? "\"\" (the root first)" : "a non-empty module path");
    }
    if (!module_names.insert(mod.name).second) {
      FailField(path, f + ".name", "\"" + mod.name + "\" a second time", "unique module paths");
    }
    if (i > 0 && !module_names.count(ParentName(mod.name))) {
      FailField(path, f + ".name", "\"" + mod.name + "\" before its parent",
                "modules in named_modules() pre-order");
    }
    const json& ps = GetArray(Member(modules[i], "params", path, f), path, f + ".params");
    for (size_t k = 0; k < ps.size(); ++k) {
      const std::string pf = f + ".params[" + std::to_string(k) + "]";
      const json& pair = GetArray(ps[k], path, pf);
      if (pair.size() != 2) FailField(path, pf, internal::Describe(pair), "[local name, index]");
      const std::string local = GetString(pair[0], path, pf + "[0]");
      const uint64_t index = GetU64(pair[1], path, pf + "[1]");
      if (index >= m.params.size()) {
        FailField(path, pf + "[1]", std::to_string(index),
                  "an index below " + std::to_string(m.params.size()));
      }
      if (local.empty() || local.find('.') != std::string::npos) {
        FailField(path, pf + "[0]", "\"" + local + "\"", "a parameter name without '.'");
      }
      mod.params.emplace_back(local, static_cast<uint32_t>(index));
    }
    m.modules.push_back(std::move(mod));
  }
  const json& buffers = GetArray(Member(j, "buffers", path, "model manifest"), path, "buffers");
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string f = "buffers[" + std::to_string(i) + "]";
    ModelBuffer b;
    b.name = GetString(Member(buffers[i], "name", path, f), path, f + ".name");
    b.shape = ShapeOf(Member(buffers[i], "shape", path, f), path, f + ".shape");
    b.persistent = GetBool(Member(buffers[i], "persistent", path, f), path, f + ".persistent");
    m.buffers.push_back(std::move(b));
  }
  return m;
}

}  // namespace reshard
