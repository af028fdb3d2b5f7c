// The include-direction check (CTest layer_includes): scans ROOT/include, ROOT/src and
// ROOT/tools and fails, naming file:line, on every #include of a reshard header that runs
// against the direction of the layers:
//
//   base <- format <- io, plan <- ops <- runtime
//
// A layer may include its own headers and those of the layers to its left; io and plan are
// siblings and include neither each other (plan is pure: it plans from structs, and reads
// source bytes through a callback its caller gives). cuda (src/cuda) may include base and the
// copier interface reshard/runtime/device_copier.h only. The Python binding (src/python) and
// the tools (tools/) sit on top and may include any layer, except that the CLI
// (tools/reshard) may not include cuda: it links the core alone.
//
// Public headers are include/reshard/<layer>/*.h, included as "reshard/<layer>/x.h"; internal
// headers are src/<layer>/*.h, included as "<layer>/x.h", and never from include/. A header
// or source outside a layer directory (include/reshard/x.h, src/core/...) is an error too.
// With --installed FILE (one path relative to include/ per line, as cmake --install
// installs them), an installed header may include installed headers only.
//
//   reshard_layer_check ROOT [--installed FILE]    exit 0 when every include is allowed
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// Rank of each layer of the core: a layer may include a layer of lower rank, or itself.
const std::map<std::string, int> kRank = {{"base", 0}, {"format", 1}, {"io", 2},
                                          {"plan", 2}, {"ops", 3},    {"runtime", 4}};
const char* kDirection = "base <- format <- io, plan <- ops <- runtime";

// Where a file sits: a core layer, "cuda", "python" (the binding), "cli" or "tool".
std::optional<std::string> OwnerOf(const std::vector<std::string>& parts, std::string& error) {
  if (parts.size() >= 3 && parts[0] == "include" && parts[1] == "reshard") {
    if (parts.size() >= 4 && (kRank.count(parts[2]) || parts[2] == "cuda")) return parts[2];
    error = "a public header outside the layer directories include/reshard/<layer>/";
    return std::nullopt;
  }
  if (parts.size() >= 2 && parts[0] == "src") {
    if (parts.size() >= 3 && (kRank.count(parts[1]) || parts[1] == "cuda")) return parts[1];
    if (parts.size() >= 3 && parts[1] == "python") return std::string("python");
    error = "a source outside the layer directories src/<layer>/";
    return std::nullopt;
  }
  if (parts.size() >= 3 && parts[0] == "tools") {
    return std::string(parts[1] == "reshard" ? "cli" : "tool");
  }
  return std::nullopt;
}

std::vector<std::string> Parts(const fs::path& p) {
  std::vector<std::string> v;
  for (const auto& e : p) v.push_back(e.string());
  return v;
}

struct Include {
  std::string target;   // as written
  std::string layer;    // the layer it belongs to
  bool internal = false;  // src/<layer>/..., not installed
};

// The reshard header an #include names, if any ("reshard/<layer>/x.h" or "<layer>/x.h" for
// a file of ROOT/src/<layer>/); error set for a reshard header outside every layer.
std::optional<Include> Classify(const fs::path& root, const std::string& target,
                                std::string& error) {
  const std::vector<std::string> parts = Parts(fs::path(target));
  if (!parts.empty() && parts[0] == "reshard") {
    if (parts.size() >= 3 && (kRank.count(parts[1]) || parts[1] == "cuda")) {
      return Include{target, parts[1], false};
    }
    error = "names a reshard header outside the layers (reshard/<layer>/...)";
    return std::nullopt;
  }
  if (parts.size() >= 2 && (kRank.count(parts[0]) || parts[0] == "cuda") &&
      fs::exists(root / "src" / target)) {
    return Include{target, parts[0], true};
  }
  if (target.find("..") != std::string::npos && target.find('/') != std::string::npos) {
    error = "a relative include climbing out of its directory (include \"<layer>/x.h\")";
  }
  return std::nullopt;
}

// Empty when `owner` may include `inc`; otherwise why not.
std::string Refusal(const std::string& owner, const Include& inc, bool from_public) {
  if (from_public && inc.internal) return "a public header includes an internal header";
  if (owner == "python" || owner == "tool") return "";
  if (owner == "cli") {
    return inc.layer == "cuda" ? "the CLI links the core alone (no CUDA)" : "";
  }
  if (owner == "cuda") {
    if (inc.layer == "base" || inc.layer == "cuda" ||
        inc.target == "reshard/runtime/device_copier.h") {
      return "";
    }
    return "cuda may include base and reshard/runtime/device_copier.h only";
  }
  if (inc.layer == owner) return "";
  auto from = kRank.find(owner);
  auto to = kRank.find(inc.layer);
  if (to != kRank.end() && to->second < from->second) return "";
  if (to != kRank.end() && to->second == from->second) {
    return owner + " and " + inc.layer + " are siblings and include neither each other";
  }
  return owner + " may not include " + inc.layer + " (" + kDirection + ")";
}

bool IsSource(const fs::path& p) {
  const std::string e = p.extension().string();
  return e == ".h" || e == ".cc" || e == ".cpp" || e == ".hpp" || e == ".cu" || e == ".in";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: reshard_layer_check ROOT [--installed FILE]\n");
    return 2;
  }
  const fs::path root = argv[1];
  std::optional<std::set<std::string>> installed;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) != "--installed") {
      std::fprintf(stderr, "reshard_layer_check: unknown option %s\n", argv[i]);
      return 2;
    }
    std::ifstream in(argv[i + 1]);
    if (!in) {
      std::fprintf(stderr, "reshard_layer_check: cannot read %s\n", argv[i + 1]);
      return 2;
    }
    installed.emplace();
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) installed->insert(line);
    }
  }

  std::vector<fs::path> files;
  for (const char* dir : {"include", "src", "tools"}) {
    if (!fs::is_directory(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      if (e.is_regular_file() && IsSource(e.path())) files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());

  const std::regex include_re(R"(^\s*#\s*include\s*([<"])([^>"]+)[>"])");
  int problems = 0, includes = 0;
  auto report = [&](const std::string& where, const std::string& what) {
    std::printf("%s: %s\n", where.c_str(), what.c_str());
    ++problems;
  };
  for (const fs::path& file : files) {
    const fs::path rel = fs::relative(file, root);
    const std::vector<std::string> parts = Parts(rel);
    std::string error;
    const std::optional<std::string> owner = OwnerOf(parts, error);
    if (!owner) {
      if (!error.empty()) report(rel.string(), error);
      continue;
    }
    const bool from_public = parts[0] == "include";
    // Relative to include/: how an installed header is named.
    const std::string public_name =
        from_public ? fs::relative(file, root / "include").string() : "";
    const bool is_installed = installed && from_public && installed->count(public_name);
    std::ifstream in(file);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      std::smatch m;
      if (!std::regex_search(line, m, include_re)) continue;
      const std::string where = rel.string() + ":" + std::to_string(n);
      error.clear();
      const std::optional<Include> inc = Classify(root, m[2].str(), error);
      if (!inc) {
        if (!error.empty()) report(where, "#include " + m[1].str() + m[2].str() + ": " + error);
        continue;
      }
      ++includes;
      const std::string why = Refusal(*owner, *inc, from_public);
      if (!why.empty()) {
        report(where, *owner + " includes " + inc->target + ": " + why);
      } else if (is_installed && !inc->internal && !installed->count(inc->target)) {
        report(where, "installed header includes " + inc->target +
                          ", which is not installed (add it to the installed headers, or "
                          "include it from a source file)");
      }
    }
  }
  if (problems) {
    std::printf("%d include(s) against the direction of the layers (%s)\n", problems, kDirection);
    return 1;
  }
  std::printf("layer includes: OK (%zu files, %d reshard includes)\n", files.size(), includes);
  return 0;
}
