#include "reshard/ops/export.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"
#include "reshard/format/manifest.h"
#include "reshard/format/safetensors.h"
#include "reshard/io/file_io.h"
#include "reshard/io/parallel_for.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/format/model_manifest.h"
#include "reshard/plan/conversion.h"
#include "reshard/plan/layout_tensors.h"
#include "reshard/ops/path_hint.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// ---- the Hugging Face side -----------------------------------------------------------------

int SafetensorsRank(DType d) {
  switch (d) {
    case DType::kBool: return 0;
    case DType::kF4: return 1;
    case DType::kF6_E2M3: return 2;
    case DType::kF6_E3M2: return 3;
    case DType::kU8: return 4;
    case DType::kI8: return 5;
    case DType::kF8_E5M2: return 6;
    case DType::kF8_E4M3: return 7;
    case DType::kF8_E8M0: return 8;
    case DType::kI16: return 9;
    case DType::kU16: return 10;
    case DType::kF16: return 11;
    case DType::kBF16: return 12;
    case DType::kI32: return 13;
    case DType::kU32: return 14;
    case DType::kF32: return 15;
    case DType::kC64: return 16;
    case DType::kF64: return 17;
    case DType::kI64: return 18;
    case DType::kU64: return 19;
  }
  return 0;
}

// A JSON string as serde_json writes it: UTF-8 kept, ", \ and control characters escaped
// (\b \f \n \r \t, else \u00xx in lower case).
void AppendJsonString(std::string& out, std::string_view s) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

struct OutTensor {
  const TensorLocation* loc = nullptr;
  DType dtype;               // as written
  uint64_t nbytes = 0;       // as written
  uint64_t file_offset = 0;  // absolute offset of its data in the output file
};

struct OutFile {
  std::string name;
  std::vector<OutTensor> tensors;  // safetensors write order
  std::string header;              // 8-byte length + JSON + padding
  uint64_t size = 0;
  File file;
};

// Lays out one safetensors file as save_file(tensors, metadata={"format": "pt"}) does.
void LayOutFile(OutFile& f) {
  std::sort(f.tensors.begin(), f.tensors.end(), [](const OutTensor& a, const OutTensor& b) {
    return SafetensorsWriteOrder(a.dtype, a.loc->name, b.dtype, b.loc->name);
  });
  std::string json = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t offset = 0;
  for (const OutTensor& t : f.tensors) {
    json += ',';
    AppendJsonString(json, t.loc->name);
    json += ":{\"dtype\":\"";
    json += Name(t.dtype);
    json += "\",\"shape\":[";
    for (size_t d = 0; d < t.loc->shape.size(); ++d) {
      if (d) json += ',';
      json += std::to_string(t.loc->shape[d]);
    }
    json += "],\"data_offsets\":[" + std::to_string(offset) + ",";
    offset += t.nbytes;
    json += std::to_string(offset) + "]}";
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kSafetensorsMaxHeaderSize) {
    Fail(ErrorCode::kUnsupported,
         f.name + ": the safetensors header would take " + std::to_string(json.size()) +
             " bytes, more than the " + std::to_string(kSafetensorsMaxHeaderSize) +
             " safetensors reads; use a smaller --max-shard-size");
  }
  f.header.assign(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) f.header[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  f.header += json;
  uint64_t at = f.header.size();
  for (OutTensor& t : f.tensors) {
    t.file_offset = at;
    at += t.nbytes;
  }
  f.size = at;
}

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// ---- the staging directory -------------------------------------------------------------------

std::string StagingPrefix(const fs::path& hf_dir) {
  return "." + hf_dir.filename().string() + ".export-tmp-";
}

// Removes staging directories of exports to `hf_dir` whose process (on this host) is gone.
void RemoveStaleStaging(const fs::path& hf_dir) {
  const std::string prefix = StagingPrefix(hf_dir);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(hf_dir.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    if (!OwnerIsDeadLocalProcess(std::string_view(name).substr(prefix.size()), false)) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

// Removes the staging directory on scope exit unless released.
class StagingGuard {
 public:
  explicit StagingGuard(fs::path p) : path_(std::move(p)) {}
  ~StagingGuard() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  void Release() { path_.clear(); }

 private:
  fs::path path_;
};

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

void CopyFile(const fs::path& from, const fs::path& to) {
  File in = File::OpenRead(from);
  File out = File::Create(to, CopyMode(from));  // never more permissive than the source
  std::unique_ptr<char[]> buf(new char[1 << 20]);
  uint64_t at = 0;
  for (;;) {
    const size_t n = in.PReadUpTo(buf.get(), 1 << 20, at);
    if (n == 0) break;
    out.PWriteExact(buf.get(), n, at);
    at += n;
  }
  out.Sync();
}

// torch's name for a floating dtype, as transformers writes it in config.json ("dtype", or
// "torch_dtype" before v5); empty for dtypes a config does not name.
std::string_view TorchFloatName(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF64: return "float64";
    default: return {};
  }
}

// config.json as the exported weights need it, or nullopt when nothing needs to change (the
// file is then copied as it is):
// * its top-level "dtype" / "torch_dtype" set to `dtype_name` (when not empty) where it says
//   another floating dtype: transformers loads a checkpoint in the dtype its config names
//   (dtype="auto"), so a config left at bfloat16 beside float32 weights would silently load
//   them rounded to bfloat16;
// * its "quantization_config" removed when that names a method in `dequantized` (the exported
//   weights hold none of that method's tensors: a layout dequantized at convert): "fp8"
//   (no FP8 tensor) or "mxfp4" (no `_blocks` tensor); transformers would otherwise build FP8Linear
//   / MXFP4 experts on a GPU and quantize the plain weights again.
// Says in *edits what it changed.
struct ConfigEdits {
  bool dtype = false, quantization = false;
};
std::optional<std::string> ExportedConfig(const fs::path& config, std::string_view dtype_name,
                                          const std::set<std::string>& dequantized, ConfigEdits* edits) {
  const std::string text = ReadWholeFile(config, 64ull << 20);
  internal::CheckJsonDepth(text, config.string(), "config.json");  // before any recursion
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr,
                                                          /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;  // not ours to judge: copied as is
  bool changed = false;
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (dtype_name.empty()) break;
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) continue;
    const std::string was = it->get<std::string>();
    const bool float_name = was == "float32" || was == "bfloat16" || was == "float16" ||
                            was == "float64" || was == "float" || was == "half";
    if (float_name && was != dtype_name) {
      *it = std::string(dtype_name);
      changed = edits->dtype = true;
    }
  }
  {
    auto q = j.find("quantization_config");
    if (q != j.end() && q->is_object()) {
      auto m = q->find("quant_method");
      if (m != q->end() && m->is_string() && dequantized.count(m->get<std::string>())) {
        j.erase(q);
        changed = edits->quantization = true;
      }
    }
  }
  if (!changed) return std::nullopt;
  return j.dump(2, ' ', /*ensure_ascii=*/false) + "\n";  // as transformers: indent 2, newline
}

bool IsWithin(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

fs::path NormalDir(const fs::path& p) {
  fs::path n = fs::weakly_canonical(fs::absolute(p));
  if (n.filename().empty()) n = n.parent_path();
  return n;
}

// Moves the finished staging directory to hf_dir (exchanging it with an existing hf_dir
// under force; the old contents are then removed).
void Publish(const fs::path& staging, const fs::path& hf_dir, bool force) {
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(hf_dir, ec));
  if (exists && !fs::is_empty(hf_dir, ec)) {
    if (!force) {
      Fail(ErrorCode::kMismatch,
           hf_dir.string() + ": appeared and is not empty; pass --force to replace it");
    }
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, hf_dir.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS) {
        Fail(ErrorCode::kIo, hf_dir.string() + ": cannot exchange with " + staging.string() +
                                 ": " + std::strerror(err));
      }
      // No atomic exchange on this file system: move the old directory aside first.
      const fs::path aside = staging.string() + ".old";
      if (::rename(hf_dir.c_str(), aside.c_str()) != 0 ||
          ::rename(staging.c_str(), hf_dir.c_str()) != 0) {
        Fail(ErrorCode::kIo, hf_dir.string() + ": cannot move into place: " +
                                 std::strerror(errno));
      }
      fs::remove_all(aside, ec);
    } else {
      fs::remove_all(staging, ec);  // now the old contents
    }
  } else {
    if (exists) fs::remove(hf_dir, ec);  // an empty directory
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, hf_dir.c_str(), RENAME_NOREPLACE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS) {
        Fail(ErrorCode::kIo, hf_dir.string() + ": cannot move " + staging.string() +
                                 " into place: " + std::strerror(err));
      }
      if (::rename(staging.c_str(), hf_dir.c_str()) != 0) {
        Fail(ErrorCode::kIo, hf_dir.string() + ": cannot move into place: " +
                                 std::strerror(errno));
      }
    }
  }
  SyncDirectory(hf_dir.parent_path());
}

struct WorkItem {
  uint32_t file = 0;
  uint32_t tensor = 0;  // in the file's write order
  uint32_t piece = 0;
  uint64_t chunk = 0;   // of the piece's rank-file entry
};

}  // namespace

std::optional<uint64_t> ParseMaxShardSize(std::string_view text) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t b = 0;
  while (b < s.size() && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  s = s.substr(b);
  if (s.empty()) return std::nullopt;
  if (std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    errno = 0;
    const unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
    if (errno == ERANGE || v == 0) return std::nullopt;
    return v;
  }
  if (s.size() < 3) return std::nullopt;
  std::string unit = s.substr(s.size() - 2);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 0;
  if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else return std::nullopt;
  std::string num = s.substr(0, s.size() - 2);
  while (!num.empty() && std::isspace(static_cast<unsigned char>(num.back()))) num.pop_back();
  if (num.empty() || !std::all_of(num.begin(), num.end(), [](char c) {
        return (c >= '0' && c <= '9') || c == '.';
      }) || std::count(num.begin(), num.end(), '.') > 1 || num == ".") {
    return std::nullopt;
  }
  const double v = std::strtod(num.c_str(), nullptr) * mult;
  if (!(v >= 1) || v >= 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(v);
}

std::vector<std::vector<size_t>> SplitIntoShards(const std::vector<uint64_t>& sizes,
                                                 uint64_t max_shard_size) {
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_size = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_shard_size) {
      shards.push_back({i});
      continue;
    }
    if (current_size + sizes[i] > max_shard_size) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += sizes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

bool SafetensorsWriteOrder(DType a_dtype, std::string_view a_name, DType b_dtype,
                           std::string_view b_name) {
  const int ra = SafetensorsRank(a_dtype), rb = SafetensorsRank(b_dtype);
  if (ra != rb) return ra > rb;
  return a_name < b_name;
}

ExportResult Export(const ExportOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto policy = ParseDTypePolicy(o.dtype);
  if (!policy) {
    Fail(ErrorCode::kInvalidArgument, "--dtype " + o.dtype + " is not one of keep, bf16, fp16, fp32");
  }
  if (o.max_shard_size == 0) Fail(ErrorCode::kInvalidArgument, "--max-shard-size must be positive");
  if (o.hf_dir.empty()) Fail(ErrorCode::kInvalidArgument, "no output directory (-o HF_DIR)");
  std::error_code ec;
  // A rank file, a layout directory, a Hugging Face checkpoint, a missing path: what it is
  // and what to pass instead (the rule relayout, verify and inspect use).
  std::string hint = fs::exists(o.out / kManifestName, ec) ? std::string() : PathHint(o.out);
  if (hint.starts_with("a Hugging Face checkpoint")) {  // what export makes, not what it reads
    hint = "a Hugging Face checkpoint already, not a reshard output directory (no reshard.json): export "
           "writes one from the output of reshard convert or reshard.save";
  }
  if (!fs::is_directory(o.out, ec)) {
    Fail(ErrorCode::kNotFound, o.out.string() + ": " + (hint.empty() ? "not a directory" : hint));
  }
  std::optional<Manifest> manifest = ReadManifest(o.out);
  if (!manifest) {
    Fail(ErrorCode::kNotFound, o.out.string() + ": " +
                                   (hint.empty() ? "no " + std::string(kManifestName) +
                                                       ": not a reshard output directory (reshard convert writes one)"
                                                 : hint));
  }
  const std::string mpath = (o.out / kManifestName).string();
  std::string keys;
  for (const auto& [k, _] : manifest->layouts) keys += (keys.empty() ? "" : ", ") + k;
  std::string key = o.layout;
  if (key.empty()) {
    if (manifest->layouts.size() != 1) {
      Fail(ErrorCode::kMismatch,
           manifest->layouts.empty()
               ? mpath + ": the manifest lists no layout; run reshard convert first"
               : o.out.string() + " holds " + std::to_string(manifest->layouts.size()) +
                     " layouts (" + keys + "); pick one with --layout KEY");
    }
    key = manifest->layouts.begin()->first;
  }
  const auto lit = manifest->layouts.find(key);
  if (lit == manifest->layouts.end()) {
    Fail(ErrorCode::kNotFound, o.out.string() + ": no layout \"" + key + "\" (it holds: " +
                                   (keys.empty() ? "none" : keys) + ")");
  }
  const ManifestLayout& ml = lit->second;
  if (!ml.complete || ml.ranks.size() != ml.world_size) {
    Fail(ErrorCode::kMismatch, o.out.string() + ": layout " + key + " is incomplete: " +
                                   std::to_string(ml.ranks.size()) + " of " +
                                   std::to_string(ml.world_size) +
                                   " rank files; run reshard convert for the missing ranks");
  }
  bool holds_adapter = false, holds_record = false;
  for (const auto& a : manifest->aux_files) {
    if (!IsPlainFileName(a) || a.ends_with(".safetensors") ||
        a == "model.safetensors.index.json") {
      FailField(mpath, "aux_files", "\"" + Printable(a) + "\"",
                "plain file names other than the weight files and their index");
    }
    holds_adapter = holds_adapter || a == kAdapterConfigName;
    holds_record = holds_record || a == kAdapterRecordName;
  }
  // A PEFT save's record (formats/manifest.md): the adapter's tensors, and whether the base
  // model's tensors are there too (reshard.save(..., base=True)).
  std::set<std::string> adapter_tensors;
  bool base_stored = false;
  if (holds_adapter && holds_record) {
    const fs::path rp = o.out / kAdapterRecordName;
    const std::string text = ReadWholeFile(rp, 256ull << 20);
    internal::CheckJsonDepth(text, rp.string(), std::string(kAdapterRecordName));
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("adapter_tensors") ||
        !j["adapter_tensors"].is_array() || !j.contains("base") || !j["base"].is_object()) {
      FailField(rp.string(), "adapter_tensors", "a record without it",
                "{\"format\": \"reshard.adapter\", \"adapter_tensors\": [...], \"base\": {...}}");
    }
    for (const auto& n : j["adapter_tensors"]) {
      if (!n.is_string()) FailField(rp.string(), "adapter_tensors", n.dump(), "tensor names");
      adapter_tensors.insert(n.get<std::string>());
    }
    const auto& b = j["base"];
    base_stored = b.contains("stored") && b["stored"].is_boolean() && b["stored"].get<bool>();
  }
  // reshard.save of a PEFT model writes its adapters (PEFT's own key names) and the adapter's
  // adapter_config.json: exported as PEFT writes an adapter, never as a model.
  if (o.adapter && !holds_adapter) {
    Fail(ErrorCode::kMismatch,
         o.out.string() + ": --adapter, but its manifest lists no " +
             std::string(kAdapterConfigName) +
             ": not a save of a PEFT model's adapters (reshard.save of a PEFT model writes one)");
  }
  if (!o.adapter && holds_adapter && !base_stored) {
    Fail(ErrorCode::kMismatch,
         o.out.string() + " holds the adapters of a PEFT model (" +
             std::string(kAdapterConfigName) +
             "), not a model: export them as a PEFT adapter directory with --adapter, or merged "
             "into their base model with --merge");
  }
  if (o.adapter && o.hub_names) {
    Fail(ErrorCode::kInvalidArgument, "--adapter and --hub-names: an adapter has PEFT's names");
  }

  // The destination: checked before any data is read.
  const fs::path hf_dir = NormalDir(o.hf_dir);
  const fs::path out_dir = NormalDir(o.out);
  if (IsWithin(hf_dir, out_dir) || IsWithin(out_dir, hf_dir)) {
    Fail(ErrorCode::kInvalidArgument,
         hf_dir.string() + ": the Hugging Face directory must lie outside the reshard output " +
             out_dir.string() + " (and not contain it)");
  }
  if (fs::exists(fs::symlink_status(hf_dir, ec))) {
    if (!fs::is_directory(hf_dir, ec)) {
      Fail(ErrorCode::kMismatch, hf_dir.string() + ": exists and is not a directory");
    }
    if (!fs::is_empty(hf_dir, ec) && !o.force) {
      Fail(ErrorCode::kMismatch,
           hf_dir.string() + ": exists and is not empty; pass --force to replace it");
    }
  }

  bool result_hub_names = false;
  // Rank files: each validated (preamble, header), of this layout and the manifest's source.
  std::vector<RankFileReader> readers;
  std::vector<const RankFileHeader*> headers;
  std::vector<std::string> paths;
  readers.reserve(ml.world_size);
  for (const ManifestRank& mr : ml.ranks) {
    const fs::path p = o.out / ml.dir / RankFileName(mr.rank, ml.world_size);
    readers.push_back(RankFileReader::Open(p));
    CheckListed(readers.back(), *manifest, key, mr.rank, mpath);
    paths.push_back(p.string());
  }
  for (const auto& r : readers) headers.push_back(&r.header());
  std::vector<TensorLocation> locations = DescribeLayoutTensors(headers, paths);
  if (!adapter_tensors.empty()) {  // a PEFT save: the adapter's tensors, or the base's
    size_t found = 0;
    std::erase_if(locations, [&](const TensorLocation& l) {
      const bool is_adapter = adapter_tensors.count(l.name) > 0;
      found += is_adapter;
      return is_adapter != o.adapter;
    });
    if (found != adapter_tensors.size()) {
      FailField((o.out / kAdapterRecordName).string(), "adapter_tensors",
                std::to_string(adapter_tensors.size()) + " names, " + std::to_string(found) +
                    " of them in layout " + key,
                "names of the layout's tensors");
    }
  }
  if (o.hub_names) {
    // The checkpoint's own names and layout: the conversion convert applied, inverted.
    const fs::path mm = o.out / kModelManifestName;
    std::error_code mec;
    if (!fs::exists(mm, mec)) {
      Fail(ErrorCode::kNotFound, o.out.string() + ": no " + std::string(kModelManifestName) +
                                     ", so no record of the checkpoint's names; --hub-names "
                                     "needs the conversion convert captured");
    }
    const ModelManifest model = ReadModelManifest(mm);
    if (model.conversion && !model.conversion->targets.empty()) {
      locations = HubNameLocations(locations, *model.conversion, mm.string());
      result_hub_names = true;
    }
  }

  // Shards: save_pretrained's grouping in the source's order, each file in safetensors order.
  std::vector<uint64_t> sizes;
  std::vector<OutTensor> outs;
  for (const TensorLocation& loc : locations) {
    OutTensor t;
    t.loc = &loc;
    t.dtype = StoredDType(loc.dtype, *policy);
    uint64_t numel = 1;
    for (uint64_t d : loc.shape) numel = CheckedMul(numel, d, loc.name + " shape");
    t.nbytes = *BytesFor(t.dtype, numel);  // a conversion keeps whole bytes (≥ 16-bit floats)
    if (t.dtype != loc.dtype) {
      const uint64_t item = Info(loc.dtype).bits / 8;
      for (const TensorPiece& p : loc.pieces) {
        if (p.src_offset % item || p.dst_offset % item || p.length % item) {
          Fail(ErrorCode::kUnsupported, paths[p.rank] + ": tensor \"" + loc.name +
                                            "\": a piece does not hold whole elements; cannot "
                                            "convert it to " + std::string(Name(t.dtype)));
        }
      }
    }
    sizes.push_back(t.nbytes);
    outs.push_back(t);
  }
  // One adapter_model.safetensors (PEFT reads no index); else save_pretrained's shards.
  std::vector<std::vector<size_t>> groups;
  if (o.adapter) {
    groups.emplace_back(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) groups[0][i] = i;
  } else {
    groups = SplitIntoShards(sizes, o.max_shard_size);
  }
  if (groups.empty()) groups.emplace_back();  // no tensors: one model.safetensors all the same
  std::vector<OutFile> files(groups.size());
  ExportResult result;
  result.hub_names = result_hub_names;
  result.layout_key = key;
  result.hf_dir = hf_dir;
  result.sharded = groups.size() > 1;
  result.tensors = locations.size();
  for (size_t g = 0; g < groups.size(); ++g) {
    files[g].name = o.adapter         ? std::string(kAdapterWeightsName)
                    : result.sharded ? ShardName(g, groups.size())
                                     : "model.safetensors";
    for (size_t i : groups[g]) files[g].tensors.push_back(outs[i]);
    LayOutFile(files[g]);
    result.weight_files.push_back(files[g].name);
    for (const OutTensor& t : files[g].tensors) result.total_size += t.nbytes;
  }

  // Work: every chunk of every piece, in output order (sequential writes per file), then
  // grouped by the rank-file chunk they read, in the order of each chunk's first use: a chunk
  // is read (and checked) once however many pieces it serves (a DTensor layout's Shard(1)
  // entry serves one piece per row from each chunk; FSDP2's pieces share no chunk).
  std::vector<WorkItem> items;
  uint64_t max_chunk = 0, max_conv = 0;
  for (uint32_t f = 0; f < files.size(); ++f) {
    for (uint32_t ti = 0; ti < files[f].tensors.size(); ++ti) {
      const OutTensor& t = files[f].tensors[ti];
      for (uint32_t pi = 0; pi < t.loc->pieces.size(); ++pi) {
        const TensorPiece& p = t.loc->pieces[pi];
        const uint64_t cs = headers[p.rank]->chunk_size;
        // Buffers are sized by the largest chunk read, not by chunk_size: a header may say
        // 16 GiB chunks (formats/rank-file.md) over tensors of a few bytes.
        const uint64_t longest = std::min(cs, headers[p.rank]->tensors[p.entry].nbytes);
        max_chunk = std::max(max_chunk, longest);
        if (t.dtype != t.loc->dtype) {
          max_conv = std::max(max_conv, longest / (Info(t.loc->dtype).bits / 8) *
                                            (Info(t.dtype).bits / 8));
        }
        for (uint64_t c = p.src_offset / cs; c * cs < p.src_offset + p.length; ++c) {
          items.push_back({f, ti, pi, c});
        }
      }
    }
  }

  fs::create_directories(hf_dir.parent_path(), ec);
  RemoveStaleStaging(hf_dir);
  const fs::path staging =
      hf_dir.parent_path() / (StagingPrefix(hf_dir) + SafeHostName() + "-" + std::to_string(::getpid()));
  fs::remove_all(staging, ec);
  if (!fs::create_directory(staging, ec)) {
    Fail(ErrorCode::kIo, staging.string() + ": cannot create the staging directory" +
                             (ec ? " (" + ec.message() + ")" : std::string()));
  }
  StagingGuard guard(staging);
  for (OutFile& f : files) {
    f.file = File::Create(staging / f.name);
    f.file.PWriteExact(f.header.data(), f.header.size(), 0);
    f.file.Truncate(f.size);
  }

  std::vector<size_t> group_start;  // items regrouped: group g is [group_start[g], group_start[g+1])
  {
    struct Key {
      uint32_t rank;
      size_t entry;
      uint64_t chunk;
      bool operator==(const Key&) const = default;
    };
    struct KeyHash {
      size_t operator()(const Key& k) const {
        return std::hash<uint64_t>()(k.chunk * 0x9E3779B97F4A7C15ull ^ (uint64_t{k.rank} << 40) ^ k.entry);
      }
    };
    std::unordered_map<Key, size_t, KeyHash> group_of;
    std::vector<size_t> group(items.size());
    std::vector<size_t> count;
    for (size_t i = 0; i < items.size(); ++i) {
      const TensorPiece& p = files[items[i].file].tensors[items[i].tensor].loc->pieces[items[i].piece];
      const auto [it, fresh] = group_of.emplace(Key{p.rank, p.entry, items[i].chunk}, count.size());
      if (fresh) count.push_back(0);
      group[i] = it->second;
      ++count[it->second];
    }
    group_start.assign(count.size() + 1, 0);
    for (size_t g = 0; g < count.size(); ++g) group_start[g + 1] = group_start[g] + count[g];
    std::vector<WorkItem> grouped(items.size());
    std::vector<size_t> fill(group_start.begin(), group_start.end() - 1);
    for (size_t i = 0; i < items.size(); ++i) grouped[fill[group[i]]++] = items[i];
    items = std::move(grouped);
  }

  std::atomic<uint64_t> read{0};
  const uint64_t total = result.total_size;
  ParallelForOptions po;
  po.threads = o.threads;
  if (o.progress) po.progress = [&](uint64_t done) { o.progress(done, total); };
  ParallelFor(group_start.size() - 1, po, [&] {
    return [&, buf = std::unique_ptr<char[]>(new char[max_chunk ? max_chunk : 1]),
            conv = std::unique_ptr<char[]>(max_conv ? new char[max_conv] : nullptr),
            scratch = std::string()](size_t g) mutable -> uint64_t {
      uint64_t written = 0, len = 0;
      for (size_t i = group_start[g]; i < group_start[g + 1]; ++i) {
        const WorkItem& it = items[i];
        const OutTensor& t = files[it.file].tensors[it.tensor];
        const TensorPiece& p = t.loc->pieces[it.piece];
        const RankFileReader& r = readers[p.rank];
        const TensorEntry& e = r.header().tensors[p.entry];
        const uint64_t cs = r.header().chunk_size;
        if (i == group_start[g]) {  // the group's one chunk
          len = r.ReadChunk(e, it.chunk, buf.get(), scratch);
          read += len;
        }
        const uint64_t begin = it.chunk * cs;
        const uint64_t lo = std::max(begin, p.src_offset);
        const uint64_t hi = std::min(begin + len, p.src_offset + p.length);
        const char* data = buf.get() + (lo - begin);
        uint64_t n = hi - lo;
        uint64_t dst = p.dst_offset + (lo - p.src_offset);
        if (t.dtype != t.loc->dtype) {
          const uint64_t in_item = Info(t.loc->dtype).bits / 8;
          const uint64_t out_item = Info(t.dtype).bits / 8;
          ConvertElements(t.loc->dtype, t.dtype, data, conv.get(), n / in_item);
          data = conv.get();
          dst = dst / in_item * out_item;
          n = n / in_item * out_item;
        }
        files[it.file].file.PWriteExact(data, n, t.file_offset + dst);
        written += n;
      }
      return written;
    };
  });
  result.bytes_read = read.load();

  for (OutFile& f : files) {
    f.file.Sync();
    f.file.Close();
  }
  // The floating dtype of the exported weights, when they have one.
  std::optional<DType> float_dtype;
  bool mixed = false, any_fp8 = false, any_blocks = false;
  for (const OutFile& f : files) {
    for (const OutTensor& t : f.tensors) {
      if (t.dtype == DType::kF8_E4M3 || t.dtype == DType::kF8_E5M2) any_fp8 = true;
      const std::string& n = t.loc->name;
      if (n.size() > 7 && n.compare(n.size() - 7, 7, "_blocks") == 0) any_blocks = true;
      if (!Info(t.dtype).is_float) continue;
      if (float_dtype && *float_dtype != t.dtype) mixed = true;
      float_dtype = t.dtype;
    }
  }
  for (const auto& a : manifest->aux_files) {
    if (o.adapter && a != kAdapterConfigName) continue;  // a PEFT directory: the adapter's own files
    if (!o.adapter && (a == kAdapterConfigName || a == kAdapterRecordName)) continue;  // the base
    // The model manifest's conversion maps the checkpoint's names to the model's: it fits an
    // export of the checkpoint's names (--hub-names); an export of the model's gets the manifest
    // without it (its modules and parameters still say how FSDP1 wraps the model), where a
    // convert of the export applied it to tensors it does not fit, and refused.
    if (a == kModelManifestName && !result.hub_names) {
      const fs::path from = o.out / a;
      nlohmann::json mm = internal::ParseStrictJson(ReadWholeFile(from, 256ull << 20), from.string(), "model manifest");
      if (mm.is_object() && mm.contains("conversion") && mm["conversion"].is_object() &&
          mm["conversion"].contains("targets") && !mm["conversion"]["targets"].empty()) {
        mm.erase("conversion");
        const std::string text = mm.dump(1) + "\n";
        File out = File::Create(staging / a, CopyMode(from));
        out.PWriteExact(text.data(), text.size(), 0);
        out.Sync();
        result.aux_files.push_back(a);
        continue;
      }
    }
    const fs::path from = o.out / a;
    if (!fs::exists(from, ec)) {
      Fail(ErrorCode::kNotFound, from.string() + ": listed in the manifest's aux_files but missing");
    }
    std::optional<std::string> config;
    std::string_view dtype_name;
    if (float_dtype && !mixed) dtype_name = TorchFloatName(*float_dtype);
    ConfigEdits edits;
    std::set<std::string> dequantized;
    if (!any_fp8) dequantized.insert("fp8");
    if (!any_blocks) dequantized.insert("mxfp4");
    if (a == "config.json" && !o.adapter) config = ExportedConfig(from, dtype_name, dequantized, &edits);
    if (config) {
      File out = File::Create(staging / a, CopyMode(from));
      out.PWriteExact(config->data(), config->size(), 0);
      out.Sync();
      if (edits.dtype) result.config_dtype = std::string(dtype_name);
      result.config_dequantized = edits.quantization;
    } else {
      CopyFile(from, staging / a);
    }
    result.aux_files.push_back(a);
  }
  if (result.sharded) {
    nlohmann::json index;
    index["metadata"]["total_size"] = result.total_size;
    nlohmann::json& map = index["weight_map"] = nlohmann::json::object();
    for (const OutFile& f : files) {
      for (const OutTensor& t : f.tensors) map[t.loc->name] = f.name;
    }
    // json.dumps(index, indent=2, sort_keys=True) + "\n", as transformers writes it.
    const std::string text = index.dump(2, ' ', /*ensure_ascii=*/true) + "\n";
    File f = File::Create(staging / "model.safetensors.index.json");
    f.PWriteExact(text.data(), text.size(), 0);
    f.Sync();
  }
  SyncDirectory(staging);
  Publish(staging, hf_dir, o.force);
  guard.Release();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace reshard
