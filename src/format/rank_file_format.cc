#include "reshard/format/rank_file_format.h"

#include <cstdio>
#include <cstring>
#include <set>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/format/shape.h"

namespace reshard {

using internal::Describe;
using internal::GetArray;
using internal::GetHex16;
using internal::GetString;
using internal::GetU64;
using internal::Member;
using nlohmann::json;

std::string_view CodecName(Codec codec) { return codec == Codec::kZstd ? "zstd" : "raw"; }

namespace {

void PutLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetLE(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::vector<uint64_t> GetShape(const json& v, const std::string& path, const std::string& field) {
  std::vector<uint64_t> shape;
  const json& a = GetArray(v, path, field);
  for (size_t i = 0; i < a.size(); ++i) {
    shape.push_back(GetU64(a[i], path, field + "[" + std::to_string(i) + "]"));
  }
  return shape;
}

// The "flat" object of an FSDP1 entry (formats/rank-file.md): parameters in flat order,
// inside [0, numel), not overlapping, each numel = product of its shape.
std::shared_ptr<const FlatInfo> ParseFlat(const json& v, const TensorEntry& t,
                                          const RankFileHeader& h, const std::string& path,
                                          const std::string& f) {
  const std::string ff = f + ".flat";
  internal::GetObject(v, path, ff);
  auto flat = std::make_shared<FlatInfo>();
  flat->unit = GetString(Member(v, "unit", path, ff), path, ff + ".unit");
  if (t.name != FlatEntryName(flat->unit)) {
    FailField(path, ff + ".unit", "\"" + Printable(flat->unit) + "\"",
              "the unit named by the entry \"" + Printable(t.name) + "\"");
  }
  flat->numel = GetU64(Member(v, "numel", path, ff), path, ff + ".numel");
  if (t.global_shape.size() != 1 || t.global_shape[0] != flat->numel) {
    FailField(path, f + ".global_shape", ShapeText(t.global_shape),
              "[" + std::to_string(flat->numel) + "] (flat.numel)");
  }
  flat->aligned_numel = GetU64(Member(v, "aligned_numel", path, ff), path, ff + ".aligned_numel");
  if (flat->aligned_numel > 16 || (flat->aligned_numel > 0) != h.use_orig_params) {
    FailField(path, ff + ".aligned_numel", std::to_string(flat->aligned_numel),
              h.use_orig_params ? "1 to 16 (use_orig_params)" : "0 (no use_orig_params)");
  }
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16 &&
      t.dtype != DType::kF64) {
    FailField(path, f + ".dtype", std::string(Name(t.dtype)), "F16, BF16, F32 or F64 (FSDP1)");
  }
  const json& params = GetArray(Member(v, "params", path, ff), path, ff + ".params");
  if (params.empty()) FailField(path, ff + ".params", "an empty list", "at least one parameter");
  uint64_t end = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string pf = ff + ".params[" + std::to_string(i) + "]";
    FlatParamInfo p;
    p.fqn = GetString(Member(params[i], "fqn", path, pf), path, pf + ".fqn");
    p.key = GetString(Member(params[i], "key", path, pf), path, pf + ".key");
    p.shape = GetShape(Member(params[i], "shape", path, pf), path, pf + ".shape");
    p.offset = GetU64(Member(params[i], "offset", path, pf), path, pf + ".offset");
    p.numel = 1;
    for (uint64_t d : p.shape) p.numel = CheckedMul(p.numel, d, path + ": " + pf + ".shape");
    const uint64_t pe = CheckedAdd(p.offset, p.numel, path + ": " + pf);
    if (p.offset < end || pe > flat->numel) {
      FailField(path, pf + ".offset",
                "[" + std::to_string(p.offset) + ", " + std::to_string(pe) + ")",
                "after the previous parameter (" + std::to_string(end) + ") and inside numel " +
                    std::to_string(flat->numel));
    }
    end = pe;
    flat->params.push_back(std::move(p));
  }
  const json& shared = GetArray(Member(v, "shared", path, ff), path, ff + ".shared");
  for (size_t i = 0; i < shared.size(); ++i) {
    flat->shared.push_back(GetString(shared[i], path, ff + ".shared[" + std::to_string(i) + "]"));
  }
  return flat;
}

}  // namespace

std::array<uint8_t, kPreambleSize> EncodePreamble(const Preamble& p) {
  std::array<uint8_t, kPreambleSize> b{};
  std::memcpy(b.data(), kRankFileMagic.data(), 8);
  PutLE(b.data() + 8, p.format_version, 4);
  PutLE(b.data() + 12, p.flags, 4);
  PutLE(b.data() + 16, p.data_offset, 8);
  PutLE(b.data() + 24, p.data_size, 8);
  PutLE(b.data() + 32, p.header_offset, 8);
  PutLE(b.data() + 40, p.header_size, 8);
  PutLE(b.data() + 48, p.header_xxh3, 8);
  PutLE(b.data() + 56, Xxh3(b.data(), kPreambleHashedBytes), 8);
  return b;
}

Preamble DecodePreamble(const uint8_t* b, uint64_t file_size, const std::string& path) {
  if (file_size < kPreambleSize) {
    FailField(path, "preamble", "a file of " + std::to_string(file_size) + " bytes",
              "at least 64 bytes (truncated file?)");
  }
  if (std::memcmp(b, kRankFileMagic.data(), 8) != 0) {
    char found[40];
    std::snprintf(found, sizeof found, "%02x %02x %02x %02x %02x %02x %02x %02x", b[0], b[1],
                  b[2], b[3], b[4], b[5], b[6], b[7]);
    FailField(path, "magic", found, "89 52 53 48 44 0d 0a 1a (not a reshard rank file)");
  }
  Preamble p;
  p.format_version = static_cast<uint32_t>(GetLE(b + 8, 4));
  const uint64_t stored_hash = GetLE(b + 56, 8);
  const uint64_t hash = Xxh3(b, kPreambleHashedBytes);
  if (p.format_version != kRankFileVersion) {
    // The version is checked first (a newer version may lay the preamble out differently),
    // but "upgrade" is only good advice when the preamble is not simply corrupt.
    std::string why;
    if (stored_hash != hash) {
      why = " (preamble_xxh3 does not match either: the file is corrupt";
      if (p.format_version > kRankFileVersion) why += ", or was written by a newer reshard";
      why += ")";
    } else if (p.format_version > kRankFileVersion) {
      why = " (the file was written by a newer reshard; upgrade reshard)";
    }
    FailField(path, "format_version", std::to_string(p.format_version),
              std::to_string(kRankFileVersion) + why);
  }
  if (stored_hash != hash) {
    FailField(path, "preamble_xxh3", Hex16(stored_hash), Hex16(hash) + " (preamble corrupt)");
  }
  p.flags = static_cast<uint32_t>(GetLE(b + 12, 4));
  p.data_offset = GetLE(b + 16, 8);
  p.data_size = GetLE(b + 24, 8);
  p.header_offset = GetLE(b + 32, 8);
  p.header_size = GetLE(b + 40, 8);
  p.header_xxh3 = GetLE(b + 48, 8);
  if (p.flags != 0) FailField(path, "flags", std::to_string(p.flags), "0");
  if (p.data_offset != kDataOffset) {
    FailField(path, "data_offset", std::to_string(p.data_offset), std::to_string(kDataOffset));
  }
  if (p.data_size % kDataAlignment != 0) {
    FailField(path, "data_size", std::to_string(p.data_size), "a multiple of 4096");
  }
  if (p.header_offset != CheckedAdd(p.data_offset, p.data_size, path + ": header_offset")) {
    FailField(path, "header_offset", std::to_string(p.header_offset),
              std::to_string(p.data_offset + p.data_size) + " (data_offset + data_size)");
  }
  if (p.header_size == 0 || p.header_size > kMaxHeaderSize) {
    FailField(path, "header_size", std::to_string(p.header_size),
              "1 to " + std::to_string(kMaxHeaderSize));
  }
  const uint64_t expected_size = CheckedAdd(p.header_offset, p.header_size, path + ": file size");
  if (file_size != expected_size) {
    FailField(path, "file size", std::to_string(file_size) + " bytes",
              std::to_string(expected_size) + " (header_offset + header_size)" +
                  (file_size < expected_size ? "; the file is truncated" : ""));
  }
  return p;
}

const TensorEntry* RankFileHeader::Find(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

LayoutSpec RankFileHeader::Layout() const {
  LayoutSpec spec;
  spec.kind = kind;
  spec.world_size = world_size;
  spec.dtype = dtype_policy;
  spec.wrap = wrap;
  spec.use_orig_params = use_orig_params;
  spec.param_dtype = param_dtype;
  spec.mesh = mesh;
  spec.plan_name = plan_name;
  spec.plan_xxh3 = plan_xxh3;
  return spec;
}

void RankFileHeader::SetLayout(const LayoutSpec& layout) {
  layout_key = layout.Key();
  kind = layout.kind;
  world_size = layout.world_size;
  dtype_policy = layout.dtype;
  wrap = layout.wrap;
  use_orig_params = layout.use_orig_params;
  param_dtype = layout.param_dtype;
  mesh = layout.mesh;
  plan_name = layout.plan_name;
  plan_xxh3 = layout.plan_xxh3;
}

std::string RankFileName(uint32_t rank, uint32_t world_size) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05u-of-%05u", rank, world_size);
  return std::string(buf) + std::string(kRankFileExtension);
}

std::string SerializeHeader(const RankFileHeader& h) {
  json j;
  j["format"] = kRankFileFormatName;
  j["format_version"] = kRankFileVersion;
  j["writer"] = h.writer.empty() ? std::string(WriterString()) : h.writer;
  const LayoutSpec spec = h.Layout();
  j["layout"] = {{"key", h.layout_key},
                 {"kind", spec.KindName()},
                 {"world_size", h.world_size},
                 {"dtype", h.dtype_policy}};
  if (h.kind == LayoutKind::kFsdp1) {
    j["layout"]["wrap"] = h.wrap;
    j["layout"]["use_orig_params"] = h.use_orig_params;
    j["layout"]["param_dtype"] = h.param_dtype;
  }
  if (h.kind == LayoutKind::kDTensor) {
    j["layout"]["mesh"] = {{"names", h.mesh.names}, {"shape", h.mesh.shape}};
    j["layout"]["plan"] = {{"name", h.plan_name}, {"xxh3", Hex16(h.plan_xxh3)}};
  }
  j["rank"] = h.rank;
  if (h.kind == LayoutKind::kDTensor) j["coordinate"] = h.mesh.Coordinate(h.rank);
  j["source"] = internal::SourceToJson(h.source);
  j["chunk_size"] = h.chunk_size;
  json tensors = json::array();
  for (const auto& t : h.tensors) {
    json e;
    e["name"] = t.name;
    e["dtype"] = Name(t.dtype);
    e["global_shape"] = t.global_shape;
    if (t.sharded && !t.dtensor) {
      e["shard"] = {{"dim", 0}, {"start", t.rows.start}, {"end", t.rows.end}};
    } else {
      e["shard"] = nullptr;
    }
    if (t.dtensor) {
      json placements = json::array();
      for (const Placement& p : t.dtensor->placements) placements.push_back(p.ToString());
      e["placements"] = std::move(placements);
      e["fsdp_mesh_dim"] = t.dtensor->fsdp_mesh_dim < 0 ? json(nullptr) : json(t.dtensor->fsdp_mesh_dim);
    }
    e["local_shape"] = t.local_shape;
    e["nbytes"] = t.nbytes;
    e["offset"] = t.offset;
    e["stored_size"] = t.stored_size;
    e["codec"] = CodecName(t.codec);
    json chunks = json::array();
    for (uint64_t c : t.chunk_xxh3) chunks.push_back(Hex16(c));
    e["chunk_xxh3"] = std::move(chunks);
    if (t.codec == Codec::kZstd) {
      json frames = json::array();
      for (const auto& f : t.frames) frames.push_back({f.offset, f.size});
      e["frames"] = std::move(frames);
    }
    e["xxh3"] = Hex16(t.xxh3);
    if (t.flat) {
      json params = json::array();
      for (const auto& p : t.flat->params) {
        params.push_back({{"fqn", p.fqn}, {"key", p.key}, {"shape", p.shape}, {"offset", p.offset}});
      }
      e["flat"] = {{"unit", t.flat->unit},
                   {"numel", t.flat->numel},
                   {"aligned_numel", t.flat->aligned_numel},
                   {"params", std::move(params)},
                   {"shared", t.flat->shared}};
    }
    tensors.push_back(std::move(e));
  }
  j["tensors"] = std::move(tensors);
  return j.dump(1);
}

namespace {

// A DTensor entry's placements and fsdp_mesh_dim, checked against its shapes (invariant 6).
DTensorSharding ParseDTensorEntry(const json& e, const TensorEntry& t, const RankFileHeader& h,
                                  const std::string& path, const std::string& f) {
  DTensorSharding s;
  s.mesh_shape = h.mesh.shape;
  const json& placements = GetArray(Member(e, "placements", path, f), path, f + ".placements");
  if (placements.size() != h.mesh.ndim()) {
    FailField(path, f + ".placements", std::to_string(placements.size()) + " placements",
              std::to_string(h.mesh.ndim()) + " (one per mesh dim)");
  }
  for (size_t i = 0; i < placements.size(); ++i) {
    const std::string field = f + ".placements[" + std::to_string(i) + "]";
    const std::string text = GetString(placements[i], path, field);
    const auto p = ParsePlacement(text);
    if (!p) FailField(path, field, "\"" + Printable(text) + "\"", "\"R\", \"S(d)\" or \"_S(d,k)\"");
    s.placements.push_back(*p);
  }
  const json& fsdp = Member(e, "fsdp_mesh_dim", path, f);
  if (!fsdp.is_null()) {
    const uint64_t d = GetU64(fsdp, path, f + ".fsdp_mesh_dim");
    if (d >= h.mesh.ndim()) {
      FailField(path, f + ".fsdp_mesh_dim", std::to_string(d), "null or a mesh dim");
    }
    s.fsdp_mesh_dim = static_cast<int32_t>(d);
  }
  std::vector<uint64_t> local;
  try {
    local = DTensorLocalShape(t.global_shape, s, h.mesh.shape, h.mesh.Coordinate(h.rank), path + ": " + f);
  } catch (const Error& err) {
    Fail(ErrorCode::kDataLoss, err.what());
  }
  if (local != t.local_shape) {
    FailField(path, f + ".local_shape", ShapeText(t.local_shape),
              ShapeText(local) + " (its placements on mesh coordinate " +
                  ShapeText([&] {
                    std::vector<uint64_t> c;
                    for (uint32_t v : h.mesh.Coordinate(h.rank)) c.push_back(v);
                    return c;
                  }()) +
                  ")");
  }
  return s;
}

}  // namespace

RankFileHeader ParseHeader(std::string_view text, uint64_t data_size, const std::string& path) {
  json j = internal::ParseStrictJson(text, path, "header", "chunk_xxh3");
  if (!j.is_object()) FailField(path, "header", Describe(j), "a JSON object");
  RankFileHeader h;
  std::string format = GetString(Member(j, "format", path, "header"), path, "format");
  if (format != kRankFileFormatName) {
    FailField(path, "format", "\"" + format + "\"", "\"reshard.rank\"");
  }
  uint64_t version = GetU64(Member(j, "format_version", path, "header"), path, "format_version");
  if (version != kRankFileVersion) {
    FailField(path, "format_version (header)", std::to_string(version),
              std::to_string(kRankFileVersion));
  }
  if (j.contains("writer")) h.writer = GetString(j["writer"], path, "writer");
  const json& layout = internal::GetObject(Member(j, "layout", path, "header"), path, "layout");
  h.layout_key = GetString(Member(layout, "key", path, "layout"), path, "layout.key");
  if (!internal::ValidLayoutKey(h.layout_key)) {
    FailField(path, "layout.key", "\"" + h.layout_key + "\"", "a name of [A-Za-z0-9._-]");
  }
  std::string kind = GetString(Member(layout, "kind", path, "layout"), path, "layout.kind");
  auto parsed_kind = ParseLayoutKind(kind);
  if (!parsed_kind) FailField(path, "layout.kind", "\"" + kind + "\"", "\"fsdp2\", \"fsdp1\" or \"dtensor\"");
  h.kind = *parsed_kind;
  uint64_t ws = GetU64(Member(layout, "world_size", path, "layout"), path, "layout.world_size");
  if (ws == 0 || ws > 1u << 24) {
    FailField(path, "layout.world_size", std::to_string(ws), "1 to 16777216");
  }
  h.world_size = static_cast<uint32_t>(ws);
  h.dtype_policy = GetString(Member(layout, "dtype", path, "layout"), path, "layout.dtype");
  if (h.kind == LayoutKind::kFsdp1) {
    const json& wrap = GetArray(Member(layout, "wrap", path, "layout"), path, "layout.wrap");
    for (size_t i = 0; i < wrap.size(); ++i) {
      h.wrap.push_back(GetString(wrap[i], path, "layout.wrap[" + std::to_string(i) + "]"));
    }
    h.use_orig_params = internal::GetBool(Member(layout, "use_orig_params", path, "layout"), path,
                                          "layout.use_orig_params");
    h.param_dtype =
        GetString(Member(layout, "param_dtype", path, "layout"), path, "layout.param_dtype");
  }
  if (h.kind == LayoutKind::kDTensor) {
    const json& mesh = internal::GetObject(Member(layout, "mesh", path, "layout"), path, "layout.mesh");
    const json& names = GetArray(Member(mesh, "names", path, "layout.mesh"), path, "layout.mesh.names");
    const json& shape = GetArray(Member(mesh, "shape", path, "layout.mesh"), path, "layout.mesh.shape");
    for (size_t i = 0; i < names.size(); ++i) {
      h.mesh.names.push_back(GetString(names[i], path, "layout.mesh.names[" + std::to_string(i) + "]"));
    }
    for (size_t i = 0; i < shape.size(); ++i) {
      const uint64_t v = GetU64(shape[i], path, "layout.mesh.shape[" + std::to_string(i) + "]");
      if (v == 0 || v > (1u << 20)) {
        FailField(path, "layout.mesh.shape[" + std::to_string(i) + "]", std::to_string(v), "1 to 2^20");
      }
      h.mesh.shape.push_back(static_cast<uint32_t>(v));
    }
    try {
      h.mesh.Check("layout.mesh");
    } catch (const Error& e) {
      Fail(ErrorCode::kDataLoss, path + ": " + e.what());
    }
    if (h.mesh.Size() != ws) {
      FailField(path, "layout.mesh", "a mesh of " + std::to_string(h.mesh.Size()) + " ranks",
                "world_size " + std::to_string(ws) + " ranks");
    }
    const json& plan = internal::GetObject(Member(layout, "plan", path, "layout"), path, "layout.plan");
    h.plan_name = GetString(Member(plan, "name", path, "layout.plan"), path, "layout.plan.name");
    h.plan_xxh3 = GetHex16(Member(plan, "xxh3", path, "layout.plan"), path, "layout.plan.xxh3");
  }
  uint64_t rank = GetU64(Member(j, "rank", path, "header"), path, "rank");
  if (rank >= ws) {
    FailField(path, "rank", std::to_string(rank), "less than world_size " + std::to_string(ws));
  }
  h.rank = static_cast<uint32_t>(rank);
  if (h.kind == LayoutKind::kDTensor) {
    const json& c = GetArray(Member(j, "coordinate", path, "header"), path, "coordinate");
    std::vector<uint64_t> coord;
    for (size_t i = 0; i < c.size(); ++i) coord.push_back(GetU64(c[i], path, "coordinate[" + std::to_string(i) + "]"));
    const std::vector<uint32_t> want = h.mesh.Coordinate(h.rank);
    if (coord != std::vector<uint64_t>(want.begin(), want.end())) {
      FailField(path, "coordinate", Describe(c),
                ShapeText(std::vector<uint64_t>(want.begin(), want.end())) + " (rank " +
                    std::to_string(h.rank) + " of the mesh, row-major)");
    }
  }

  h.source = internal::SourceFromJson(Member(j, "source", path, "header"), path);

  h.chunk_size = GetU64(Member(j, "chunk_size", path, "header"), path, "chunk_size");
  if (h.chunk_size == 0 || h.chunk_size % kDataAlignment != 0 || h.chunk_size > kMaxChunkSize) {
    FailField(path, "chunk_size", std::to_string(h.chunk_size),
              "a positive multiple of 4096 up to 16 GiB");
  }

  const json& tensors = GetArray(Member(j, "tensors", path, "header"), path, "tensors");
  std::set<std::string> names;
  uint64_t previous_end = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& e = tensors[i];
    std::string f = "tensors[" + std::to_string(i) + "]";
    TensorEntry t;
    t.name = GetString(Member(e, "name", path, f), path, f + ".name");
    f = "tensor \"" + Printable(t.name) + "\"";
    if (!names.insert(t.name).second) FailField(path, f, "a second entry", "unique names");
    std::string dtype = GetString(Member(e, "dtype", path, f), path, f + ".dtype");
    auto parsed = ParseDType(dtype);
    if (!parsed) FailField(path, f + ".dtype", "\"" + dtype + "\"", "a safetensors dtype name");
    t.dtype = *parsed;
    t.global_shape = GetShape(Member(e, "global_shape", path, f), path, f + ".global_shape");
    t.local_shape = GetShape(Member(e, "local_shape", path, f), path, f + ".local_shape");
    const json& shard = Member(e, "shard", path, f);
    std::vector<uint64_t> expected_local = t.global_shape;
    const bool is_flat = e.contains("flat");
    if (is_flat && h.kind != LayoutKind::kFsdp1) {
      FailField(path, f + ".flat", "a flat parameter", "none in a " + h.Layout().KindName() + " layout");
    }
    if (h.kind == LayoutKind::kDTensor) {
      if (!shard.is_null()) FailField(path, f + ".shard", Describe(shard), "null in a dtensor layout");
      t.dtensor = ParseDTensorEntry(e, t, h, path, f);
      expected_local = t.local_shape;  // checked against the placements there
    } else if (shard.is_null()) {
      t.sharded = false;
      // Stored whole on every rank: FSDP1's buffers, FSDP2's 0-dim tensors and persistent
      // buffers (FSDP2 does not shard buffers); never a flat parameter.
      if (is_flat) {
        FailField(path, f + ".shard", "null for a flat parameter", "a shard");
      }
    } else {
      t.sharded = true;
      uint64_t dim = GetU64(Member(shard, "dim", path, f + ".shard"), path, f + ".shard.dim");
      if (dim != 0) FailField(path, f + ".shard.dim", std::to_string(dim), "0");
      t.rows.start = GetU64(Member(shard, "start", path, f + ".shard"), path, f + ".shard.start");
      t.rows.end = GetU64(Member(shard, "end", path, f + ".shard"), path, f + ".shard.end");
      if (t.global_shape.empty() || t.rows.start > t.rows.end ||
          t.rows.end > t.global_shape[0]) {
        FailField(path, f + ".shard",
                  "rows [" + std::to_string(t.rows.start) + ", " + std::to_string(t.rows.end) +
                      ") of shape " + ShapeText(t.global_shape),
                  "0 <= start <= end <= global_shape[0]");
      }
      // FSDP2 rows of dim 0 and FSDP1 elements of the flat parameter follow one chunk rule.
      const RowRange rule = ChunkRows(t.global_shape[0], h.world_size, h.rank);
      if (h.kind == LayoutKind::kFsdp1) {
        if (!is_flat) FailField(path, f + ".flat", "none", "the flat parameter's layout");
        t.flat = ParseFlat(e["flat"], t, h, path, f);
      }
      if (rule != t.rows) {
        FailField(path, f + ".shard",
                  "rows [" + std::to_string(t.rows.start) + ", " + std::to_string(t.rows.end) + ")",
                  "rows [" + std::to_string(rule.start) + ", " + std::to_string(rule.end) +
                      ") by the FSDP2 chunk rule for rank " + std::to_string(h.rank) + " of " +
                      std::to_string(h.world_size));
      }
      expected_local[0] = t.flat ? CeilDiv(t.global_shape[0], h.world_size) : t.rows.size();
    }
    if (t.local_shape != expected_local) {
      FailField(path, f + ".local_shape", ShapeText(t.local_shape), ShapeText(expected_local));
    }
    uint64_t numel = 1;
    for (uint64_t d : t.local_shape) numel = CheckedMul(numel, d, path + ": " + f + " numel");
    t.nbytes = GetU64(Member(e, "nbytes", path, f), path, f + ".nbytes");
    auto expected_bytes = BytesFor(t.dtype, numel);
    if (!expected_bytes || *expected_bytes != t.nbytes) {
      FailField(path, f + ".nbytes", std::to_string(t.nbytes),
                expected_bytes ? std::to_string(*expected_bytes) : std::string("whole bytes"));
    }
    t.offset = GetU64(Member(e, "offset", path, f), path, f + ".offset");
    t.stored_size = GetU64(Member(e, "stored_size", path, f), path, f + ".stored_size");
    std::string codec = GetString(Member(e, "codec", path, f), path, f + ".codec");
    if (codec == "raw") {
      t.codec = Codec::kRaw;
    } else if (codec == "zstd") {
      t.codec = Codec::kZstd;
    } else {
      FailField(path, f + ".codec", "\"" + codec + "\"", "\"raw\" or \"zstd\"");
    }
    if (t.offset < previous_end) {
      FailField(path, f + ".offset", std::to_string(t.offset),
                "at least " + std::to_string(previous_end) +
                    " (tensors sorted by offset, not overlapping)");
    }
    if (t.codec == Codec::kRaw && t.offset % kDataAlignment != 0) {
      FailField(path, f + ".offset", std::to_string(t.offset), "a multiple of 4096");
    }
    const uint64_t end = CheckedAdd(t.offset, t.stored_size, path + ": " + f + " end");
    if (end > data_size) {
      FailField(path, f + ".offset",
                "[" + std::to_string(t.offset) + ", " + std::to_string(end) + ")",
                "inside the data region of " + std::to_string(data_size) + " bytes");
    }
    previous_end = end;
    // Parsed whole (ParseStrictJson's hex_array_key) when every entry is hex16; else one by
    // one, which names the first bad entry.
    const json& chunks = Member(e, "chunk_xxh3", path, f);
    const uint64_t n_chunks = t.ChunkCount(h.chunk_size);
    if (auto values = internal::HexArrayValues(chunks)) {
      t.chunk_xxh3 = std::move(*values);
    } else {
      GetArray(chunks, path, f + ".chunk_xxh3");
      t.chunk_xxh3.reserve(chunks.size());
      for (size_t c = 0; c < chunks.size(); ++c) {
        t.chunk_xxh3.push_back(GetHex16(chunks[c], path, f + ".chunk_xxh3[" + std::to_string(c) + "]"));
      }
    }
    if (t.chunk_xxh3.size() != n_chunks) {
      FailField(path, f + ".chunk_xxh3", std::to_string(t.chunk_xxh3.size()) + " entries",
                std::to_string(n_chunks) + " (ceil(nbytes / chunk_size))");
    }
    if (t.codec == Codec::kRaw) {
      if (t.stored_size != t.nbytes) {
        FailField(path, f + ".stored_size", std::to_string(t.stored_size),
                  std::to_string(t.nbytes) + " (= nbytes for raw)");
      }
      if (e.contains("frames")) FailField(path, f + ".frames", "frames", "none for raw");
    } else {
      const json& frames = GetArray(Member(e, "frames", path, f), path, f + ".frames");
      if (frames.size() != n_chunks) {
        FailField(path, f + ".frames", std::to_string(frames.size()) + " entries",
                  std::to_string(n_chunks) + " (one per chunk)");
      }
      uint64_t frame_end = 0;
      for (size_t c = 0; c < frames.size(); ++c) {
        const std::string ff = f + ".frames[" + std::to_string(c) + "]";
        const json& fr = GetArray(frames[c], path, ff);
        if (fr.size() != 2) FailField(path, ff, Describe(fr), "[offset, size]");
        Frame frame{GetU64(fr[0], path, ff + "[0]"), GetU64(fr[1], path, ff + "[1]")};
        const uint64_t fe = CheckedAdd(frame.offset, frame.size, path + ": " + ff);
        if (frame.offset < frame_end || fe > t.stored_size || frame.size == 0) {
          FailField(path, ff, "[" + std::to_string(frame.offset) + ", " +
                                  std::to_string(frame.size) + "]",
                    "a non-empty frame inside stored_size " + std::to_string(t.stored_size) +
                        ", after the previous frame");
        }
        frame_end = fe;
        t.frames.push_back(frame);
      }
    }
    t.xxh3 = GetHex16(Member(e, "xxh3", path, f), path, f + ".xxh3");
    const uint64_t combined = CombineChunkChecksums(t.chunk_xxh3);
    if (combined != t.xxh3) {
      FailField(path, f + ".xxh3", Hex16(t.xxh3),
                Hex16(combined) + " (the checksum of chunk_xxh3)");
    }
    h.tensors.push_back(std::move(t));
  }
  return h;
}

}  // namespace reshard
