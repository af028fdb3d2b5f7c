#include "reshard/ops/inspect.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "reshard/ops/path_hint.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/human.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/format/shape.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json RankFileJson(const RankFileReader& r, bool with_tensors) {
  const RankFileHeader& h = r.header();
  uint64_t nbytes = 0, stored = 0;
  json tensors = json::array();
  for (const auto& t : h.tensors) {
    nbytes += t.nbytes;
    stored += t.stored_size;
    if (!with_tensors) continue;
    json e = {{"name", t.name},         {"dtype", Name(t.dtype)},
              {"global_shape", t.global_shape}, {"local_shape", t.local_shape},
              {"nbytes", t.nbytes},     {"stored_size", t.stored_size},
              {"codec", CodecName(t.codec)}, {"offset", t.offset}, {"xxh3", Hex16(t.xxh3)}};
    e["rows"] = t.sharded && !t.dtensor ? json::array({t.rows.start, t.rows.end}) : json(nullptr);
    if (t.dtensor) {
      json placements = json::array();
      for (const Placement& p : t.dtensor->placements) placements.push_back(p.ToString());
      e["placements"] = std::move(placements);
      e["fsdp_mesh_dim"] = t.dtensor->fsdp_mesh_dim < 0 ? json(nullptr) : json(t.dtensor->fsdp_mesh_dim);
    }
    if (t.flat) {
      json params = json::array();
      for (const auto& p : t.flat->params) {
        params.push_back({{"fqn", p.fqn}, {"key", p.key}, {"shape", p.shape},
                          {"offset", p.offset}, {"numel", p.numel}});
      }
      e["flat"] = {{"unit", t.flat->unit}, {"numel", t.flat->numel},
                   {"aligned_numel", t.flat->aligned_numel}, {"params", params},
                   {"shared", t.flat->shared}};
    }
    tensors.push_back(std::move(e));
  }
  const LayoutSpec spec = h.Layout();
  json j = {{"kind", "rank_file"},
            {"path", r.path()},
            {"layout", h.layout_key},
            {"layout_kind", spec.KindName()},
            {"world_size", h.world_size},
            {"rank", h.rank},
            {"dtype_policy", h.dtype_policy},
            {"source_fingerprint", Hex16(h.source.fingerprint)},
            {"chunk_size", h.chunk_size},
            {"file_size", r.file_size()},
            {"tensor_count", h.tensors.size()},
            {"nbytes", nbytes},
            {"stored_size", stored},
            {"writer", h.writer}};
  if (h.kind == LayoutKind::kDTensor) {
    j["mesh"] = h.mesh.Flag();
    j["coordinate"] = h.mesh.Coordinate(h.rank);
    j["plan"] = {{"name", h.plan_name}, {"xxh3", Hex16(h.plan_xxh3)}};
  }
  if (h.kind == LayoutKind::kFsdp1) {
    j["wrap"] = h.wrap;
    j["use_orig_params"] = h.use_orig_params;
    j["param_dtype"] = h.param_dtype;
  }
  if (with_tensors) j["tensors"] = std::move(tensors);
  return j;
}

json LayoutJson(const fs::path& dir, uint32_t world_size_hint) {
  json ranks = json::array();
  uint32_t ws = world_size_hint;
  std::string key = dir.filename().string();
  std::vector<fs::path> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    Fail(ErrorCode::kNotFound, dir.string() + ": layout directory " + key +
                                   " (listed in the manifest) is missing");
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto n = e.path().filename().string();
    if (n.starts_with("rank-") && n.ends_with(".reshard")) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  uint64_t total = 0, stored = 0;
  json damaged = json::array();  // files that do not open: named, the others still shown
  for (const auto& p : files) {
    std::optional<RankFileReader> opened;
    try {
      opened.emplace(RankFileReader::Open(p));
    } catch (const Error& e) {
      damaged.push_back({{"file", p.filename().string()}, {"error", e.what()}});
      continue;
    }
    const RankFileReader& r = *opened;
    json rj = RankFileJson(r, false);
    ws = r.header().world_size;
    total += rj["nbytes"].get<uint64_t>();
    stored += rj["stored_size"].get<uint64_t>();
    ranks.push_back({{"rank", rj["rank"]},
                     {"file", p.filename().string()},
                     {"file_size", rj["file_size"]},
                     {"nbytes", rj["nbytes"]},
                     {"stored_size", rj["stored_size"]},
                     {"tensor_count", rj["tensor_count"]}});
  }
  json j = {{"kind", "layout"},     {"path", dir.string()},  {"key", key},
            {"world_size", ws},     {"ranks", ranks},        {"nbytes", total},
            {"stored_size", stored}, {"complete", ws > 0 && ranks.size() == ws}};
  if (!damaged.empty()) j["damaged"] = damaged;
  return j;
}

// A layout's optimizer state (KEY/optim, written by reshard.save and relayout): null when there
// is none; else its rank files as LayoutJson lists them and optimizer.json's optimizer class,
// or what is wrong with them (inspect describes, `reshard verify OUT` checks).
json OptimizerJson(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return nullptr;
  json j;
  try {
    j = LayoutJson(dir, 0);
  } catch (const Error& e) {
    return {{"path", dir.string()}, {"error", e.what()}};
  }
  const fs::path meta = dir / "optimizer.json";
  try {
    std::ifstream in(meta, std::ios::binary);
    if (!in) {
      j["error"] = meta.string() + ": missing";
    } else {
      const json m = json::parse(in, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/false);
      if (m.is_object() && m.contains("class") && m["class"].is_string()) j["class"] = m["class"];
      if (m.is_object() && m.contains("param_groups") && m["param_groups"].is_array()) {
        j["param_groups"] = m["param_groups"].size();
      }
    }
  } catch (const std::exception& e) {
    j["error"] = meta.string() + ": not valid JSON (" + e.what() + ")";
  }
  return j;
}

json SourceJson(const fs::path& path) {
  Checkpoint ckpt = OpenCheckpoint(path);
  json files = json::array();
  for (size_t i = 0; i < ckpt.files.size(); ++i) {
    files.push_back({{"name", ckpt.fingerprint.files[i].name},
                     {"size", ckpt.files[i].file_size},
                     {"tensor_count", ckpt.files[i].tensors.size()}});
  }
  json tensors = json::array();
  std::map<std::string, uint64_t> by_dtype;
  uint64_t total = 0;
  for (const auto& t : ckpt.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", Name(t.dtype)},
                       {"shape", t.shape},
                       {"nbytes", t.nbytes},
                       {"file", ckpt.fingerprint.files[t.file_index].name}});
    by_dtype[std::string(Name(t.dtype))] += t.nbytes;
    total += t.nbytes;
  }
  return {{"kind", "source"},
          {"path", path.string()},
          {"format", ckpt.format == WeightFormat::kTorchZip ? "torch-zip" : "safetensors"},
          {"index_file", ckpt.index_file},
          {"fingerprint", Hex16(ckpt.fingerprint.fingerprint)},
          {"files", files},
          {"aux_files", ckpt.aux_files},
          {"tensor_count", ckpt.tensors.size()},
          {"nbytes", total},
          {"nbytes_by_dtype", by_dtype},
          {"tensors", tensors}};
}

std::string Bytes(uint64_t n) { return FormatBytes(static_cast<double>(n)); }

std::string Shape(const json& s) { return ShapeText(s.get<std::vector<uint64_t>>()); }

}  // namespace

json Inspect(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    Fail(ErrorCode::kNotFound, path.string() + ": no such file or directory");
  }
  if (!fs::is_directory(path)) {  // a FIFO or device too: File::OpenRead names it
    const auto ext = path.extension();
    if (ext == ".safetensors" || ext == ".bin" || ext == ".pt" || ext == ".pth") {
      return SourceJson(path);
    }
    return RankFileJson(RankFileReader::Open(path), true);
  }
  if (fs::exists(path / kManifestName)) {
    std::optional<Manifest> m = ReadManifest(path);
    json layouts = json::object();
    for (const auto& [key, l] : m->layouts) {
      std::error_code dec;
      if (!fs::exists(path / l.dir, dec)) {  // deleted by hand: the others are still shown
        layouts[key] = {{"kind", "layout"}, {"path", (path / l.dir).string()}, {"key", key},
                        {"world_size", l.world_size}, {"missing", true}};
        continue;
      }
      json lj = LayoutJson(path / l.dir, l.world_size);
      lj["manifest_complete"] = l.complete;
      lj["layout_kind"] = l.Layout().KindName();
      if (l.kind == LayoutKind::kFsdp1) {
        lj["wrap"] = l.wrap;
        lj["use_orig_params"] = l.use_orig_params;
        lj["param_dtype"] = l.param_dtype;
      }
      if (!l.parts.empty()) lj["parts"] = l.parts;
      if (!l.from.empty()) lj["from"] = l.from;
      lj["optimizer"] = OptimizerJson(path / l.dir / "optim");
      layouts[key] = std::move(lj);
    }
    // Directories of rank files the manifest does not list: an unfinished convert or relayout.
    json unlisted = json::array();
    std::error_code uec;
    for (const auto& e : fs::directory_iterator(path, uec)) {
      const std::string n = e.path().filename().string();
      if (!e.is_directory(uec) || n.starts_with(".") || m->layouts.count(n)) continue;
      size_t files = 0;
      for (const fs::path& in : {e.path(), e.path() / "optim"}) {
        for (const auto& f : fs::directory_iterator(in, uec)) {
          const std::string fn = f.path().filename().string();
          files += (fn.starts_with("rank-") && fn.ends_with(".reshard")) || fn.find(".tmp-") != std::string::npos;
        }
      }
      if (files) unlisted.push_back({{"dir", n}, {"files", files}});
    }
    json out = {{"kind", "output"},
                {"path", path.string()},
                {"source_fingerprint", Hex16(m->source.fingerprint)},
                {"source_files", m->source.files.size()},
                {"aux_files", m->aux_files},
                {"layouts", layouts}};
    if (!unlisted.empty()) out["unlisted"] = unlisted;
    if (m->source.saved) {
      out["saved"] = {{"id", Hex16(m->source.saved->id)}, {"step", nullptr}};
      if (m->source.saved->step) out["saved"]["step"] = *m->source.saved->step;
    }
    return out;
  }
  for (const auto& e : fs::directory_iterator(path)) {
    const auto n = e.path().filename().string();
    if (n.starts_with("rank-") && n.ends_with(".reshard")) return LayoutJson(path, 0);
  }
  try {
    return SourceJson(path);
  } catch (const Error& e) {
    // Not a checkpoint either: an output whose first conversion did not finish (convert takes
    // OUT's lock first, and writes reshard.json last), or near one (step-* checkpoints below).
    std::error_code lec;
    if (e.code() == ErrorCode::kNotFound && fs::exists(path / kLockName, lec)) {
      Fail(ErrorCode::kNotFound, path.string() + ": no reshard.json yet: a reshard convert into it started and did "
                                                 "not finish; run it again (it completes what is there)");
    }
    const std::string hint = e.code() == ErrorCode::kNotFound ? PathHint(path) : std::string();
    if (hint.empty()) throw;
    Fail(ErrorCode::kNotFound, path.string() + ": " + hint);
  }
}

// Names and strings from the files (tensor names, paths, writer) with terminal control
// characters escaped (\x1b ...), so that inspect's text cannot drive the terminal.
static std::string Esc(const json& v) { return Printable(v.get<std::string>(), 4096); }

std::string RenderInspect(const json& d) {
  std::ostringstream o;
  const std::string kind = d["kind"];
  auto ranks_table = [&](const json& l) {
    if (l.value("missing", false)) {
      o << "  layout " << Esc(l["key"]) << ": world size " << l["world_size"] << ", MISSING: " << Esc(l["path"])
        << " is not there (reshard remove " << Esc(d["path"]) << " " << Esc(l["key"]) << " takes it out of reshard.json)\n";
      return;
    }
    o << "  layout " << Esc(l["key"]) << ": world size " << l["world_size"]
      << ", " << l["ranks"].size() << (l["ranks"].size() == 1 ? " rank file" : " rank files")
      << (l["complete"].get<bool>() ? " (complete)" : " (INCOMPLETE)") << ", "
      << Bytes(l["nbytes"]) << " of tensor data";
    if (l["stored_size"] != l["nbytes"]) o << ", " << Bytes(l["stored_size"]) << " stored";
    o << "\n";
    if (l.contains("parts")) {
      o << "    part of the model only (an expert-parallel save): its parts are";
      for (const auto& k : l["parts"]) o << " " << Esc(k);
      o << "\n";
    }
    if (l.contains("wrap")) {
      o << "    FSDP1: wrap";
      for (const auto& w : l["wrap"]) o << " " << Esc(w);
      if (l["wrap"].empty()) o << " (root only)";
      o << ", use_orig_params " << (l["use_orig_params"].get<bool>() ? "True" : "False");
      if (!Esc(l["param_dtype"]).empty()) {
        o << ", param_dtype " << Esc(l["param_dtype"]);
      }
      o << "\n";
    }
    if (l.contains("from")) o << "    made by reshard relayout from layout " << Esc(l["from"]) << "\n";
    for (const auto& r : l["ranks"]) {
      o << "    rank " << r["rank"] << "  " << Esc(r["file"]) << "  "
        << Bytes(r["nbytes"]) << "  (" << r["tensor_count"] << " tensors, file "
        << Bytes(r["file_size"]) << ")\n";
    }
    if (l.contains("damaged")) {
      for (const auto& b : l["damaged"]) o << "    DAMAGED " << Esc(b["file"]) << ": " << Esc(b["error"]) << "\n";
      o << "    (reshard verify " << Esc(d["path"]) << " names what to run)\n";
    }
    if (l.contains("optimizer") && !l["optimizer"].is_null()) {
      const json& op = l["optimizer"];
      o << "    optimizer state (optim/):";
      if (op.contains("class")) o << " " << Esc(op["class"]) << ",";
      if (op.contains("ranks")) {
        o << " " << op["ranks"].size() << (op["ranks"].size() == 1 ? " rank file" : " rank files")
          << (op["complete"].get<bool>() ? " (complete)" : " (INCOMPLETE)") << ", " << Bytes(op["nbytes"])
          << " of tensor data";
      }
      if (op.contains("error")) o << " " << Esc(op["error"]);
      o << "\n";
      if (op.contains("damaged")) {
        for (const auto& b : op["damaged"]) o << "      DAMAGED " << Esc(b["file"]) << ": " << Esc(b["error"]) << "\n";
      }
    } else if (d.contains("saved")) {
      o << "    no optimizer state (saved without optimizer=)\n";
    }
  };
  if (kind == "output" && d.contains("saved")) {
    o << Esc(d["path"]) << ": checkpoint saved from training by reshard.save ("
      << (d["saved"]["step"].is_null() ? std::string("no step given")
                                       : "step " + std::to_string(d["saved"]["step"].get<uint64_t>()))
      << ", save " << Esc(d["saved"]["id"]) << ")\n";
  } else if (kind == "output") {
    o << Esc(d["path"]) << ": reshard output of source "
      << Esc(d["source_fingerprint"]) << " (" << d["source_files"]
      << (d["source_files"].get<uint64_t>() == 1 ? " weight file)\n" : " weight files)\n");
  }
  if (kind == "output") {
    o << "  aux files:";
    for (const auto& a : d["aux_files"]) o << " " << Esc(a);
    o << "\n";
    for (const auto& [key, l] : d["layouts"].items()) ranks_table(l);
    if (d.contains("unlisted")) {
      for (const auto& u : d["unlisted"]) {
        o << "  not listed: " << Esc(u["dir"]) << "/ (" << u["files"]
          << " rank or temporary files: a convert or relayout into it did not finish; reshard verify "
          << Esc(d["path"]) << " says what to do)\n";
      }
    }
  } else if (kind == "layout") {
    o << Esc(d["path"]) << ":\n";
    ranks_table(d);
  } else if (kind == "rank_file") {
    o << Esc(d["path"]) << ": rank " << d["rank"] << " of " << d["world_size"]
      << ", layout " << Esc(d["layout"]) << ", source "
      << Esc(d["source_fingerprint"]) << "\n  " << d["tensor_count"]
      << " tensors, " << Bytes(d["nbytes"]) << " of data, file " << Bytes(d["file_size"])
      << ", chunk size " << Bytes(d["chunk_size"]) << ", written by "
      << Esc(d["writer"]) << "\n";
    if (d.contains("mesh")) {
      o << "  DTensor: mesh " << Esc(d["mesh"]) << ", coordinate (";
      for (size_t i = 0; i < d["coordinate"].size(); ++i) o << (i ? ", " : "") << d["coordinate"][i];
      o << "), plan " << Esc(d["plan"]["name"]) << " (" << Esc(d["plan"]["xxh3"]) << ")\n";
    }
    if (d.contains("wrap")) {
      o << "  FSDP1: wrap";
      for (const auto& w : d["wrap"]) o << " " << Esc(w);
      o << ", use_orig_params " << (d["use_orig_params"].get<bool>() ? "True" : "False") << "\n";
    }
    for (const auto& t : d["tensors"]) {
      o << "  " << Esc(t["name"]) << "  " << Esc(t["dtype"]) << " "
        << Shape(t["global_shape"]);
      if (t.contains("flat")) {
        o << " flat [" << t["rows"][0] << ", " << t["rows"][1] << ") -> " << Shape(t["local_shape"])
          << "  " << Bytes(t["nbytes"]) << ", " << t["flat"]["params"].size() << " params\n";
        for (const auto& p : t["flat"]["params"]) {
          o << "      " << Esc(p["fqn"]) << " " << Shape(p["shape"]) << " at "
            << p["offset"] << "\n";
        }
        continue;
      }
      if (t.contains("placements")) {
        o << " (";
        for (size_t i = 0; i < t["placements"].size(); ++i) o << (i ? ", " : "") << Esc(t["placements"][i]);
        o << (t["fsdp_mesh_dim"].is_null() ? "" : ", fsdp last") << ")";
      } else if (!t["rows"].is_null()) {
        o << " rows [" << t["rows"][0] << ", " << t["rows"][1] << ")";
      } else {
        o << " whole";
      }
      o << " -> " << Shape(t["local_shape"]) << "  " << Bytes(t["nbytes"]);
      if (t["codec"] != "raw") o << " (" << Esc(t["codec"]) << ", " << Bytes(t["stored_size"]) << ")";
      o << "\n";
    }
  } else {
    o << Esc(d["path"]) << ": Hugging Face checkpoint, " << d["tensor_count"]
      << " tensors, " << Bytes(d["nbytes"]) << " in " << d["files"].size()
      << (d.value("format", "safetensors") == "torch-zip" ? " torch zip (pytorch_model.bin) file(s)"
                                                          : " safetensors file(s)")
      << ", fingerprint " << Esc(d["fingerprint"]) << "\n";
    o << "  by dtype:";
    for (const auto& [k, v] : d["nbytes_by_dtype"].items()) o << " " << k << " " << Bytes(v);
    o << "\n";
    for (const auto& t : d["tensors"]) {
      o << "  " << Esc(t["name"]) << "  " << Esc(t["dtype"]) << " "
        << Shape(t["shape"]) << "  " << Bytes(t["nbytes"]) << "\n";
    }
  }
  return o.str();
}

}  // namespace reshard
