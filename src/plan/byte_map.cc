#include "reshard/plan/byte_map.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"
#include "reshard/plan/fsdp1.h"

namespace reshard {

namespace {

uint64_t Numel(const std::vector<uint64_t>& shape, const std::string& what) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

// A segment of the kinds MapEntry makes (no dequantization).
EntrySegment Segment(EntrySegment::Kind kind, uint64_t element, uint64_t count, std::string source,
                     std::vector<uint64_t> shape, uint64_t source_element) {
  EntrySegment s;
  s.kind = kind;
  s.element = element;
  s.count = count;
  s.source = std::move(source);
  s.source_shape = std::move(shape);
  s.source_element = source_element;
  return s;
}

// Bit position of element `e` as a byte offset; kDataLoss when it falls inside a byte.
uint64_t ByteOf(uint64_t e, uint32_t bits, const std::string& what) {
  const uint64_t b = CheckedMul(e, bits, what);
  if (b % 8 != 0) {
    Fail(ErrorCode::kDataLoss, what + ": element " + std::to_string(e) + " does not start a byte");
  }
  return b / 8;
}

// FSDP1: the rank's part [r·c, (r+1)·c) of the flat parameter.
void MapFlat(const TensorEntry& e, uint32_t world_size, uint32_t rank, const std::string& what,
             EntryMap& m) {
  const FlatInfo& flat = *e.flat;
  const uint64_t c = CeilDiv(flat.numel, world_size);
  if (m.numel != c) {
    Fail(ErrorCode::kDataLoss, what + ": a flat shard of " + std::to_string(m.numel) +
                                   " elements, expected ceil(" + std::to_string(flat.numel) + " / " +
                                   std::to_string(world_size) + ") = " + std::to_string(c));
  }
  const uint64_t lo = CheckedMul(rank, c, what);
  const uint64_t hi = lo + c;
  uint64_t at = lo;  // next flat element to cover
  auto pad = [&](uint64_t until) {
    if (until <= at) return;
    const uint64_t end_pad = std::clamp(flat.numel, at, until);  // 42 inside, zeros past numel
    if (end_pad > at) {
      m.segments.push_back(Segment(EntrySegment::Kind::kPadding, at - lo, end_pad - at, "", {}, 0));
    }
    if (until > end_pad) {
      m.segments.push_back(Segment(EntrySegment::Kind::kZero, end_pad - lo, until - end_pad, "", {}, 0));
    }
    at = until;
  };
  for (const FlatParamInfo& p : flat.params) {
    const uint64_t a = std::max(lo, p.offset);
    const uint64_t b = std::min(hi, CheckedAdd(p.offset, p.numel, what));
    if (a >= b) continue;
    if (a < at) {
      Fail(ErrorCode::kDataLoss, what + ": parameter " + p.fqn + " overlaps the one before it");
    }
    pad(a);
    if (p.key.empty()) {  // a parameter the model computes at load: zeros, named for messages
      m.segments.push_back(Segment(EntrySegment::Kind::kZero, a - lo, b - a, p.fqn, {}, 0));
    } else {
      m.segments.push_back(Segment(EntrySegment::Kind::kSource, a - lo, b - a, p.key, p.shape, a - p.offset));
    }
    at = b;
  }
  pad(hi);
}

// Fills `n` elements of `dst` (entry dtype `to`) with the F8_E4M3 weight's elements
// [g0, g0 + n) dequantized: float32(weight) × float32(scale of its block), rounded once to
// `to` (the arithmetic of transformers' Fp8Dequantize._dequantize_one). Reads the weight's n
// bytes and only the scale rows those elements use. Returns the source bytes read.
uint64_t FillDequantFp8(const EntrySegment& s, const SourceTensor& w, const SourceTensor& sc,
                        const SourceRead& read, uint64_t g0, uint64_t n, DType to, char* dst,
                        std::vector<char>& scratch) {
  if (n == 0) return 0;
  const size_t r = s.source_shape.size();
  const uint64_t rows = s.source_shape[r - 2], cols = s.source_shape[r - 1];
  const uint64_t srows = s.scale_shape[r - 2], scols = s.scale_shape[r - 1];
  // Flat row f = l·rows + i (l: the leading index) has scale row l·srows + i / block_rows.
  auto scale_row = [&](uint64_t f) { return (f / rows) * srows + (f % rows) / s.block_rows; };
  const uint64_t first = scale_row(g0 / cols), last = scale_row((g0 + n - 1) / cols);
  const uint64_t nscale = (last - first + 1) * scols;
  scratch.resize(n + nscale * 4 + n * 4);
  uint8_t* q = reinterpret_cast<uint8_t*>(scratch.data());
  char* scale_bytes = scratch.data() + n;
  char* product = scale_bytes + nscale * 4;
  read(w.file_index, w.offset + g0, n, q);
  read(sc.file_index, sc.offset + first * scols * 4, nscale * 4, scale_bytes);
  for (uint64_t k = 0; k < n; ++k) {
    const uint64_t g = g0 + k;
    const uint64_t at = (scale_row(g / cols) - first) * scols + (g % cols) / s.block_cols;
    float scale, value, out;
    std::memcpy(&scale, scale_bytes + at * 4, 4);
    const uint32_t bits = F8E4M3BitsToF32(q[k]);
    std::memcpy(&value, &bits, 4);
    out = value * scale;  // one float32 multiply: torch's (q * s) in float32
    std::memcpy(product + k * 4, &out, 4);
  }
  ConvertElements(DType::kF32, to, product, dst, n);
  return n + nscale * 4;
}

// FP4 e2m1 values by code (bit 3: sign), as transformers' FP4_VALUES.
constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Fills `n` elements of `dst` (entry dtype `to`) with the elements [o0, o0 + n) of the MXFP4
// experts tensor dequantized as transformers' Mxfp4Dequantize does: the result [E, G·32, N] is
// the transpose of [E, N, G·32], whose element (e, r, 32·g + j) is FP4 code j of block
// (e, r, g) (byte j / 2, low nibble for even j) as a bfloat16 value, times 2^(scale - 127)
// computed in float32 (torch.ldexp: bf16 × float32 power of two), rounded once to bfloat16;
// then converted to `to` (a load into a float32 model widens it exactly). Per expert it reads
// the byte range of the blocks and scales from row 0's first block to row N-1's last that the
// elements need (the transpose makes every row contribute to each output row). Returns the
// source bytes read.
uint64_t FillDequantMxfp4(const EntrySegment& s, const SourceTensor& blocks, const SourceTensor& scales,
                          const SourceRead& read, uint64_t o0, uint64_t n, DType to, char* dst,
                          std::vector<char>& scratch) {
  if (n == 0) return 0;
  const uint64_t N = s.source_shape[1], G = s.source_shape[2];
  const uint64_t K = G * 32, per_expert = K * N;
  uint64_t read_bytes = 0;
  uint64_t done = 0;
  while (done < n) {
    const uint64_t o = o0 + done;
    const uint64_t e = o / per_expert, base = e * per_expert;
    const uint64_t m = std::min(n - done, base + per_expert - o);  // elements of this expert
    const uint64_t g_lo = ((o - base) / N) / 32, g_hi = ((o + m - 1 - base) / N) / 32;
    const uint64_t first = e * N * G + g_lo;               // (e, 0, g_lo), in blocks
    const uint64_t last = e * N * G + (N - 1) * G + g_hi;  // (e, N-1, g_hi)
    const uint64_t nblocks = last - first + 1;
    scratch.resize(nblocks * 16 + nblocks + m * 4);
    uint8_t* q = reinterpret_cast<uint8_t*>(scratch.data());
    uint8_t* sc = q + nblocks * 16;
    char* product = reinterpret_cast<char*>(sc + nblocks);
    read(blocks.file_index, blocks.offset + first * 16, nblocks * 16, q);
    read(scales.file_index, scales.offset + first, nblocks, sc);
    read_bytes += nblocks * 17;
    for (uint64_t i = 0; i < m; ++i) {
      const uint64_t rel = o + i - base;
      const uint64_t k = rel / N, r = rel % N;
      const uint64_t g = k / 32, j = k % 32;
      const uint64_t b = e * N * G + r * G + g - first;  // the block, relative to `first`
      const uint8_t byte = q[b * 16 + j / 2];
      const uint8_t code = (j & 1) ? byte >> 4 : byte & 0x0F;
      const float out = kFp4Values[code] * std::ldexp(1.0f, static_cast<int>(sc[b]) - 127);
      std::memcpy(product + i * 4, &out, 4);
    }
    ConvertElements(DType::kF32, DType::kBF16, product, dst + done * 2, m);  // transformers' bf16
    done += m;
  }
  if (to != DType::kBF16) {
    std::vector<char> widened(n * Info(to).bits / 8);
    ConvertElements(DType::kBF16, to, dst, widened.data(), n);
    std::memcpy(dst, widened.data(), widened.size());
  }
  return read_bytes;
}

// DTensor entries: the local tensor of the entry's mesh coordinate (rank, row-major).
void MapDTensor(const TensorEntry& e, uint32_t world_size, uint32_t rank, const std::string& what,
                EntryMap& m) {
  const DTensorSharding& s = *e.dtensor;
  MeshSpec mesh;
  mesh.shape = s.mesh_shape;
  if (s.mesh_shape.empty() || mesh.Size() != world_size) {
    Fail(ErrorCode::kDataLoss, what + ": a mesh of " + std::to_string(mesh.Size()) +
                                   " ranks in a layout of world size " + std::to_string(world_size));
  }
  std::vector<IndexRuns> dims;
  try {
    dims = DTensorLocalIndices(e.global_shape, s, s.mesh_shape, mesh.Coordinate(rank), what);
  } catch (const Error& err) {
    Fail(ErrorCode::kDataLoss, err.what());
  }
  std::vector<uint64_t> want(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) want[d] = CountOf(dims[d]);
  if (want != e.local_shape) {
    Fail(ErrorCode::kDataLoss, what + ": local_shape does not match its placements on the mesh");
  }
  if (Info(e.dtype).bits % 8 != 0) {
    Fail(ErrorCode::kUnsupported, what + ": " + std::string(Name(e.dtype)) +
                                      " elements are not whole bytes; DTensor layouts need them");
  }
  DTensorSegments(e.name, e.global_shape, dims, 0, m.segments);
}

// Fills `n` elements (entry dtype `to`) from element `e0` of kStrided segment `s`, reading
// the source in spans: a span grows over the next run while it stays ≤ kStridedSpan bytes and
// holds at least a quarter wanted bytes, so that a fill reads at most 4× (plus one run) what
// it needs and few, large requests when the runs are dense. Returns the source bytes read.
constexpr uint64_t kStridedSpan = 8ull << 20;
uint64_t FillStrided(const EntrySegment& s, const SourceTensor& t, const SourceRead& read,
                     uint64_t e0, uint64_t n, DType to, char* dst, std::vector<char>& scratch) {
  const uint64_t in_item = Info(t.dtype).bits / 8, out_item = Info(to).bits / 8;
  const uint64_t row = s.RowElements();
  struct Piece {
    uint64_t src, len, at;  // source element, elements, position in dst (elements)
  };
  std::vector<Piece> batch;
  uint64_t useful = 0, read_bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    const uint64_t lo = batch.front().src, hi = batch.back().src + batch.back().len;
    if (batch.size() == 1 && t.dtype == to) {
      read(t.file_index, t.offset + lo * in_item, (hi - lo) * in_item, dst + batch[0].at * out_item);
    } else {
      scratch.resize((hi - lo) * in_item);
      read(t.file_index, t.offset + lo * in_item, scratch.size(), scratch.data());
      for (const Piece& p : batch) {
        const char* from = scratch.data() + (p.src - lo) * in_item;
        if (t.dtype == to) {
          std::memcpy(dst + p.at * out_item, from, p.len * in_item);
        } else {
          ConvertElements(t.dtype, to, from, dst + p.at * out_item, p.len);
        }
      }
    }
    read_bytes += (hi - lo) * in_item;
    batch.clear();
    useful = 0;
  };
  uint64_t k = e0 / row, off = e0 % row;
  size_t j = 0;
  while (off >= s.runs[j].length) off -= s.runs[j++].length;
  for (uint64_t done = 0; done < n;) {
    const uint64_t src = s.source_element + k * s.stride + s.runs[j].start + off;
    const uint64_t len = std::min(s.runs[j].length - off, n - done);
    if (!batch.empty()) {
      const uint64_t lo = batch.front().src, end = batch.back().src + batch.back().len;
      const uint64_t total = src + len - lo;
      if (src < end || total * in_item > kStridedSpan || total > 4 * (useful + len)) flush();
    }
    batch.push_back({src, len, done});
    useful += len;
    done += len;
    off = 0;
    if (++j == s.runs.size()) j = 0, ++k;
  }
  flush();
  return read_bytes;
}

}  // namespace

uint64_t EntrySegment::RowElements() const {
  uint64_t n = 0;
  for (const IndexRun& r : runs) n += r.length;
  return n;
}

uint64_t EntrySegment::SourceElementAt(uint64_t i) const {
  if (kind != Kind::kStrided) return source_element + i;
  const uint64_t row = RowElements();
  uint64_t off = i % row;
  size_t j = 0;
  while (off >= runs[j].length) off -= runs[j++].length;
  return source_element + (i / row) * stride + runs[j].start + off;
}

uint64_t DTensorSegments(const std::string& source, const std::vector<uint64_t>& shape,
                         const std::vector<IndexRuns>& dims, uint64_t element,
                         std::vector<EntrySegment>& out) {
  struct Dim {
    uint64_t n;
    IndexRuns runs;
  };
  std::vector<Dim> f;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].empty()) return 0;  // an empty local tensor
    f.push_back({shape[d], dims[d]});
  }
  if (f.empty()) f.push_back({1, {{0, 1}}});  // a 0-dim tensor: its one element
  // Fold each whole dim (but the first) into the one before it: [R, C] Shard(0) becomes one
  // dim of R·C elements cut into one run.
  for (size_t d = f.size(); d-- > 1;) {
    const bool whole = f[d].runs.size() == 1 && f[d].runs[0].start == 0 && f[d].runs[0].length == f[d].n;
    if (!whole) continue;
    for (IndexRun& r : f[d - 1].runs) r = {r.start * f[d].n, r.length * f[d].n};
    f[d - 1].n *= f[d].n;
    f.erase(f.begin() + d);
  }
  uint64_t at = element;
  auto segment = [&](EntrySegment::Kind kind, uint64_t count, uint64_t first) {
    EntrySegment s;
    s.kind = kind;
    s.element = at;
    s.count = count;
    s.source = source;
    s.source_shape = shape;
    s.source_element = first;
    at += count;
    out.push_back(std::move(s));
    return &out.back();
  };
  if (f.size() == 1) {
    for (const IndexRun& r : f[0].runs) segment(EntrySegment::Kind::kSource, r.length, r.start);
    return at - element;
  }
  const size_t p = f.size() - 1, q = p - 1;  // the last (cut) dim and the rows' dim
  const uint64_t row = CountOf(f[p].runs);
  // Every index of the dims before q, in row-major order (an odometer over their runs).
  std::vector<size_t> run(q, 0);
  std::vector<uint64_t> off(q, 0);
  while (true) {
    uint64_t base = 0;  // flat index of (outer indices, 0, 0) in units of f[q].n · f[p].n
    for (size_t d = 0; d < q; ++d) base = base * f[d].n + f[d].runs[run[d]].start + off[d];
    for (const IndexRun& r : f[q].runs) {
      EntrySegment* s = segment(EntrySegment::Kind::kStrided, r.length * row,
                                ((base * f[q].n) + r.start) * f[p].n);
      s->stride = f[p].n;
      s->runs = f[p].runs;
    }
    bool more = false;
    for (size_t d = q; d-- > 0 && !more;) {
      if (++off[d] < f[d].runs[run[d]].length) {
        more = true;
      } else if (off[d] = 0; ++run[d] < f[d].runs.size()) {
        more = true;
      } else {
        run[d] = 0;
      }
    }
    if (!more) break;
  }
  return at - element;
}

EntryMap MapEntry(const TensorEntry& e, LayoutKind kind, uint32_t world_size, uint32_t rank,
                  const std::string& path) {
  const std::string what = path + ": tensor \"" + e.name + "\"";
  EntryMap m;
  m.name = e.name;
  m.dtype = e.dtype;
  m.numel = Numel(e.local_shape, what + " local_shape");
  m.nbytes = e.nbytes;
  const uint32_t bits = Info(e.dtype).bits;
  if (CheckedMul(m.numel, bits, what) != CheckedMul(e.nbytes, 8, what)) {
    Fail(ErrorCode::kDataLoss, what + ": " + std::to_string(e.nbytes) + " bytes for " +
                                   std::to_string(m.numel) + " elements of " +
                                   std::string(Name(e.dtype)));
  }
  if (e.dtensor) {
    MapDTensor(e, world_size, rank, what, m);
  } else if (kind == LayoutKind::kFsdp1 && e.flat) {
    MapFlat(e, world_size, rank, what, m);
  } else if (!e.sharded) {
    if (e.local_shape != e.global_shape) {
      Fail(ErrorCode::kDataLoss, what + ": stored whole, but its local shape is not its global shape");
    }
    if (m.numel) m.segments.push_back(Segment(EntrySegment::Kind::kSource, 0, m.numel, e.name, e.global_shape, 0));
  } else {
    // Rows [start, end) of dim 0 (formats/rank-file.md, FSDP2 shard rule).
    const uint64_t rows = e.global_shape.empty() ? 0 : e.global_shape[0];
    if (e.global_shape.empty() || e.rows.end > rows || e.rows.start > e.rows.end) {
      Fail(ErrorCode::kDataLoss, what + ": rows [" + std::to_string(e.rows.start) + ", " +
                                     std::to_string(e.rows.end) + ") are not rows of its global shape");
    }
    const uint64_t row_numel = rows ? Numel(e.global_shape, what) / rows : 0;
    if (m.numel != CheckedMul(e.rows.size(), row_numel, what)) {
      Fail(ErrorCode::kDataLoss, what + ": " + std::to_string(m.numel) + " elements for " +
                                     std::to_string(e.rows.size()) + " rows of " +
                                     std::to_string(row_numel));
    }
    if (m.numel) {
      m.segments.push_back(Segment(EntrySegment::Kind::kSource, 0, m.numel, e.name, e.global_shape,
                            CheckedMul(e.rows.start, row_numel, what)));
    }
  }
  for (const EntrySegment& s : m.segments) {
    ByteOf(s.element, bits, what);
    if (s.kind == EntrySegment::Kind::kSource) ByteOf(s.source_element, bits, what + " source " + s.source);
  }
  return m;
}

std::string CheckSources(const EntryMap& map, const SourceLookup& find) {
  for (const EntrySegment& s : map.segments) {
    if (s.kind == EntrySegment::Kind::kDequantFp8) {
      const SourceTensor* w = find(s.source);
      const SourceTensor* sc = find(s.scale);
      if (!w) return "FP8 weight " + s.source + " is not in the source";
      if (!sc) return "scale " + s.scale + " of FP8 weight " + s.source + " is not in the source";
      if (w->dtype != DType::kF8_E4M3 || w->shape != s.source_shape || s.source_shape.size() < 2) {
        return "FP8 weight " + s.source + " is " + std::string(Name(w->dtype)) +
               ", not F8_E4M3 of the captured shape";
      }
      if (sc->dtype != DType::kF32 || sc->shape != s.scale_shape ||
          s.scale_shape.size() != s.source_shape.size() || !s.block_rows || !s.block_cols) {
        return "scale " + s.scale + " is " + std::string(Name(sc->dtype)) +
               ", not F32 of the captured shape";
      }
      if (!IsConvertibleFloat(map.dtype)) {
        return "FP8 weight " + s.source + " is dequantized, but the entry is " +
               std::string(Name(map.dtype));
      }
      continue;
    }
    if (s.kind == EntrySegment::Kind::kDequantMxfp4) {
      const SourceTensor* b = find(s.source);
      const SourceTensor* sc = find(s.scale);
      if (!b) return "MXFP4 blocks " + s.source + " are not in the source";
      if (!sc) return "scales " + s.scale + " of MXFP4 blocks " + s.source + " are not in the source";
      if (b->dtype != DType::kU8 || b->shape != s.source_shape || s.source_shape.size() != 4 ||
          s.source_shape[3] != 16) {
        return "MXFP4 blocks " + s.source + " are " + std::string(Name(b->dtype)) + ", not U8 of the captured shape";
      }
      if (sc->dtype != DType::kU8 || sc->shape != s.scale_shape ||
          !std::equal(s.scale_shape.begin(), s.scale_shape.end(), s.source_shape.begin()) ||
          s.scale_shape.size() != 3) {
        return "scales " + s.scale + " are " + std::string(Name(sc->dtype)) + ", not U8 of the captured shape";
      }
      if (map.dtype != DType::kBF16 && map.dtype != DType::kF32 && map.dtype != DType::kF64) {
        return "MXFP4 blocks " + s.source + " are dequantized to BF16, but the entry is " +
               std::string(Name(map.dtype)) + ", which would round them again";
      }
      continue;
    }
    if (!s.IsSourced()) continue;
    const SourceTensor* t = find(s.source);
    if (!t) return "source tensor " + s.source + " is not in the source";
    if (t->shape != s.source_shape) return "source tensor " + s.source + " has another shape";
    if (t->dtype != map.dtype && !(IsConvertibleFloat(t->dtype) && IsConvertibleFloat(map.dtype))) {
      return "source tensor " + s.source + " is " + std::string(Name(t->dtype)) + ", the entry " +
             std::string(Name(map.dtype));
    }
  }
  return "";
}

uint64_t FillEntry(const EntryMap& map, const SourceLookup& find, const SourceRead& read,
                   uint64_t begin, uint64_t length, char* out, std::vector<char>& scratch) {
  const uint32_t bits = Info(map.dtype).bits;
  const uint64_t end = begin + length;
  uint64_t read_bytes = 0;
  for (const EntrySegment& s : map.segments) {
    const uint64_t s0 = s.element * bits / 8;
    const uint64_t s1 = (s.element + s.count) * bits / 8;
    const uint64_t a = std::max(begin, s0), b = std::min(end, s1);
    if (a >= b) continue;
    char* dst = out + (a - begin);
    if (s.kind == EntrySegment::Kind::kZero) {
      std::memset(dst, 0, b - a);
      continue;
    }
    const uint64_t item = bits / 8;  // padding and conversions: byte-sized elements
    if (s.kind == EntrySegment::Kind::kPadding) {
      const uint64_t pad = FlatPaddingBits(map.dtype);
      for (uint64_t at = 0; at < b - a; at += item) std::memcpy(dst + at, &pad, item);
      continue;
    }
    const SourceTensor* t = find(s.source);
    if (!t) Fail(ErrorCode::kMismatch, "source tensor " + s.source + " is not in the source");
    if (s.kind == EntrySegment::Kind::kDequantFp8) {
      const SourceTensor* sc = find(s.scale);
      if (!sc) Fail(ErrorCode::kMismatch, "scale " + s.scale + " is not in the source");
      read_bytes += FillDequantFp8(s, *t, *sc, read, s.source_element + (a - s0) / item,
                                   (b - a) / item, map.dtype, dst, scratch);
      continue;
    }
    if (s.kind == EntrySegment::Kind::kDequantMxfp4) {
      const SourceTensor* sc = find(s.scale);
      if (!sc) Fail(ErrorCode::kMismatch, "scales " + s.scale + " are not in the source");
      read_bytes += FillDequantMxfp4(s, *t, *sc, read, s.source_element + (a - s0) / item,
                                     (b - a) / item, map.dtype, dst, scratch);
      continue;
    }
    if (s.kind == EntrySegment::Kind::kStrided) {
      const uint64_t first = (a - s0) / item, last = CeilDiv(b - s0, item);  // whole elements
      if (first * item == a - s0 && last * item == b - s0) {
        read_bytes += FillStrided(s, *t, read, first, last - first, map.dtype, dst, scratch);
      } else {  // a range that cuts elements (a byte range of a chunk): through a copy
        std::vector<char> whole((last - first) * item);
        read_bytes += FillStrided(s, *t, read, first, last - first, map.dtype, whole.data(), scratch);
        std::memcpy(dst, whole.data() + (a - s0 - first * item), b - a);
      }
      continue;
    }
    const uint64_t src0 = s.source_element * Info(t->dtype).bits / 8;  // the segment's start
    if (t->dtype == map.dtype) {
      read(t->file_index, t->offset + src0 + (a - s0), b - a, dst);
      read_bytes += b - a;
    } else {
      const uint64_t in_item = Info(t->dtype).bits / 8;
      const uint64_t first = (a - s0) / item, n = (b - a) / item;  // whole elements (chunking)
      scratch.resize(n * in_item);
      read(t->file_index, t->offset + src0 + first * in_item, scratch.size(), scratch.data());
      ConvertElements(t->dtype, map.dtype, scratch.data(), dst, n);
      read_bytes += scratch.size();
    }
  }
  return read_bytes;
}

std::pair<size_t, uint64_t> FirstSourceByte(const EntryMap& map, const SourceLookup& find,
                                            uint64_t begin) {
  const uint32_t bits = Info(map.dtype).bits;
  for (const EntrySegment& s : map.segments) {
    if (!s.IsSourced() && s.kind != EntrySegment::Kind::kDequantFp8 &&
        s.kind != EntrySegment::Kind::kDequantMxfp4) {
      continue;
    }
    const uint64_t s0 = s.element * bits / 8, s1 = (s.element + s.count) * bits / 8;
    if (s1 <= begin) continue;
    const SourceTensor* t = find(s.source);
    if (!t) return {0, 0};
    if (s.kind == EntrySegment::Kind::kDequantMxfp4) {  // the expert's first block
      const uint64_t per_expert = s.source_shape[1] * s.source_shape[2] * 32;
      const uint64_t skip = begin > s0 ? (begin - s0) * 8 / bits : 0;
      const uint64_t e = (s.source_element + skip) / per_expert;
      return {t->file_index, t->offset + e * s.source_shape[1] * s.source_shape[2] * 16};
    }
    const uint64_t skip = begin > s0 ? (begin - s0) * 8 / bits : 0;  // elements before begin
    return {t->file_index, t->offset + s.SourceElementAt(skip) * Info(t->dtype).bits / 8};
  }
  return {0, 0};
}

std::string DescribeEntryByte(const EntryMap& map, uint64_t at) {
  const uint64_t e = at * 8 / Info(map.dtype).bits;
  for (const EntrySegment& s : map.segments) {
    if (e < s.element || e >= s.element + s.count) continue;
    switch (s.kind) {
      case EntrySegment::Kind::kZero:
        return s.source.empty() ? "zero padding past the flat parameter"
                                : "parameter " + s.source + ", which the model computes at load (zeros here)";
      case EntrySegment::Kind::kPadding: return "padding (42)";
      case EntrySegment::Kind::kSource:
      case EntrySegment::Kind::kStrided:
        return "element " + std::to_string(s.SourceElementAt(e - s.element)) + " of source tensor " +
               s.source;
      case EntrySegment::Kind::kDequantFp8:
        return "element " + std::to_string(s.source_element + (e - s.element)) +
               " of FP8 weight " + s.source + " dequantized with " + s.scale;
      case EntrySegment::Kind::kDequantMxfp4:
        return "element " + std::to_string(s.source_element + (e - s.element)) +
               " of the experts dequantized from MXFP4 blocks " + s.source + " with " + s.scale;
    }
  }
  return "byte " + std::to_string(at) + ", past the entry";
}

}  // namespace reshard
