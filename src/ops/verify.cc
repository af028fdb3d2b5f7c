#include "reshard/ops/verify.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "format/json_util.h"
#include "reshard/ops/path_hint.h"
#include "reshard/base/checksum.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"
#include "reshard/base/human.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/io/checkpoint.h"
#include "reshard/format/zip_reader.h"
#include "reshard/io/file_byte_source.h"
#include "reshard/io/file_io.h"
#include "reshard/io/parallel_for.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/relayout.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/conversion.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

struct LayoutFiles {
  std::string key;
  std::filesystem::path dir;  // where the layout's rank files live
  uint32_t world_size = 0;  // 0: unknown (no manifest, no readable file)
  std::vector<fs::path> files;
  std::optional<LayoutSpec> spec;  // from the manifest
  std::set<uint32_t> reported;     // ranks the manifest check already reported (missing, size)
};

struct ChunkItem {
  size_t reader;
  size_t tensor;
  uint64_t chunk;
};

class Verifier {
 public:
  explicit Verifier(const VerifyOptions& o) : o_(o) {
    threads_ = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  }

  VerifyReport Run() {
    const auto t0 = std::chrono::steady_clock::now();
    std::error_code ec;
    if (!fs::exists(o_.path, ec)) {
      Fail(ErrorCode::kNotFound, o_.path.string() + ": no such file or directory");
    }
    if (o_.source) {
      try {
        ckpt_ = OpenCheckpoint(*o_.source);
      } catch (const Error& e) {
        Problem(o_.source->string(), "", std::string("cannot read the source: ") + e.what());
      }
      if (ckpt_) CheckZipCrcs();
    }
    std::vector<LayoutFiles> layouts;
    if (!fs::is_directory(o_.path)) {  // special files: refused when opened
      layouts.push_back({"", o_.path.parent_path(), 0, {o_.path}, std::nullopt, {}});
    } else if (fs::exists(o_.path / kManifestName)) {
      CollectFromManifest(layouts);
    } else {
      ReadRankState(o_.path);
      LayoutFiles l;
      l.key = o_.path.filename().string();
      l.dir = o_.path;
      for (const auto& e : fs::directory_iterator(o_.path)) {
        const auto name = e.path().filename().string();
        if (name.starts_with("rank-") && name.ends_with(".reshard")) l.files.push_back(e.path());
      }
      std::sort(l.files.begin(), l.files.end());
      if (l.files.empty()) {
        const std::string hint = PathHint(o_.path);
        const std::string unfinished = UnfinishedWrite(o_.path);
        if (!unfinished.empty()) {  // a convert or save into it that did not finish: a problem of OUT
          Problem(o_.path.string(), "",
                  "no reshard.json (the manifest that lists and commits the layouts), but " + unfinished +
                      ": a reshard convert or save into it that did not finish, or a manifest deleted since; "
                      "without it this is no checkpoint. Run that convert again (it keeps the rank files that "
                      "are right and writes the manifest), or resume from an earlier save and delete this "
                      "directory; reshard verify " + o_.path.string() +
                      "/LAYOUT checks one layout directory's rank files alone");
        } else {  // not a reshard output at all: nothing to verify (exit 3, as a missing path)
          Fail(ErrorCode::kMismatch,
               o_.path.string() + ": " +
                   (!hint.empty() ? hint : "no reshard.json and no rank-*.reshard files: not a reshard output directory"));
        }
      }
      // A layout directory's optimizer state is checked with the output (or as OUT/KEY/optim).
      std::error_code oec;
      fs::path self = o_.path.lexically_normal();  // "OUT/KEY/" -> "OUT/KEY"
      if (!self.has_filename() && self.has_parent_path()) self = self.parent_path();
      if (fs::is_directory(self / "optim", oec) && fs::exists(self.parent_path() / kManifestName, oec)) {
        report_.notes.push_back((self / "optim").string() + ": the optimizer state was not checked: reshard verify " +
                                self.parent_path().string() + " checks it with everything else (or verify " +
                                (self / "optim").string() + " alone)");
      }
      layouts.push_back(std::move(l));
    }
    for (auto& l : layouts) VerifyLayout(l, /*whole_layout=*/fs::is_directory(o_.path));
    // Each listed layout's optimizer state (KEY/optim, written by reshard.save and relayout):
    // its rank files are not in the manifest, so they are found here and checked as
    // `reshard verify OUT/KEY/optim` checks them.
    if (manifest_) {
      for (const auto& [key, ml] : manifest_->layouts) {
        if (!missing_dirs_.count(key)) VerifyOptimizerDir(key, ml);
      }
    }
    // A layout `reshard relayout` made from another layout of OUT: compared with that layout
    // element for element (its optimizer state too), as --source compares a conversion.
    if (manifest_) {
      for (const auto& [key, ml] : manifest_->layouts) {
        if (ml.from.empty() || missing_dirs_.count(key) || missing_dirs_.count(ml.from)) continue;
        uint64_t compared = 0;
        for (RelayoutProblem& p : CheckRelayout(o_.path, key, threads_, compared)) {
          Problem(std::move(p.file), std::move(p.tensor), std::move(p.message));
        }
        report_.source_bytes_compared += compared;
      }
    }
    if (manifest_) NoteLeftovers();
    // A file both checks open (a layout and the relayout comparison) is reported once.
    // The same finding with what to run appended ("...; run: ...") counts once, as that one.
    std::set<std::tuple<std::string, std::string, std::string>> said;
    std::erase_if(report_.problems, [&](const VerifyProblem& p) {
      return !said.insert({p.file, p.tensor, p.message}).second;
    });
    std::map<std::pair<std::string, std::string>, std::vector<const VerifyProblem*>> by_place;
    for (const VerifyProblem& p : report_.problems) by_place[{p.file, p.tensor}].push_back(&p);
    std::vector<VerifyProblem> kept;
    for (const VerifyProblem& p : report_.problems) {
      bool covered = false;
      for (const VerifyProblem* q : by_place[{p.file, p.tensor}]) {
        covered |= q != &p && q->message.size() > p.message.size() && q->message.starts_with(p.message + "; ");
      }
      if (!covered) kept.push_back(p);
    }
    report_.problems.swap(kept);
    report_.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return std::move(report_);
  }

 private:
  // A torch.save (zip) source: every record's CRC-32 against its central directory entry,
  // records spread over the threads, each read once in 1 MiB pieces. (data.pkl's is checked
  // whenever the archive is opened; convert checks no storage's, RELIABILITY.md says why.)
  void CheckZipCrcs() {
    struct Record {
      size_t file;
      std::string name;
      uint64_t at, size;
      uint32_t crc;
    };
    std::vector<File> files;
    std::vector<Record> records;
    for (const WeightFile& w : ckpt_->files) {
      if (w.format != WeightFormat::kTorchZip) continue;
      try {
        File f = File::OpenRead(w.path);
        const FileByteSource src(f);
        const ZipDirectory dir = ReadZipDirectory(src);
        for (const ZipEntry& e : dir.entries) {
          records.push_back({files.size(), e.name, ZipEntryDataOffset(src, dir, e), e.size, e.crc32});
        }
        files.push_back(std::move(f));
      } catch (const Error& e) {
        Problem(w.path, "", e.what());
      }
    }
    ParallelForOptions po;
    po.threads = threads_;
    ParallelFor(records.size(), po, [&] {
      return [&, buf = std::unique_ptr<char[]>(new char[1 << 20])](size_t i) -> uint64_t {
        const Record& r = records[i];
        try {
          uint32_t crc = 0;
          for (uint64_t done = 0; done < r.size;) {
            const size_t n = static_cast<size_t>(std::min<uint64_t>(r.size - done, 1 << 20));
            files[r.file].PReadExact(buf.get(), n, r.at + done);
            crc = Crc32(buf.get(), n, crc);
            done += n;
          }
          if (crc != r.crc) {
            char text[96];
            std::snprintf(text, sizeof text, "CRC-32 %08x, the central directory says %08x",
                          crc, r.crc);
            Problem(files[r.file].path(), "",
                    "record \"" + Printable(r.name) + "\": " + text +
                        " (the source changed after torch.save wrote it: its tensors may hold "
                        "other bytes than when they were saved)");
          }
        } catch (const Error& e) {
          Problem(files[r.file].path(), "", e.what());
        }
        return r.size;
      };
    });
  }

  void Problem(std::string file, std::string tensor, std::string message) {
    // Library errors already begin with "<file>: " (and "tensor \"<name>\" "); say each once.
    if (message.starts_with(file + ": ")) message.erase(0, file.size() + 2);
    const std::string t = "tensor \"" + tensor + "\" ";
    if (!tensor.empty() && message.starts_with(t)) message.erase(0, t.size());
    std::lock_guard<std::mutex> g(mu_);
    report_.problems.push_back({std::move(file), std::move(tensor), std::move(message)});
  }

  // An optimizer directory of a saved FSDP1 checkpoint (OUT/KEY/optim) holds per-rank
  // ("local") state: its optimizer.json lists, per shard coordinate, the parameters with state
  // and their state tensors ("rank_state", formats/manifest.md). Under use_orig_params the
  // ranks hold state for different parameters, so each rank file is checked against its own
  // list rather than against rank 0's file.
  void ReadRankState(const fs::path& dir) {
    const fs::path meta = dir / "optimizer.json";
    std::error_code ec;
    if (!fs::is_regular_file(meta, ec)) return;
    const std::string mpath = meta.string();
    try {
      const nlohmann::json j =
          internal::ParseStrictJson(ReadWholeFile(meta, 256ull << 20), mpath, "optimizer.json");
      if (!j.is_object() || !j.contains("rank_state")) return;  // FSDP2: one state layout
      const nlohmann::json& ranks = internal::GetArray(j["rank_state"], mpath, "rank_state");
      std::vector<std::set<std::string>> names;
      for (size_t r = 0; r < ranks.size(); ++r) {
        const std::string field = "rank_state[" + std::to_string(r) + "]";
        std::set<std::string> n;
        for (const auto& [param, desc] : internal::GetObject(ranks[r], mpath, field).items()) {
          const std::string pf = field + "[\"" + param + "\"]";
          const nlohmann::json& tensors =
              internal::GetObject(internal::Member(internal::GetObject(desc, mpath, pf), "tensors", mpath, pf + ".tensors"),
                                  mpath, pf + ".tensors");
          for (const auto& [k, kind] : tensors.items()) {
            internal::GetString(kind, mpath, pf + ".tensors[\"" + k + "\"]");
            n.insert(param + "#" + k);
          }
        }
        names.push_back(std::move(n));
      }
      rank_state_ = std::move(names);
      rank_state_path_ = mpath;
    } catch (const Error& e) {
      Problem(mpath, "", e.what());
    }
  }

  // OUT/KEY/optim of a layout the manifest lists, when there is one: every rank file there
  // (header, checksums, the same tensors on every rank, or each rank's own list in
  // optimizer.json), none missing, optimizer.json present. Never compared with --source (the
  // source holds no optimizer state).
  void VerifyOptimizerDir(const std::string& key, const ManifestLayout& ml) {
    const fs::path dir = o_.path / ml.dir / "optim";
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return;
    LayoutFiles l{key + "/optim", dir, ml.world_size, {}, ml.Layout(), {}};
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const auto name = e.path().filename().string();
      if (name.starts_with("rank-") && name.ends_with(".reshard")) l.files.push_back(e.path());
    }
    std::sort(l.files.begin(), l.files.end());
    const bool has_meta = fs::is_regular_file(dir / "optimizer.json", ec);
    if (l.files.empty() && !has_meta) return;  // an empty directory: no optimizer state kept
    const std::string remedy =
        !ml.from.empty()
            ? "remove the optim directory and run: reshard relayout " + o_.path.string() + " " +
                  ml.Layout().ConvertFlags() + " --from " + ml.from
            : "this checkpoint's optimizer state is incomplete: save it again (reshard.save into a new "
              "directory) or resume from an older one";
    if (!has_meta) {
      Problem((dir / "optimizer.json").string(), "",
              "missing (reshard.load_optimizer reads the param groups from it); " + remedy);
    }
    if (l.files.empty()) {
      Problem(dir.string(), "", "optimizer.json but no rank-*.reshard files; " + remedy);
      return;
    }
    rank_state_.reset();
    ReadRankState(dir);
    VerifyLayout(l, /*whole_layout=*/true, /*compare_source=*/false);
    rank_state_.reset();
  }

  void CollectFromManifest(std::vector<LayoutFiles>& layouts) {
    const std::string mpath = (o_.path / kManifestName).string();
    std::optional<Manifest> m;
    try {
      m = ReadManifest(o_.path);
    } catch (const Error& e) {
      Problem(mpath, "", e.what());
      return;
    }
    manifest_source_ = m->source;
    manifest_ = *m;
    manifest_path_ = mpath;
    if (m->layouts.empty()) Problem(mpath, "", "the manifest lists no layout");
    for (const auto& [key, ml] : m->layouts) {
      LayoutFiles l{key, o_.path / ml.dir, ml.world_size, {}, ml.Layout(), {}};
      std::error_code dec;
      if (!fs::exists(l.dir, dec)) {  // deleted by hand: said once, not once per file
        // What to run: remove it (when another layout remains), or write it again as it was made.
        bool others = false;
        for (const auto& [k2, ml2] : m->layouts) others |= k2 != key && fs::exists(o_.path / ml2.dir, dec);
        const std::string remove = "reshard remove " + o_.path.string() + " " + key;
        std::string again;
        if (!ml.from.empty()) {
          again = "reshard relayout " + o_.path.string() + " " + ml.Layout().ConvertFlags() + " --from " + ml.from;
        } else if (!m->source.saved) {
          again = "reshard convert " + (o_.source ? o_.source->string() : std::string("SRC")) + " -o " +
                  o_.path.string() + " " + ml.Layout().ConvertFlags() +
                  (o_.source ? "" : " (SRC: the checkpoint it was converted from)");
        }
        // A save's own layout: a copy relayout made from it holds the same state (relayout
        // never rewrites a listed original: taken out first).
        std::string copy;
        for (const auto& [k2, ml2] : m->layouts) {
          if (copy.empty() && again.empty() && ml2.from == key && ml2.complete && fs::exists(o_.path / ml2.dir, dec)) {
            copy = k2;
          }
        }
        std::string what;
        if (!copy.empty()) {
          what = "take it out and make it from " + copy + " (made from it, the same state): " + remove +
                 ", then reshard relayout " + o_.path.string() + " " + ml.Layout().ConvertFlags() + " --from " + copy;
        } else if (others && !again.empty()) {
          what = "take it out of the manifest with: " + remove + ", or write it again: " + again;
        } else if (others) {
          what = "a layout of a save cannot be written again: take it out of the manifest with: " + remove;
        } else if (!again.empty()) {
          what = "write it again: " + again;
        } else {
          what = "it was the save's only layout: the checkpoint is gone; resume from an older one";
        }
        Problem(l.dir.string(), "", "the directory of layout " + key + " (listed in the manifest) is missing; " + what);
        missing_dirs_.insert(key);
        continue;
      }
      if (!ml.complete || ml.ranks.size() != ml.world_size) {
        Problem(mpath, "", "layout " + key + " is incomplete: " + std::to_string(ml.ranks.size()) +
                               " of " + std::to_string(ml.world_size) +
                               " rank files; run reshard convert for the missing ranks");
      }
      for (const auto& r : ml.ranks) {
        const fs::path p = o_.path / ml.dir / r.file;
        std::error_code ec;
        if (!fs::exists(p, ec)) {
          Problem(p.string(), "", "listed in the manifest but missing; " + Remedy(l, r.rank));
          l.reported.insert(r.rank);
          continue;
        }
        // Not a regular file (a FIFO, a device): opening it refuses it by kind, below.
        const bool regular = fs::is_regular_file(p, ec);
        const uint64_t size = regular ? fs::file_size(p, ec) : r.size;
        if (regular && size != r.size) {  // opened all the same: what it holds says more
          Problem(p.string(), "", "size " + std::to_string(size) + " bytes, the manifest says " +
                                      std::to_string(r.size) +
                                      (size < r.size ? " (truncated)" : "") + "; " + Remedy(l, r.rank));
          l.reported.insert(r.rank);
        }
        l.files.push_back(p);
      }
      layouts.push_back(std::move(l));
    }
    for (const auto& a : m->aux_files) {
      if (!fs::exists(o_.path / a)) Problem((o_.path / a).string(), "", "listed in the manifest but missing");
    }
  }

  // What a write that started into `dir` and never committed leaves (convert takes the lock
  // first; every rank file, manifest and JSON file is a ".NAME.tmp-<host>-<pid>" temporary
  // until renamed): "" when there is none of it, in `dir` or in its directories one level down.
  // ".NAME.tmp-<host>-<pid>" (older: ".NAME.tmp-<pid>"): a writer's file before its rename.
  static bool IsTemporary(const std::string& name) {
    return name.starts_with(".") && name.find(".tmp-") != std::string::npos;
  }
  static std::string UnfinishedWrite(const fs::path& dir) {
    std::error_code ec;
    size_t temps = 0, rank_files = 0;
    auto count = [&](const fs::path& d) {
      std::error_code dec;
      for (const auto& e : fs::directory_iterator(d, dec)) {
        const std::string name = e.path().filename().string();
        if (IsTemporary(name)) ++temps;
      }
    };
    count(dir);
    std::vector<std::string> layout_dirs;  // as convert, relayout and reshard.save name them
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (!e.is_directory(ec)) continue;
      count(e.path());
      const std::string name = e.path().filename().string();
      if (name.starts_with("fsdp2-ws") || name.starts_with("fsdp1-ws") || name.starts_with("dtensor-")) {
        layout_dirs.push_back(Printable(name, 64));
        std::error_code rec;
        for (const auto& f : fs::directory_iterator(e.path(), rec)) {
          const std::string fname = f.path().filename().string();
          if (fname.starts_with("rank-") && fname.ends_with(".reshard")) ++rank_files;
        }
      }
    }
    std::sort(layout_dirs.begin(), layout_dirs.end());
    std::string found;
    if (!layout_dirs.empty()) {
      found = "layout director" + std::string(layout_dirs.size() == 1 ? "y " : "ies ") + layout_dirs[0] +
              (layout_dirs.size() > 1 ? ", ..." : "");
      if (rank_files) found += " holding " + std::to_string(rank_files) + " rank file(s)";
    }
    if (temps) found += (found.empty() ? "" : " and ") + std::to_string(temps) + " temporary file(s) (.*.tmp-*)";
    if (found.empty() && fs::exists(dir / kLockName, ec)) found = "its lock file " + std::string(kLockName);
    return found;
  }

  // OUT's leftovers (VerifyReport::notes): rank-file temporaries in a listed layout's
  // directory or its optim/, and directories of rank files the manifest does not list.
  void NoteLeftovers() {
    try {
      NoteLeftoversOrThrow();
    } catch (const fs::filesystem_error&) {  // a directory changing under a writer: say nothing
    }
  }
  void NoteLeftoversOrThrow() {
    std::map<std::string, std::string> listed;  // directory name -> layout key
    for (const auto& [key, ml] : manifest_->layouts) listed[ml.dir] = key;
    const std::string here = SafeHostName();
    std::set<std::string> elsewhere;  // hosts other than this one that temporaries name
    auto temporaries = [&](const fs::path& dir, uint64_t& bytes) {
      size_t n = 0;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        const size_t at = name.find(".tmp-");
        if (IsTemporary(name) && e.is_regular_file(ec)) {
          ++n;
          const uintmax_t size = e.file_size(ec);  // a writer may remove it meanwhile
          if (!ec && size != static_cast<uintmax_t>(-1)) bytes += size;
          const std::string owner = name.substr(at + 5);  // <host>-<pid> (older files: <pid>)
          const size_t dash = owner.rfind('-');
          if (dash != std::string::npos && owner.substr(0, dash) != here) elsewhere.insert(owner.substr(0, dash));
        }
      }
      return n;
    };
    std::error_code ec;
    std::vector<fs::path> dirs;
    for (const auto& e : fs::directory_iterator(o_.path, ec)) {
      if (e.is_directory(ec) && !e.path().filename().string().starts_with(".")) dirs.push_back(e.path());
    }
    std::sort(dirs.begin(), dirs.end());
    for (const fs::path& d : dirs) {
      const std::string name = d.filename().string();
      uint64_t bytes = 0;
      elsewhere.clear();
      size_t temps = temporaries(d, bytes) + temporaries(d / "optim", bytes);
      std::string hosts;
      for (const std::string& h : elsewhere) hosts += (hosts.empty() ? "" : ", ") + Printable(h, 64);
      const std::string rerun =
          "if no convert, relayout or save is writing into " + o_.path.string() +
          " now, run the command that was writing it again (it removes this host's and finishes), or delete them" +
          (hosts.empty() ? std::string()
                         : "; some were written on another host (" + hosts +
                               "): a re-run here leaves those, delete them once nothing writes there");
      if (listed.count(name)) {
        if (temps) {
          report_.notes.push_back(d.string() + ": " + std::to_string(temps) + " temporary file(s) (" +
                                  FormatBytes(static_cast<double>(bytes)) + ") of an unfinished write; " + rerun);
        }
        continue;
      }
      size_t ranks = 0;  // its own and its optim/'s
      for (const fs::path& in : {d, d / "optim"}) {
        for (const auto& e : fs::directory_iterator(in, ec)) {
          const std::string n = e.path().filename().string();
          ranks += n.starts_with("rank-") && n.ends_with(".reshard");
        }
      }
      if (ranks || temps) {
        report_.notes.push_back(
            d.string() + ": " + std::to_string(ranks) + " rank file(s)" +
            (temps ? " and " + std::to_string(temps) + " temporary file(s) (" +
                         FormatBytes(static_cast<double>(bytes)) + ")"
                   : std::string()) +
            ", not a layout reshard.json lists (a convert or relayout into it did not finish; not checked, "
            "and reshard.load does not read it): run that command again to finish it, or delete the directory");
      }
    }
  }

  // What to run for a missing or damaged rank file: the convert command that writes it
  // (the source named when --source gave it), or, for a checkpoint saved from training, a new
  // save (a save cannot be completed from elsewhere).
  std::string Remedy(const LayoutFiles& l, uint32_t rank, bool saved = false) const {
    // A layout `reshard relayout` made (the manifest names the layout it came from): that
    // command writes the rank again, model and optimizer files alike (it rewrites a file that
    // is missing, does not open, or holds a chunk that does not match its checksum).
    const std::string key = l.key.ends_with("/optim") ? l.key.substr(0, l.key.size() - 6) : l.key;
    if (manifest_) {
      auto it = manifest_->layouts.find(key);
      if (it != manifest_->layouts.end() && !it->second.from.empty()) {
        const std::string r = std::to_string(rank);
        return "run: reshard relayout " + o_.path.string() + " " +
               it->second.Layout().ConvertFlags() + " --from " + it->second.from + " --ranks " + r + "-" + r;
      }
    }
    if (saved || (manifest_source_ && manifest_source_->saved)) {
      // The save's own layout: a copy relayout made from it holds the same state.
      if (manifest_) {
        for (const auto& [k, ml] : manifest_->layouts) {
          if (k != key && ml.from == key && ml.complete) {
            return "the save's own layout cannot be written again, but " + k +
                   " (made from it) holds the same state: take it out and make it from there: reshard remove " +
                   o_.path.string() + " " + key + ", then reshard relayout " + o_.path.string() + " " +
                   manifest_->layouts.at(key).Layout().ConvertFlags() + " --from " + k;
          }
        }
      }
      return "this checkpoint, saved from training, is damaged or incomplete: save it again (reshard.save "
             "into a new directory) or resume from an older one";
    }
    const std::string src = o_.source ? o_.source->string() : "SRC";
    const fs::path out = l.dir.parent_path();
    std::string cmd = "run reshard convert " + src + " -o " + out.string();
    if (l.spec) cmd += " " + l.spec->ConvertFlags();
    return cmd + " --ranks " + std::to_string(rank) + "-" + std::to_string(rank) +
           (o_.source ? "" : " (SRC: the checkpoint it was converted from)");
  }

  // "; " and what to run, for the first damaged byte found in a rank's file (a chunk that
  // does not match its checksum, nonzero padding); empty for the rank's later ones, and when
  // only part of a layout is checked. Thread-safe (chunks are checked in parallel).
  std::string RemedyOnce(const LayoutFiles& l, const RankFileHeader& h, bool whole_layout) {
    if (!whole_layout) return "";
    {
      const std::lock_guard<std::mutex> g(mu_);
      if (!remedied_.insert({l.dir.string(), h.rank}).second) return "";
    }
    return "; " + Remedy(l, h.rank, h.source.saved.has_value());
  }

  void VerifyLayout(LayoutFiles& l, bool whole_layout, bool compare_source = true) {
    std::vector<RankFileReader> readers;
    std::set<uint32_t> unreadable;  // present but broken: reported, not "missing"
    for (const auto& p : l.files) {
      try {
        readers.push_back(RankFileReader::Open(p));
        ++report_.files;
      } catch (const Error& e) {
        const std::string name = p.filename().string();
        uint32_t r = 0;
        const bool numbered =
            name.size() > 10 && std::from_chars(name.data() + 5, name.data() + 10, r).ec == std::errc();
        // A file whose size the manifest check already reported is not a second problem.
        // What to run is said where the layout's directory is known (OUT, a layout, optim/).
        if (!(numbered && l.reported.count(r))) {
          Problem(p.string(), "", std::string(e.what()) + (numbered && whole_layout ? "; " + Remedy(l, r) : ""));
        }
        if (numbered) unreadable.insert(r);
      }
    }
    if (readers.empty()) return;
    const RankFileHeader& h0 = readers.front().header();
    if (l.key.empty()) l.key = h0.layout_key;
    report_.layouts.push_back(l.key);
    const uint32_t ws = l.world_size ? l.world_size : h0.world_size;
    std::set<uint32_t> seen;
    std::map<std::string, const TensorEntry*> names0;
    for (const auto& t : h0.tensors) names0[t.name] = &t;
    // Per-rank state: each state tensor's first appearance (entry, file), to compare the
    // other ranks' with.
    std::map<std::string, std::pair<const TensorEntry*, std::string>> state_first;
    for (const auto& r : readers) {
      const RankFileHeader& h = r.header();
      if (h.layout_key != h0.layout_key || h.world_size != ws || h.kind != h0.kind) {
        Problem(r.path(), "", "layout " + h.layout_key + " (world size " +
                                  std::to_string(h.world_size) + "), expected " + h0.layout_key +
                                  " (world size " + std::to_string(ws) + ")");
      }
      if (!seen.insert(h.rank).second) Problem(r.path(), "", "rank " + std::to_string(h.rank) + " appears twice");
      // The file the manifest lists (its size and header hash, layout, dtype policy, source):
      // a rank file of another conversion into the same OUT is not this layout's.
      if (manifest_ && manifest_->layouts.count(l.key) && h.layout_key == h0.layout_key) {
        try {
          CheckListed(r, *manifest_, l.key, h.rank, manifest_path_);
        } catch (const Error& e) {
          Problem(r.path(), "", e.what());
        }
      }
      try {
        r.CheckPadding();
      } catch (const Error& e) {
        Problem(r.path(), "", e.what() + RemedyOnce(l, h, whole_layout));
      }
      const fs::path expected_name = RankFileName(h.rank, h.world_size);
      if (fs::path(r.path()).filename() != expected_name) {
        Problem(r.path(), "", "holds rank " + std::to_string(h.rank) + ", expected file name " +
                                  expected_name.string());
      }
      if (!(h.source == h0.source)) {
        Problem(r.path(), "", "converted from source " + Hex16(h.source.fingerprint) + ", but " +
                                  readers.front().path() + " from " + Hex16(h0.source.fingerprint));
      }
      if (manifest_source_ && !(h.source == *manifest_source_)) {
        Problem(r.path(), "", "converted from source " + Hex16(h.source.fingerprint) +
                                  ", the manifest names " + Hex16(manifest_source_->fingerprint));
      }
      if (rank_state_) {
        // Per-rank state (see ReadRankState): this file's tensors are exactly its list.
        if (h.rank >= rank_state_->size()) {
          Problem(r.path(), "", "rank " + std::to_string(h.rank) + ": " + rank_state_path_ +
                                    " lists state for " + std::to_string(rank_state_->size()) +
                                    " shard coordinates");
          continue;
        }
        const std::set<std::string>& want = (*rank_state_)[h.rank];
        std::set<std::string> have;
        for (const auto& t : h.tensors) {
          have.insert(t.name);
          if (!want.count(t.name)) {
            Problem(r.path(), t.name, "not listed for rank " + std::to_string(h.rank) + " in " + rank_state_path_);
          }
          // A state tensor present on several ranks has one dtype; without use_orig_params
          // (each rank's state is its flat shard's) one shape too.
          auto [first, fresh] = state_first.emplace(t.name, std::make_pair(&t, r.path()));
          if (fresh) continue;
          const TensorEntry& u = *first->second.first;
          if (u.dtype != t.dtype || (!h.use_orig_params && u.global_shape != t.global_shape)) {
            Problem(r.path(), t.name,
                    std::string(u.dtype != t.dtype ? "dtype" : "shape") + " differs from " + first->second.second);
          }
        }
        for (const auto& n : want) {
          if (!have.count(n)) {
            Problem(r.path(), n, "missing (" + rank_state_path_ + " lists it for rank " + std::to_string(h.rank) + ")");
          }
        }
        continue;
      }
      std::set<std::string> names;
      for (const auto& t : h.tensors) {
        names.insert(t.name);
        auto it = names0.find(t.name);
        if (it == names0.end()) {
          Problem(r.path(), t.name, "not present in " + readers.front().path());
        } else if (it->second->global_shape != t.global_shape || it->second->dtype != t.dtype) {
          Problem(r.path(), t.name, "global shape or dtype differs from " + readers.front().path());
        } else if ((it->second->flat == nullptr) != (t.flat == nullptr) ||
                   (t.flat && !(*t.flat == *it->second->flat))) {
          Problem(r.path(), t.name,
                  "the flat parameter's layout (parameters, offsets, padding) differs from " +
                      readers.front().path());
        }
      }
      for (const auto& [n, _] : names0) {
        if (!names.count(n)) Problem(r.path(), n, "missing (present in " + readers.front().path() + ")");
      }
    }
    if (rank_state_ && rank_state_->size() != ws) {
      Problem(rank_state_path_, "", "rank_state lists " + std::to_string(rank_state_->size()) +
                                        " shard coordinates, the layout has " + std::to_string(ws));
    }
    if (whole_layout) {
      for (uint32_t rank = 0; rank < ws; ++rank) {
        if (!seen.count(rank) && !unreadable.count(rank) && !l.reported.count(rank)) {
          if (!l.spec) {
            l.spec = h0.Layout();
            l.spec->world_size = ws;
          }
          Problem((l.dir / RankFileName(rank, ws)).string(), "",
                  "rank " + std::to_string(rank) + " of " + std::to_string(ws) + " is missing; " +
                      Remedy(l, rank, h0.source.saved.has_value()));
        }
      }
    }
    const bool compare = compare_source && ckpt_.has_value();
    // A conversion recorded beside the layouts (OUT/reshard-model.json): the rank files hold
    // the model's names and shapes, each made of source tensors by it.
    std::optional<ModelManifest> model;
    std::optional<Checkpoint> view;
    const Conversion* conversion = nullptr;
    if (compare) {
      const fs::path mm = l.dir.parent_path() / kModelManifestName;
      std::error_code mec;
      if (fs::exists(mm, mec)) {
        try {
          model = ReadModelManifest(mm);
          if (model->conversion && !model->conversion->targets.empty()) {
            conversion = &*model->conversion;
            view = ModelView(*ckpt_, *conversion, mm.string());
          }
        } catch (const Error& e) {
          Problem(mm.string(), "", e.what());
        }
      }
    }
    const Checkpoint* names = view ? &*view : ckpt_ ? &*ckpt_ : nullptr;
    if (compare) {
      if (!(h0.source == ckpt_->fingerprint)) {
        Problem(readers.front().path(), "",
                "converted from source " + Hex16(h0.source.fingerprint) + ", but " +
                    o_.source->string() + " is " + Hex16(ckpt_->fingerprint.fingerprint) +
                    " (another checkpoint, or it changed)");
      }
      if (h0.kind != LayoutKind::kFsdp1) {  // FSDP2 and DTensor layouts hold every tensor
        for (const auto& t : names->tensors) {
          if (!names0.count(t.name)) {
            Problem(readers.front().path(), t.name, "source tensor missing from the layout");
          }
        }
      }
      // FSDP1 files hold the model's parameters and persistent buffers; the source's other
      // tensors (if any) are not part of the layout.
      for (const auto& [n, t] : names0) {
        if (t->flat) continue;
        if (!names->Find(n)) {
          Problem(readers.front().path(), n,
                  view ? "not a tensor of the source, nor made of its tensors by the conversion"
                       : "not a tensor of the source");
        }
      }
      for (const auto& f : ckpt_->files) sources_.push_back(File::OpenRead(f.path));
    }
    // Each entry's byte map (reshard/plan/byte_map.h), and whether its sources fit: only then
    // are its bytes compared with what the map says they hold.
    const SourceLookup lookup = [this](std::string_view name) { return ckpt_->Find(name); };
    std::vector<std::vector<std::optional<EntryMap>>> maps(readers.size());
    for (size_t ri = 0; compare && ri < readers.size(); ++ri) {
      const RankFileHeader& h = readers[ri].header();
      const auto policy = ParseDTypePolicy(h.dtype_policy);
      maps[ri].resize(h.tensors.size());
      for (size_t ti = 0; ti < h.tensors.size(); ++ti) {
        const TensorEntry& t = h.tensors[ti];
        if (!policy) break;  // reported below
        if (!t.flat && !names->Find(t.name)) continue;  // reported above
        try {
          EntryMap map = MapEntry(t, h.kind, h.world_size, h.rank, readers[ri].path());
          if (conversion) ExpandConversion(map, *conversion);
          std::string why = CheckSources(map, lookup);
          for (const EntrySegment& seg : map.segments) {
            if (!why.empty()) break;
            if (seg.kind != EntrySegment::Kind::kSource) continue;
            const SourceTensor* src = ckpt_->Find(seg.source);
            if (StoredDType(src->dtype, *policy) != t.dtype) {
              why = "dtype or shape differs from the source (the file holds " +
                    std::string(Name(t.dtype)) + ", dtype policy " + h.dtype_policy +
                    " stores the source's " + std::string(Name(src->dtype)) + " as " +
                    std::string(Name(StoredDType(src->dtype, *policy))) + ")" +
                    (seg.source != t.name ? ": source tensor " + seg.source : std::string());
            }
          }
          if (why.empty()) {
            maps[ri][ti] = std::move(map);
          } else {
            Problem(readers[ri].path(), t.name, why);
          }
        } catch (const Error& e) {
          Problem(readers[ri].path(), t.name, e.what());
        }
      }
    }
    std::vector<ChunkItem> items;
    std::vector<uint64_t> lengths;  // each item's decoded bytes, for the progress report
    uint64_t total = 0;
    for (size_t ri = 0; ri < readers.size(); ++ri) {
      const auto& h = readers[ri].header();
      for (size_t ti = 0; ti < h.tensors.size(); ++ti) {
        report_.tensors++;
        for (uint64_t c = 0; c < h.tensors[ti].ChunkCount(h.chunk_size); ++c) {
          items.push_back({ri, ti, c});
          lengths.push_back(ChunkLength(h.tensors[ti], h.chunk_size, c));
          total += lengths.back();
        }
      }
    }
    for (const auto& r : readers) {
      if (compare && !ParseDTypePolicy(r.header().dtype_policy)) {
        Problem(r.path(), "", "unknown dtype policy \"" + r.header().dtype_policy +
                                  "\": cannot compare with the source");
      }
    }
    std::vector<uint64_t> bytes(items.size(), 0), compared(items.size(), 0);
    const SourceRead read_source = [this](size_t file, uint64_t at, size_t n, void* dst) {
      sources_[file].PReadExact(dst, n, at);
    };
    // Each chunk's problem is recorded as it is found (an item never throws): every chunk
    // is checked, whatever the others hold.
    ParallelForOptions po;
    po.threads = threads_;
    if (o_.progress) {
      po.progress = [&](uint64_t units) { o_.progress(l.key, units, total); };
    }
    ParallelFor(items.size(), po, [&] {
      return [&, scratch = std::string(), fill_scratch = std::vector<char>(),
              buf = std::unique_ptr<char[]>(), conv = std::unique_ptr<char[]>(),
              cap = uint64_t{0}](size_t i) mutable -> uint64_t {
        const auto& it = items[i];
        const RankFileReader& r = readers[it.reader];
        const TensorEntry& t = r.header().tensors[it.tensor];
        try {
          const uint64_t cs = r.header().chunk_size;
          // Sized by this chunk's length, not chunk_size: a header may say 16 GiB chunks.
          const uint64_t need = ChunkLength(t, cs, it.chunk);
          if (cap < need) {
            buf.reset(new char[need]);
            conv.reset(new char[need]);
            cap = need;
          }
          const uint64_t len = r.ReadChunk(t, it.chunk, buf.get(), scratch);
          bytes[i] = len;
          const EntryMap* map =
              compare && maps[it.reader][it.tensor] ? &*maps[it.reader][it.tensor] : nullptr;
          if (map) {
            FillEntry(*map, lookup, read_source, it.chunk * cs, len, conv.get(), fill_scratch);
            if (std::memcmp(conv.get(), buf.get(), len) != 0) {
              uint64_t k = 0;
              while (k < len && conv[k] == buf[k]) ++k;
              const uint64_t at = it.chunk * cs + k;
              bool converted = false;
              for (const EntrySegment& seg : map->segments) {
                if (seg.kind == EntrySegment::Kind::kSource) {
                  converted |= ckpt_->Find(seg.source)->dtype != t.dtype;
                }
              }
              Problem(r.path(), t.name,
                      "differs from the source" +
                          (converted ? " converted to " + std::string(Name(t.dtype)) : std::string()) +
                          " at byte " + std::to_string(at) + " of this rank's part (" +
                          DescribeEntryByte(*map, at) + ")");
            }
            compared[i] = len;
          }
        } catch (const std::exception& e) {
          Problem(r.path(), t.name, e.what() + RemedyOnce(l, r.header(), whole_layout));
        }
        return lengths[i];
      };
    });
    if (o_.progress) o_.progress(l.key, total, total);
    for (size_t i = 0; i < items.size(); ++i) {
      report_.bytes += bytes[i];
      report_.source_bytes_compared += compared[i];
    }
    sources_.clear();
  }

  const VerifyOptions& o_;
  unsigned threads_;
  std::optional<Checkpoint> ckpt_;
  std::optional<SourceFingerprint> manifest_source_;
  std::optional<Manifest> manifest_;  // OUT/reshard.json, when verifying OUT
  std::string manifest_path_;
  std::optional<std::vector<std::set<std::string>>> rank_state_;  // ReadRankState
  std::string rank_state_path_;
  std::vector<File> sources_;
  std::mutex mu_;
  std::set<std::pair<std::string, uint32_t>> remedied_;
  std::set<std::string> missing_dirs_;  // listed layouts whose directory is not there  // (layout dir, rank): RemedyOnce said it
  VerifyReport report_;
};

}  // namespace

VerifyReport Verify(const VerifyOptions& options) { return Verifier(options).Run(); }

}  // namespace reshard
