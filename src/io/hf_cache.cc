#include "reshard/io/hf_cache.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "reshard/base/error.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool IsWordChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// os.path.expanduser: a leading "~" or "~/" becomes $HOME (other users' ~name are left).
std::string ExpandUser(const std::string& p) {
  if (p.empty() || p[0] != '~' || (p.size() > 1 && p[1] != '/')) return p;
  return Env("HOME") + p.substr(1);
}

// os.path.expandvars (POSIX): $NAME and ${NAME} of set variables are replaced; anything else,
// unset variables included, is left as it is.
std::string ExpandVars(const std::string& p) {
  std::string out;
  for (size_t i = 0; i < p.size();) {
    if (p[i] != '$') {
      out += p[i++];
      continue;
    }
    size_t start = i + 1, end = start;
    const bool braced = start < p.size() && p[start] == '{';
    if (braced) {
      end = p.find('}', start + 1);
      if (end == std::string::npos) {
        out += p.substr(i);
        break;
      }
      const std::string name = p.substr(start + 1, end - start - 1);
      const char* v = name.empty() ? nullptr : std::getenv(name.c_str());
      out += v ? std::string(v) : p.substr(i, end + 1 - i);
      i = end + 1;
      continue;
    }
    while (end < p.size() && IsWordChar(p[end])) ++end;
    const std::string name = p.substr(start, end - start);
    const char* v = name.empty() ? nullptr : std::getenv(name.c_str());
    out += v ? std::string(v) : p.substr(i, end - i);  // a lone '$' stays
    i = end;
  }
  return out;
}

fs::path Expand(const std::string& p) { return fs::path(ExpandVars(ExpandUser(p))); }

bool IsCommitHash(std::string_view s) {
  if (s.size() != 40) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string Trim(std::string s) {
  const auto ws = " \t\r\n";
  s.erase(0, s.find_first_not_of(ws));
  const auto e = s.find_last_not_of(ws);
  s.erase(e == std::string::npos ? 0 : e + 1);
  return s;
}

// The refs/ and snapshots/ entries of a repository's cache folder, for the error messages.
std::string ListCached(const fs::path& repo) {
  std::vector<std::string> refs, snaps;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(repo / "refs", ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) refs.push_back(fs::relative(it->path(), repo / "refs", ec).string());
  }
  for (auto it = fs::directory_iterator(repo / "snapshots", ec);
       !ec && it != fs::directory_iterator(); it.increment(ec)) {
    snaps.push_back(it->path().filename().string());
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 8) s += ", ...";
    return v.empty() ? std::string("none") : s;
  };
  return "cached refs: " + join(refs) + "; snapshots: " + join(snaps);
}

std::string DownloadHint(const std::string& id, const std::string& revision) {
  return "download it first with: hf download " + id +
         (revision.empty() || revision == "main" ? std::string() : " --revision " + revision) +
         " (or give a local checkpoint directory)";
}

}  // namespace

fs::path HfHubCacheDir() {
  if (const std::string v = Env("HF_HUB_CACHE"); !v.empty()) return Expand(v);
  if (const std::string v = Env("HUGGINGFACE_HUB_CACHE"); !v.empty()) return Expand(v);
  fs::path home;
  if (const std::string v = Env("HF_HOME"); !v.empty()) {
    home = Expand(v);
  } else {
    const std::string xdg = Env("XDG_CACHE_HOME");
    home = Expand((xdg.empty() ? ExpandUser("~/.cache") : xdg)) / "huggingface";
  }
  return home / "hub";
}

bool IsHfModelId(std::string_view text) {
  if (text.empty() || text.size() > 96) return false;
  if (text.find("--") != std::string_view::npos || text.find("..") != std::string_view::npos) {
    return false;
  }
  if (text.ends_with(".git")) return false;
  const size_t slash = text.find('/');
  auto part_ok = [](std::string_view p) {
    if (p.empty() || !IsWordChar(p.front()) || !IsWordChar(p.back())) return false;
    for (char c : p) {
      if (!IsWordChar(c) && c != '-' && c != '.') return false;
    }
    return true;
  };
  if (slash == std::string_view::npos) return part_ok(text);
  return part_ok(text.substr(0, slash)) && part_ok(text.substr(slash + 1));
}

fs::path HfRepoCacheDir(const fs::path& cache, std::string_view model_id) {
  std::string name = "models";
  size_t start = 0;
  while (true) {
    const size_t slash = model_id.find('/', start);
    name += "--";
    name += model_id.substr(start, slash == std::string_view::npos ? slash : slash - start);
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return cache / name;
}

ResolvedSource ResolveSource(const std::string& source, const std::string& revision,
                             const std::optional<fs::path>& cache_dir) {
  ResolvedSource r;
  std::error_code ec;
  if (source.empty()) Fail(ErrorCode::kInvalidArgument, "no checkpoint given (an empty path)");
  if (fs::exists(source, ec)) {  // a local path wins over a model id of the same spelling
    if (!revision.empty()) {
      Fail(ErrorCode::kInvalidArgument,
           "--revision " + revision + " applies to a Hugging Face model id, but " + source +
               " is a local path (a local path is used as it is)");
    }
    r.path = source;
    return r;
  }
  if (!IsHfModelId(source)) {
    Fail(ErrorCode::kNotFound, source + ": no such file or directory");
  }
  const fs::path cache = cache_dir ? *cache_dir : HfHubCacheDir();
  const fs::path repo = HfRepoCacheDir(cache, source);
  const std::string rev = revision.empty() ? "main" : revision;
  const std::string what = source + ": no such file or directory, and model " + source;
  if (!fs::is_directory(repo, ec)) {
    Fail(ErrorCode::kNotFound, what + " is not in the Hugging Face cache (" + repo.string() +
                                   " does not exist; the cache is $HF_HUB_CACHE, else " +
                                   "$HF_HOME/hub, else ~/.cache/huggingface/hub); " +
                                   DownloadHint(source, revision));
  }
  // A revision names a file under refs/ (refs/main, refs/pr/1) or is a commit hash; nothing
  // that could step outside the repository's folder.
  const fs::path rel(rev);
  bool bad = rel.is_absolute() || rev.find('\0') != std::string::npos;
  for (const auto& part : rel) bad |= part == ".." || part == ".";
  if (bad) Fail(ErrorCode::kInvalidArgument, "--revision " + rev + ": not a revision name");
  std::string commit;
  const fs::path ref = repo / "refs" / rel;
  if (fs::is_regular_file(ref, ec)) {
    std::ifstream f(ref);
    std::stringstream ss;
    ss << f.rdbuf();
    commit = Trim(ss.str());
    if (!IsCommitHash(commit)) {
      Fail(ErrorCode::kDataLoss, ref.string() + ": expected a 40-digit commit hash, found \"" +
                                     Printable(commit, 80) + "\"");
    }
  } else if (IsCommitHash(rev)) {
    commit = rev;
  } else {
    Fail(ErrorCode::kNotFound, what + ": revision " + rev + " is not in the Hugging Face cache (" +
                                   repo.string() + ": no refs/" + rev + "; " + ListCached(repo) +
                                   "); " + DownloadHint(source, rev));
  }
  const fs::path snap = repo / "snapshots" / commit;
  if (!fs::is_directory(snap, ec)) {
    Fail(ErrorCode::kNotFound, what + ": revision " + rev + " (commit " + commit +
                                   ") has no snapshot in the Hugging Face cache (" + snap.string() +
                                   " does not exist; " + ListCached(repo) + "); " +
                                   DownloadHint(source, rev));
  }
  r.path = snap;
  r.from_cache = true;
  r.model_id = source;
  r.revision = rev;
  r.commit = commit;
  return r;
}

}  // namespace reshard
