#include "reshard/ops/remove.h"

#include <set>
#include <system_error>

#include "reshard/base/error.h"
#include "reshard/format/manifest.h"
#include "reshard/io/file_io.h"
#include "reshard/io/manifest.h"
#include "reshard/ops/path_hint.h"

namespace reshard {

namespace fs = std::filesystem;

RemoveResult RemoveLayouts(const fs::path& out, const std::vector<std::string>& keys, double lock_wait_seconds) {
  const std::string mpath = (out / kManifestName).string();
  if (keys.empty()) Fail(ErrorCode::kInvalidArgument, "reshard remove: name the layouts to remove (KEY ...)");
  std::error_code ec;
  if (!fs::exists(out / kManifestName, ec)) {
    const std::string hint = PathHint(out);
    Fail(ErrorCode::kNotFound, out.string() + ": " + (hint.empty() ? "no reshard.json: not a reshard output directory" : hint));
  }
  const DirectoryLock lock(out / kLockName, lock_wait_seconds);
  std::optional<Manifest> m = ReadManifest(out);
  if (!m) Fail(ErrorCode::kNotFound, mpath + ": missing");
  auto listed = [&] {
    std::string s;
    for (const auto& [k, _] : m->layouts) s += (s.empty() ? "" : ", ") + k;
    return s.empty() ? std::string("none") : s;
  };
  const std::set<std::string> drop(keys.begin(), keys.end());
  for (const std::string& k : drop) {
    if (!m->layouts.count(k)) {
      Fail(ErrorCode::kNotFound, mpath + ": lists no layout " + Printable(k) + "; its layouts: " + listed());
    }
  }
  if (drop.size() == m->layouts.size()) {
    Fail(ErrorCode::kMismatch, mpath + ": removing every layout (" + listed() + ") leaves nothing to load; "
                                      "delete " + out.string() + " instead");
  }
  for (const std::string& k : drop) {
    for (const std::string& part : m->layouts.at(k).parts) {
      if (!drop.count(part)) {
        std::string all;
        for (const std::string& p : m->layouts.at(k).parts) all += " " + p;
        Fail(ErrorCode::kMismatch,
             mpath + ": layout " + k + " is one part of an expert-parallel save, whose parts are loaded together; "
                     "remove them all: reshard remove " + out.string() + all);
      }
    }
  }
  RemoveResult r;
  for (auto it = m->layouts.begin(); it != m->layouts.end();) {
    if (drop.count(it->first)) {
      r.removed.push_back(it->first);
      it = m->layouts.erase(it);
      continue;
    }
    if (!it->second.from.empty() && drop.count(it->second.from)) {
      r.unlinked.push_back(it->first);
      it->second.from.clear();
    }
    r.remaining.push_back(it->first);
    ++it;
  }
  WriteManifest(out, *m);  // first: killed after it, the directories are unlisted leftovers (verify says so)
  for (const std::string& k : r.removed) {
    const fs::path dir = out / k;  // the manifest's dir is the key itself (formats/manifest.md)
    fs::remove_all(dir, ec);
    if (ec) {
      Fail(ErrorCode::kIo, dir.string() + ": cannot delete (" + ec.message() + "); layout " + k +
                               " is no longer listed in " + mpath + ": delete the directory by hand");
    }
  }
  return r;
}

}  // namespace reshard
