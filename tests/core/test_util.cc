#include "core/test_util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "reshard/io/file_io.h"

namespace reshard::test {

// ---- files and directories --------------------------------------------------------------

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/reshard-test-XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

ScopedEnv::ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
  if (const char* old = std::getenv(name)) old_ = old;
  if (value) {
    ::setenv(name, value->c_str(), 1);
  } else {
    ::unsetenv(name);
  }
}

ScopedEnv::ScopedEnv(const char* name, const char* value)
    : ScopedEnv(name, value ? std::optional<std::string>(value) : std::nullopt) {}

ScopedEnv::~ScopedEnv() {
  if (old_) {
    ::setenv(name_, old_->c_str(), 1);
  } else {
    ::unsetenv(name_);
  }
}

void Evict(const fs::path& path) {
  File f = File::OpenRead(path);
  ::fdatasync(f.fd());
  ::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_DONTNEED);
}

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path.string());
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("short write to " + path.string());
}

std::vector<std::string> ListFiles(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) names.push_back(fs::relative(e.path(), dir).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string PatternBytes(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s[i] = static_cast<char>(x >> 56);
  }
  return s;
}

uint64_t Le64(std::string_view b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

void PutLe64(std::string& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t Le32(std::string_view b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

void PutLe32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t RefXxh3(std::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string RefHex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t RefCombine(const std::vector<uint64_t>& chunk_checksums) {
  std::string le(chunk_checksums.size() * 8, '\0');
  for (size_t i = 0; i < chunk_checksums.size(); ++i) PutLe64(le, i * 8, chunk_checksums[i]);
  return RefXxh3(le);
}

std::vector<uint64_t> RefChunkHashes(std::string_view bytes, uint64_t chunk_size) {
  std::vector<uint64_t> out;
  for (uint64_t at = 0; at < bytes.size(); at += chunk_size) {
    out.push_back(RefXxh3(bytes.substr(at, chunk_size)));
  }
  return out;
}

// ---- safetensors ------------------------------------------------------------------------

uint32_t DtypeBits(std::string_view d) {
  static const std::map<std::string_view, uint32_t> bits = {
      {"BOOL", 8},    {"U8", 8},       {"I8", 8},       {"U16", 16},     {"I16", 16},
      {"U32", 32},    {"I32", 32},     {"U64", 64},     {"I64", 64},     {"F16", 16},
      {"BF16", 16},   {"F32", 32},     {"F64", 64},     {"C64", 64},     {"F8_E4M3", 8},
      {"F8_E5M2", 8}, {"F8_E8M0", 8},  {"F6_E2M3", 6},  {"F6_E3M2", 6},  {"F4", 4},
  };
  auto it = bits.find(d);
  return it == bits.end() ? 0 : it->second;
}

uint64_t TensorSpec::Numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t TensorSpec::RowBytes() const {
  uint64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n * DtypeBits(dtype) / 8;
}

TensorSpec MakeTensor(std::string name, std::string dtype, std::vector<uint64_t> shape,
                      uint64_t seed) {
  TensorSpec t{std::move(name), std::move(dtype), std::move(shape), {}};
  const uint64_t bits = t.Numel() * DtypeBits(t.dtype);
  if (bits % 8 != 0) throw std::invalid_argument("MakeTensor: not a whole number of bytes");
  t.data = PatternBytes(bits / 8, seed);
  return t;
}

ojson SafetensorsHeader(const std::vector<TensorSpec>& tensors,
                        const std::optional<std::map<std::string, std::string>>& metadata) {
  ojson h = ojson::object();
  if (metadata) {
    ojson m = ojson::object();
    for (const auto& [k, v] : *metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t at = 0;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", t.dtype},
                 {"shape", t.shape},
                 {"data_offsets", {at, at + t.data.size()}}};
    at += t.data.size();
  }
  return h;
}

std::string SafetensorsData(const std::vector<TensorSpec>& tensors) {
  std::string d;
  for (const auto& t : tensors) d += t.data;
  return d;
}

std::string AssembleSafetensors(std::string_view header_text, std::string_view data,
                                std::optional<uint64_t> length) {
  std::string out(8, '\0');
  PutLe64(out, 0, length ? *length : header_text.size());
  out.append(header_text);
  out.append(data);
  return out;
}

std::string SafetensorsBytes(const std::vector<TensorSpec>& tensors,
                             const std::function<void(ojson&)>& mutate) {
  ojson h = SafetensorsHeader(tensors);
  if (mutate) mutate(h);
  std::string text = h.dump();
  while (text.size() % 8 != 0) text += ' ';
  return AssembleSafetensors(text, SafetensorsData(tensors));
}

// ---- checkpoints ------------------------------------------------------------------------

TensorMap WriteShardedCheckpoint(const fs::path& dir,
                                 const std::vector<std::vector<TensorSpec>>& files) {
  fs::create_directories(dir);
  TensorMap all;
  ojson weight_map = ojson::object();
  uint64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, files.size());
    WriteBytes(dir / name, SafetensorsBytes(files[i]));
    for (const auto& t : files[i]) {
      weight_map[t.name] = name;
      all[t.name] = t;
      total += t.data.size();
    }
  }
  ojson index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  WriteBytes(dir / "model.safetensors.index.json", index.dump(2));
  return all;
}

std::vector<std::vector<TensorSpec>> AwkwardCheckpointFiles(uint64_t seed) {
  uint64_t s = seed * 1000;
  // Within a file the order is deliberately not alphabetical, so that "source order" and
  // "name order" differ.
  std::vector<TensorSpec> f1 = {
      MakeTensor("model.embed_tokens.weight", "BF16", {131, 24}, ++s),  // 6288 B, 2 chunks
      MakeTensor("model.scale", "F32", {}, ++s),                        // 0-dim
      MakeTensor("model.layers.0.mlp.up_proj.weight", "BF16", {37, 64}, ++s),
      MakeTensor("model.empty", "F16", {0, 8}, ++s),                    // empty
      MakeTensor("model.layers.0.input_layernorm.weight", "F32", {24}, ++s),
  };
  std::vector<TensorSpec> f2 = {
      MakeTensor("model.layers.1.self_attn.q_proj.weight", "F32", {6, 300}, ++s),
      MakeTensor("model.layers.1.tiny", "I64", {3}, ++s),  // fewer rows than ranks
      MakeTensor("model.step", "I64", {}, ++s),
      MakeTensor("lm_head.weight", "F8_E4M3", {67, 130}, ++s),
      MakeTensor("model.mask", "BOOL", {5, 3}, ++s),
      MakeTensor("model.zero_rows", "BF16", {2, 0}, ++s),  // rows of 0 bytes
  };
  std::vector<TensorSpec> f3 = {
      MakeTensor("model.norm.weight", "F16", {1}, ++s),
      MakeTensor("model.layers.2.big", "U8", {9000}, ++s),  // 3 chunks of 4096 on one rank
  };
  return {f1, f2, f3};
}

// ---- the FSDP2 chunk rule, brute force --------------------------------------------------

std::pair<uint64_t, uint64_t> BruteRows(uint64_t n, uint64_t world_size, uint64_t rank) {
  uint64_t c = 0;
  while (c * world_size < n) ++c;
  uint64_t left = n;
  uint64_t start = 0;
  for (uint64_t r = 0;; ++r) {
    const uint64_t take = left < c ? left : c;
    if (r == rank) return {start, start + take};
    start += take;
    left -= take;
  }
}

std::string BruteSlice(const TensorSpec& t, uint64_t world_size, uint64_t rank) {
  if (t.shape.empty()) return t.data;
  auto [s, e] = BruteRows(t.shape[0], world_size, rank);
  const uint64_t row = t.RowBytes();
  return t.data.substr(s * row, (e - s) * row);
}

// ---- rank files -------------------------------------------------------------------------

RawRankFile RawRankFile::Read(const fs::path& path) {
  RawRankFile f;
  f.bytes = ReadBytes(path);
  if (f.bytes.size() < 64) throw std::runtime_error(path.string() + ": too short for a preamble");
  f.format_version = Le32(f.bytes, 8);
  f.flags = Le32(f.bytes, 12);
  f.data_offset = Le64(f.bytes, 16);
  f.data_size = Le64(f.bytes, 24);
  f.header_offset = Le64(f.bytes, 32);
  f.header_size = Le64(f.bytes, 40);
  f.header_xxh3 = Le64(f.bytes, 48);
  if (f.header_offset + f.header_size != f.bytes.size()) {
    throw std::runtime_error(path.string() + ": preamble does not match the file size");
  }
  f.header = ojson::parse(f.bytes.substr(f.header_offset, f.header_size));
  return f;
}

std::string RefPreamble(uint32_t format_version, uint32_t flags, uint64_t data_offset,
                        uint64_t data_size, uint64_t header_offset, uint64_t header_size,
                        uint64_t header_xxh3) {
  std::string p(64, '\0');
  const unsigned char magic[8] = {0x89, 0x52, 0x53, 0x48, 0x44, 0x0D, 0x0A, 0x1A};
  std::memcpy(p.data(), magic, 8);
  PutLe32(p, 8, format_version);
  PutLe32(p, 12, flags);
  PutLe64(p, 16, data_offset);
  PutLe64(p, 24, data_size);
  PutLe64(p, 32, header_offset);
  PutLe64(p, 40, header_size);
  PutLe64(p, 48, header_xxh3);
  PutLe64(p, 56, RefXxh3(std::string_view(p).substr(0, 56)));
  return p;
}

void EditRankHeader(const fs::path& path, const std::function<void(ojson&)>& mutate) {
  RawRankFile f = RawRankFile::Read(path);
  mutate(f.header);
  const std::string text = f.header.dump(1);
  std::string out = f.bytes.substr(0, f.header_offset) + text;
  const std::string pre = RefPreamble(f.format_version, f.flags, f.data_offset, f.data_size,
                                      f.header_offset, text.size(), RefXxh3(text));
  out.replace(0, 64, pre);
  WriteBytes(path, out);
}

std::string RawTensorBytes(const RawRankFile& f, const std::string& name) {
  for (const auto& t : f.header["tensors"]) {
    if (t["name"] == name) {
      return f.bytes.substr(f.data_offset + t["offset"].get<uint64_t>(),
                            t["nbytes"].get<uint64_t>());
    }
  }
  throw std::runtime_error("no tensor " + name);
}

::testing::AssertionResult SameBytes(std::string_view got, std::string_view expected) {
  if (got == expected) return ::testing::AssertionSuccess();
  size_t k = 0;
  while (k < got.size() && k < expected.size() && got[k] == expected[k]) ++k;
  return ::testing::AssertionFailure() << "got " << got.size() << " bytes, expected "
                                       << expected.size() << "; first difference at byte " << k;
}

}  // namespace reshard::test
