// Uses the installed reshard library (find_package(reshard), reshard::core) with no Python and
// no CUDA: writes a small safetensors checkpoint byte by byte, converts it for 2 ranks (zstd
// frames, so the zstd dependency is exercised), verifies the output, loads every rank file into
// host memory with the pipelined loader, and checks each rank's bytes against the rows of the
// source that torch.chunk gives that rank (computed here, not by the library).
//
//   reshard_consumer WORKDIR      exit 0 and "consumer: OK ..." when every byte matches
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <reshard/base/error.h>
#include <reshard/format/rank_file_format.h>
#include <reshard/io/rank_file.h>
#include <reshard/ops/build_info.h>
#include <reshard/ops/convert.h>
#include <reshard/ops/verify.h>
#include <reshard/runtime/loader.h>

namespace fs = std::filesystem;

namespace {

struct Tensor {
  std::string name;
  std::string dtype;  // safetensors dtype name
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
};

uint64_t RowBytes(const Tensor& t) {
  uint64_t n = t.bytes.size();
  return t.shape.empty() || t.shape[0] == 0 ? n : n / t.shape[0];
}

// One safetensors file: 8-byte little-endian header size, JSON header, data.
void WriteSafetensors(const fs::path& path, const std::vector<Tensor>& tensors) {
  std::string header = "{";
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    std::string shape;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      shape += (d ? "," : "") + std::to_string(t.shape[d]);
    }
    header += (i ? "," : "") + std::string("\"") + t.name + "\":{\"dtype\":\"" + t.dtype +
              "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.bytes.size()) + "]}";
    offset += t.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const Tensor& t : tensors) {
    f.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  }
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

Tensor Make(std::string name, std::string dtype, std::vector<uint64_t> shape, size_t elem,
            uint32_t seed) {
  Tensor t{std::move(name), std::move(dtype), std::move(shape), {}};
  uint64_t count = 1;
  for (uint64_t d : t.shape) count *= d;
  t.bytes.resize(count * elem);
  uint32_t x = seed;
  for (auto& b : t.bytes) {  // xorshift: no two rows alike
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x);
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: reshard_consumer WORKDIR\n");
    return 2;
  }
  const fs::path work = argv[1];
  const uint32_t world = 2;
  try {
    fs::remove_all(work);
    fs::create_directories(work / "src");
    const std::vector<Tensor> tensors = {
        Make("model.embed.weight", "F32", {5, 3}, 4, 1),  // 5 rows over 2 ranks: 3 + 2
        Make("model.norm.weight", "BF16", {7}, 2, 2),     // 4 + 3
        Make("model.layer.bias", "F16", {1}, 2, 3),       // 1 + 0: rank 1's shard is empty
        Make("model.scale", "F32", {}, 4, 4),             // 0-dim: whole on every rank
    };
    WriteSafetensors(work / "src" / "model.safetensors", tensors);

    reshard::ConvertOptions co;
    co.source = work / "src";
    co.out = work / "out";
    co.layout.world_size = world;
    co.codec = reshard::Codec::kZstd;
    co.threads = 2;
    const reshard::ConvertResult cr = reshard::Convert(co);
    if (!cr.layout_complete || cr.ranks_written.size() != world) {
      std::fprintf(stderr, "consumer: convert wrote %zu of %u ranks\n", cr.ranks_written.size(),
                   world);
      return 1;
    }

    reshard::VerifyOptions vo;
    vo.path = work / "out";
    vo.source = work / "src";
    const reshard::VerifyReport vr = reshard::Verify(vo);
    if (!vr.ok()) {
      for (const auto& p : vr.problems) std::fprintf(stderr, "verify: %s\n", p.message.c_str());
      return 1;
    }

    uint64_t checked = 0;
    for (uint32_t rank = 0; rank < world; ++rank) {
      const fs::path file = cr.layout_dir / reshard::RankFileName(rank, world);
      const reshard::RankFileReader reader = reshard::RankFileReader::Open(file);
      std::map<std::string, std::vector<uint8_t>> host;
      std::vector<reshard::LoadTarget> targets;
      for (const Tensor& t : tensors) {
        const reshard::TensorEntry* e = reader.header().Find(t.name);
        if (!e) {
          std::fprintf(stderr, "consumer: %s has no tensor %s\n", file.c_str(), t.name.c_str());
          return 1;
        }
        auto& buf = host[t.name];
        buf.assign(e->nbytes, 0xAB);
        targets.push_back({t.name, buf.data(), e->nbytes, false});
      }
      reshard::LoadOptions lo;
      lo.threads = 2;
      const reshard::LoadStats lr = reshard::LoadRankFile(reader, targets, nullptr, lo);
      for (const Tensor& t : tensors) {
        std::vector<uint8_t> expect;
        if (t.shape.empty()) {
          expect = t.bytes;
        } else {  // torch.chunk: c = ceil(n / W); rank r owns rows [min(r c, n), min((r+1) c, n))
          const uint64_t n = t.shape[0], c = (n + world - 1) / world;
          const uint64_t begin = std::min<uint64_t>(rank * c, n), end = std::min<uint64_t>((rank + 1) * c, n);
          expect.assign(t.bytes.begin() + begin * RowBytes(t), t.bytes.begin() + end * RowBytes(t));
        }
        if (host[t.name] != expect) {
          std::fprintf(stderr, "consumer: rank %u tensor %s: %zu bytes loaded differ from the %zu "
                       "expected source bytes\n", rank, t.name.c_str(), host[t.name].size(),
                       expect.size());
          return 1;
        }
        checked += expect.size();
      }
      if (lr.bytes != [&] { uint64_t s = 0; for (auto& [k, v] : host) s += v.size(); return s; }()) {
        std::fprintf(stderr, "consumer: loader reported %llu bytes\n",
                     static_cast<unsigned long long>(lr.bytes));
        return 1;
      }
    }
    const reshard::BuildInfo bi = reshard::GetBuildInfo();
    std::printf("consumer: OK: reshard %s (format %u, zstd %s), %u ranks, %llu bytes checked\n",
                bi.version.c_str(), bi.format_version, bi.zstd_version.c_str(), world,
                static_cast<unsigned long long>(checked));
    return 0;
  } catch (const reshard::Error& e) {
    std::fprintf(stderr, "consumer: reshard error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: error: %s\n", e.what());
    return 1;
  }
}
