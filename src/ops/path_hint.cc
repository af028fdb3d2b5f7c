#include "reshard/ops/path_hint.h"

#include <algorithm>
#include <system_error>
#include <vector>

namespace reshard {

namespace fs = std::filesystem;

namespace {

bool IsRankFileName(const std::string& n) { return n.starts_with("rank-") && n.ends_with(".reshard"); }

}  // namespace

std::string PathHint(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return "no such file or directory";
  const fs::path norm = out.lexically_normal();
  const fs::path p = norm.has_filename() ? norm : norm.parent_path();  // "dir/" names dir
  const fs::path parent = p.parent_path();
  const std::string name = p.filename().string();
  auto top_of = [&](const fs::path& layout_dir) {
    fs::path top = layout_dir.filename() == "optim" ? layout_dir.parent_path().parent_path() : layout_dir.parent_path();
    return top.empty() ? fs::path(".") : top;
  };
  if (fs::is_regular_file(p, ec) && IsRankFileName(name)) {
    return "a rank file, not an output directory: pass the directory that holds reshard.json (" +
           top_of(parent).string() + "), and each rank finds its own file";
  }
  if (!fs::is_directory(p, ec)) return "";
  bool rank_files = false, hf = false;
  std::vector<std::string> steps;
  for (const auto& e : fs::directory_iterator(p, ec)) {
    const std::string n = e.path().filename().string();
    rank_files |= IsRankFileName(n);
    hf |= n.ends_with(".safetensors") || n == "model.safetensors.index.json" || n.starts_with("pytorch_model.bin");
    std::error_code sec;
    if (e.is_directory(sec) && fs::exists(e.path() / "reshard.json", sec)) steps.push_back(n);
  }
  if (rank_files && fs::exists(top_of(p) / "reshard.json", ec)) {
    return "a layout directory of " + top_of(p).string() +
           ": pass that directory (the one with reshard.json), in which each command finds the layout it needs";
  }
  if (!steps.empty()) {
    std::sort(steps.begin(), steps.end());
    return "no reshard.json here, but " + std::to_string(steps.size()) + " checkpoint(s) below it: pass one, e.g. " +
           (p / steps.back()).string();
  }
  if (hf) {
    return "a Hugging Face checkpoint, not a reshard output directory: convert it first (reshard convert " +
           p.string() + " -o OUT --world-size N), or load it as it is (reshard.load(model, " + p.string() + "))";
  }
  return "";
}

}  // namespace reshard
