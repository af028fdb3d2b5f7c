#include "reshard/checkpoint.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "json_util.h"
#include "reshard/checksum.h"
#include "reshard/error.h"
#include "reshard/file_io.h"
#include "reshard/torch_zip.h"

namespace reshard {

namespace fs = std::filesystem;

SourceFingerprint SourceFingerprint::FromFiles(std::vector<SourceFile> files) {
  std::sort(files.begin(), files.end(),
            [](const SourceFile& a, const SourceFile& b) { return a.name < b.name; });
  std::string canonical;
  for (const auto& f : files) {
    canonical += f.name;
    canonical += '\0';
    canonical += std::to_string(f.size);
    canonical += '\0';
    canonical += Hex16(f.header_xxh3);
    canonical += '\0';
    canonical += Hex16(f.sample_xxh3);
    canonical += '\n';
  }
  SourceFingerprint fp;
  fp.files = std::move(files);
  fp.fingerprint = Xxh3(canonical);
  return fp;
}

SourceFingerprint SourceFingerprint::FromSaved(const SavedSource& saved) {
  // formats/rank-file.md: the canonical string of a saved source (it has no files).
  std::string canonical = "saved";
  canonical += '\0';
  canonical += Hex16(saved.id);
  canonical += '\0';
  if (saved.step) canonical += std::to_string(*saved.step);
  canonical += '\n';
  SourceFingerprint fp;
  fp.saved = saved;
  fp.fingerprint = Xxh3(canonical);
  return fp;
}

bool SourceFingerprint::operator==(const SourceFingerprint& other) const {
  if (fingerprint != other.fingerprint || files.size() != other.files.size() ||
      saved != other.saved) {
    return false;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].name != other.files[i].name || files[i].size != other.files[i].size ||
        files[i].header_xxh3 != other.files[i].header_xxh3 ||
        files[i].sample_xxh3 != other.files[i].sample_xxh3) {
      return false;
    }
  }
  return true;
}

const SourceTensor* Checkpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const SourceTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

const std::vector<std::string>& AuxFileNames() {
  static const std::vector<std::string> names = {
      "config.json",           "generation_config.json", "tokenizer.json",
      "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json",            "merges.txt",             "vocab.txt",
      "added_tokens.json",     "chat_template.jinja",    "chat_template.json",
      "preprocessor_config.json",
  };
  return names;
}

namespace {

constexpr std::string_view kIndexName = "model.safetensors.index.json";
constexpr std::string_view kBinIndexName = "pytorch_model.bin.index.json";
constexpr std::string_view kBinName = "pytorch_model.bin";

bool IsTorchZipName(const fs::path& p) {
  const auto ext = p.extension();
  return ext == ".bin" || ext == ".pt" || ext == ".pth";
}

WeightFile ReadWeightFile(const fs::path& p, WeightFormat format) {
  if (format == WeightFormat::kTorchZip) return ReadTorchZipFile(p.string());
  SafetensorsFile st = ReadSafetensorsHeader(p.string());
  WeightFile w;
  w.path = st.path;
  w.format = WeightFormat::kSafetensors;
  w.file_size = st.file_size;
  w.header_xxh3 = st.header_xxh3;
  w.sample_xxh3 = st.sample_xxh3;
  for (auto& t : st.tensors) {
    w.tensors.push_back({std::move(t.name), t.dtype, std::move(t.shape), t.offset, t.nbytes});
  }
  return w;
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

std::map<std::string, std::string> ReadWeightMap(const fs::path& index_path) {
  return ParseWeightMap(ReadWholeFile(index_path, 256ull << 20), index_path.string());
}

}  // namespace

std::map<std::string, std::string> ParseWeightMap(std::string_view text, const std::string& path) {
  nlohmann::json index = internal::ParseStrictJson(text, path, "index");
  const auto& map = internal::GetObject(internal::Member(index, "weight_map", path, "index"),
                                        path, "weight_map");
  std::map<std::string, std::string> result;
  for (const auto& [key, value] : map.items()) {
    std::string file = internal::GetString(value, path, "weight_map[\"" + key + "\"]");
    if (!IsPlainFileName(file)) {
      FailField(path, "weight_map[\"" + key + "\"]", "\"" + file + "\"",
                "a file name in the checkpoint directory");
    }
    result.emplace(key, std::move(file));
  }
  if (result.empty()) FailField(path, "weight_map", "an empty map", "at least one tensor");
  return result;
}

Checkpoint OpenCheckpoint(const fs::path& src) {
  std::error_code ec;
  if (!fs::exists(src, ec)) {
    Fail(ErrorCode::kNotFound, src.string() + ": no such file or directory");
  }
  Checkpoint ckpt;
  std::vector<std::string> file_names;
  std::map<std::string, std::string> weight_map;
  if (fs::is_regular_file(src)) {
    if (IsTorchZipName(src)) {
      ckpt.format = WeightFormat::kTorchZip;
    } else if (src.extension() != ".safetensors") {
      Fail(ErrorCode::kUnsupported,
           src.string() + ": neither a .safetensors file nor a torch.save archive (.bin, .pt, "
                          ".pth); pass a Hugging Face checkpoint directory or one weight file");
    }
    ckpt.dir = src.parent_path().empty() ? fs::path(".") : src.parent_path();
    file_names.push_back(src.filename().string());
  } else {
    ckpt.dir = src;
    auto use_index = [&](std::string_view index_name) {
      ckpt.index_file = std::string(index_name);
      weight_map = ReadWeightMap(src / index_name);
      std::set<std::string> unique;
      for (const auto& [k, f] : weight_map) unique.insert(f);
      file_names.assign(unique.begin(), unique.end());
    };
    if (fs::exists(src / kIndexName)) {
      use_index(kIndexName);
    } else if (fs::exists(src / "model.safetensors")) {
      file_names.push_back("model.safetensors");
    } else {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(src)) {
        const auto name = e.path().filename().string();
        if (e.path().extension() == ".safetensors") found.push_back(name);
      }
      if (found.size() == 1) {
        file_names = found;
      } else if (found.size() > 1) {
        Fail(ErrorCode::kDataLoss,
             src.string() + ": " + std::to_string(found.size()) +
                 " .safetensors files but no model.safetensors.index.json to say which tensor "
                 "lives where");
      } else if (fs::exists(src / kBinIndexName)) {
        ckpt.format = WeightFormat::kTorchZip;
        use_index(kBinIndexName);
      } else if (fs::exists(src / kBinName)) {
        ckpt.format = WeightFormat::kTorchZip;
        file_names.push_back(std::string(kBinName));
      } else {
        Fail(ErrorCode::kNotFound,
             src.string() + ": no model.safetensors, model.safetensors.index.json, "
                            "*.safetensors, pytorch_model.bin or pytorch_model.bin.index.json: "
                            "not a Hugging Face checkpoint");
      }
    }
    for (const auto& name : AuxFileNames()) {
      if (fs::is_regular_file(src / name)) ckpt.aux_files.push_back(name);
    }
  }

  std::vector<SourceFile> fp_files;
  for (const auto& name : file_names) {
    const fs::path p = ckpt.dir / name;
    if (!fs::exists(p)) {
      std::string key;
      for (const auto& [k, f] : weight_map) {
        if (f == name) { key = k; break; }
      }
      Fail(ErrorCode::kNotFound, (ckpt.dir / ckpt.index_file).string() + ": weight_map[\"" +
                                     key + "\"] names " + name + ", which does not exist");
    }
    ckpt.files.push_back(ReadWeightFile(p, ckpt.format));
    const auto& f = ckpt.files.back();
    fp_files.push_back({name, f.file_size, f.header_xxh3, f.sample_xxh3});
  }
  ckpt.fingerprint = SourceFingerprint::FromFiles(fp_files);

  for (size_t fi = 0; fi < ckpt.files.size(); ++fi) {
    for (const auto& t : ckpt.files[fi].tensors) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(t.name);
        // Trust only weight_map: a tensor that the index places elsewhere or omits is skipped.
        if (it == weight_map.end() || it->second != file_names[fi]) continue;
      }
      ckpt.tensors.push_back({t.name, t.dtype, t.shape, fi, t.offset, t.nbytes});
    }
  }
  std::sort(ckpt.tensors.begin(), ckpt.tensors.end(),
            [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  for (size_t i = 1; i < ckpt.tensors.size(); ++i) {
    if (ckpt.tensors[i].name == ckpt.tensors[i - 1].name) {
      Fail(ErrorCode::kDataLoss,
           ckpt.dir.string() + ": tensor \"" + ckpt.tensors[i].name + "\" appears in both " +
               file_names[ckpt.tensors[i - 1].file_index] + " and " +
               file_names[ckpt.tensors[i].file_index]);
    }
  }
  for (const auto& [key, file] : weight_map) {
    if (!ckpt.Find(key)) {
      Fail(ErrorCode::kDataLoss, (ckpt.dir / ckpt.index_file).string() + ": weight_map[\"" +
                                     key + "\"] names " + file + ", which has no tensor \"" +
                                     key + "\"");
    }
  }
  if (ckpt.tensors.empty()) {
    Fail(ErrorCode::kDataLoss, src.string() + ": the checkpoint holds no tensors");
  }
  return ckpt;
}

}  // namespace reshard
