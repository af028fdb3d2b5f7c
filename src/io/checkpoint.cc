#include "reshard/io/checkpoint.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/format/torch_zip.h"
#include "reshard/io/file_byte_source.h"
#include "reshard/io/file_io.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

uint64_t ReadLE64(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

}  // namespace

SafetensorsFile ReadSafetensorsHeader(const std::string& path) {
  File f = File::OpenRead(path);
  const uint64_t size = f.Size();
  std::string prefix(std::min<uint64_t>(size, 8), '\0');
  f.PReadExact(prefix.data(), prefix.size(), 0);
  if (size >= 8) {
    uint64_t n = ReadLE64(prefix.data());
    if (n <= kSafetensorsMaxHeaderSize && 8 + n <= size) {
      prefix.resize(8 + n);
      f.PReadExact(prefix.data() + 8, n, 8);
    }
  }
  SafetensorsFile parsed = ParseSafetensorsHeader(prefix, size, path);
  // Data sample for the source fingerprint: first and last 4 KiB of every tensor.
  constexpr uint64_t kSample = 4096;
  std::string sample;
  for (const auto& t : parsed.tensors) {
    const uint64_t n = std::min(kSample, t.nbytes);
    const size_t at = sample.size();
    sample.resize(at + 2 * n);
    f.PReadExact(sample.data() + at, n, t.offset);
    f.PReadExact(sample.data() + at + n, n, t.offset + t.nbytes - n);
  }
  parsed.sample_xxh3 = Xxh3(sample);
  return parsed;
}

WeightFile ReadTorchZipFile(const std::string& path) {
  File f = File::OpenRead(path);
  FileByteSource src(f);
  return ParseTorchZip(src);
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

std::map<std::string, std::string> ReadWeightMap(const fs::path& index_path) {
  return ParseWeightMap(ReadWholeFile(index_path, 256ull << 20), index_path.string());
}

}  // namespace

Checkpoint OpenCheckpoint(const fs::path& src) {
  std::error_code ec;
  if (!fs::exists(src, ec)) {
    Fail(ErrorCode::kNotFound, src.string() + ": no such file or directory");
  }
  Checkpoint ckpt;
  std::vector<std::string> file_names;
  std::map<std::string, std::string> weight_map;
  if (!fs::is_directory(src)) {  // special files are refused by File::OpenRead
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
