#include "reshard/plan/conversion.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "reshard/base/dtype.h"
#include "reshard/base/error.h"
#include "reshard/format/shape.h"

namespace reshard {

namespace {

uint64_t Product(const std::vector<uint64_t>& s, size_t from, size_t to) {
  uint64_t n = 1;
  for (size_t i = from; i < to && i < s.size(); ++i) n *= s[i];
  return n;
}

void Keys(const ConversionExpr& x, std::vector<const ConversionExpr*>& out) {
  if (x.op == ConversionExpr::Op::kKey) {
    out.push_back(&x);
    return;
  }
  for (const auto& c : x.of) Keys(c, out);
}

void DequantNodes(const ConversionExpr& x, std::vector<const ConversionExpr*>& out) {
  if (x.op == ConversionExpr::Op::kDequantFp8 || x.op == ConversionExpr::Op::kDequantMxfp4) {
    out.push_back(&x);
    return;
  }
  for (const auto& c : x.of) DequantNodes(c, out);
}

void Push(std::vector<EntrySegment>& out, const std::string& key, const std::vector<uint64_t>& shape,
          uint64_t source_element, uint64_t count, uint64_t entry_element) {
  if (count == 0) return;
  if (!out.empty()) {
    EntrySegment& last = out.back();
    if (last.kind == EntrySegment::Kind::kSource && last.source == key &&
        last.element + last.count == entry_element &&
        last.source_element + last.count == source_element) {
      last.count += count;
      return;
    }
  }
  EntrySegment s;
  s.kind = EntrySegment::Kind::kSource;
  s.element = entry_element;
  s.count = count;
  s.source = key;
  s.source_shape = shape;
  s.source_element = source_element;
  out.push_back(std::move(s));
}

// The scale of FP8 weight `key` as transformers names it (Fp8Dequantize._scale_pattern_for).
std::string ScaleName(const std::string& key) {
  const std::string w = ".weight";
  if (key.size() >= w.size() && key.compare(key.size() - w.size(), w.size(), w) == 0) {
    return key.substr(0, key.size() - w.size()) + ".weight_scale_inv";
  }
  return key + "_scale_inv";
}

bool IsScaleName(const std::string& key) {
  const std::string s = "_scale_inv";
  return key.size() > s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
}

// Never a weight without its scale: every F8_E4M3 tensor is dequantized with its scale
// (policy dequantize) or kept beside it (keep), and every scale belongs to such a weight.
bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// MXFP4 (gpt-oss): every U8 `<proj>_blocks` is dequantized with its `<proj>_scales` (the only
// policy: the model transformers builds with MXFP4 kept holds Triton tensors, not parameters
// FSDP can shard), and every `_scales` tensor belongs to such blocks.
void CheckMxfp4Pairs(const Checkpoint& ckpt, const Conversion& conversion, const std::string& manifest_path) {
  const std::string where = ckpt.dir.string() + ": ";
  if (conversion.quantization->policy != Quantization::Policy::kDequantize) {
    Fail(ErrorCode::kUnsupported,
         manifest_path + ": MXFP4 with policy keep: transformers' MXFP4 model holds Triton-swizzled "
                         "tensors, not parameters FSDP can shard; capture with --quantized dequantize");
  }
  std::set<std::string> blocks, scales;
  for (const ConversionTarget& t : conversion.targets) {
    std::vector<const ConversionExpr*> d;
    DequantNodes(t.expr, d);
    for (const ConversionExpr* x : d) blocks.insert(x->of[0].key), scales.insert(x->of[1].key);
  }
  for (const SourceTensor& s : ckpt.tensors) {
    if (EndsWith(s.name, "_blocks") && s.dtype == DType::kU8 && !blocks.count(s.name)) {
      const std::string scale = s.name.substr(0, s.name.size() - 7) + "_scales";
      Fail(ErrorCode::kUnsupported,
           where + "MXFP4 blocks \"" + s.name + "\" are not dequantized by " + manifest_path +
               "'s conversion" +
               (ckpt.Find(scale) ? std::string() : ": the checkpoint has no scales \"" + scale + "\" for them") +
               "; a weight is never stored without its scale");
    }
    if (EndsWith(s.name, "_scales") && s.dtype == DType::kU8 && !scales.count(s.name)) {
      Fail(ErrorCode::kUnsupported, where + "MXFP4 scales \"" + s.name + "\" are not used by any blocks "
                                            "that " + manifest_path + "'s conversion dequantizes");
    }
  }
}

void CheckQuantizedPairs(const Checkpoint& ckpt, const Conversion& conversion,
                         const std::string& manifest_path) {
  const Quantization& q = *conversion.quantization;
  if (q.method == "mxfp4") return CheckMxfp4Pairs(ckpt, conversion, manifest_path);
  const bool keep = q.policy == Quantization::Policy::kKeep;
  std::set<std::string> weights, scales;  // dequantize: the pairs the targets use
  for (const ConversionTarget& t : conversion.targets) {
    std::vector<const ConversionExpr*> d;
    DequantNodes(t.expr, d);
    for (const ConversionExpr* x : d) weights.insert(x->of[0].key), scales.insert(x->of[1].key);
  }
  const std::string where = ckpt.dir.string() + ": ";
  for (const SourceTensor& s : ckpt.tensors) {
    if (s.dtype == DType::kF8_E4M3) {
      const std::string scale = ScaleName(s.name);
      if (!keep) {
        if (weights.count(s.name)) continue;
        Fail(ErrorCode::kUnsupported,
             where + "F8_E4M3 tensor \"" + s.name + "\" is not dequantized by " + manifest_path +
                 "'s conversion (policy dequantize)" +
                 (ckpt.Find(scale) ? std::string() : ": the checkpoint has no scale \"" + scale + "\" for it") +
                 "; a weight is never stored without its scale");
      }
      const SourceTensor* sc = ckpt.Find(scale);
      if (!sc) {
        Fail(ErrorCode::kUnsupported, where + "F8_E4M3 tensor \"" + s.name + "\" has no scale \"" +
                                          scale + "\"; a weight is never stored without its scale");
      }
      std::vector<uint64_t> want = s.shape;
      const size_t n = want.size();
      if (n >= 2 && q.weight_block_size.size() == 2 && q.weight_block_size[0] && q.weight_block_size[1]) {
        want[n - 2] = (want[n - 2] + q.weight_block_size[0] - 1) / q.weight_block_size[0];
        want[n - 1] = (want[n - 1] + q.weight_block_size[1] - 1) / q.weight_block_size[1];
      }
      if (sc->dtype != DType::kF32 || n < 2 || sc->shape != want) {
        Fail(ErrorCode::kUnsupported,
             where + "scale \"" + scale + "\" of F8_E4M3 \"" + s.name + "\" " + ShapeText(s.shape) +
                 " is " + std::string(Name(sc->dtype)) + " " + ShapeText(sc->shape) + ", expected F32 " +
                 ShapeText(want) + " (weight_block_size " + ShapeText(q.weight_block_size) + ")");
      }
    } else if (IsScaleName(s.name) && (keep ? false : !scales.count(s.name))) {
      Fail(ErrorCode::kUnsupported, where + "scale \"" + s.name + "\" is not used by any FP8 weight "
                                            "that " + manifest_path + "'s conversion dequantizes");
    }
  }
  if (keep) {
    std::set<std::string> paired;
    for (const SourceTensor& w : ckpt.tensors) {
      if (w.dtype == DType::kF8_E4M3) paired.insert(ScaleName(w.name));
    }
    for (const SourceTensor& s : ckpt.tensors) {
      if (IsScaleName(s.name) && !paired.count(s.name)) {
        Fail(ErrorCode::kUnsupported,
             where + "scale \"" + s.name + "\" has no F8_E4M3 weight beside it");
      }
    }
  }
}

}  // namespace

void ExprSegments(const ConversionExpr& x, uint64_t begin, uint64_t count, uint64_t entry_element,
                  std::vector<EntrySegment>& out) {
  using Op = ConversionExpr::Op;
  while (count > 0) {
    switch (x.op) {
      case Op::kKey:
        Push(out, x.key, x.shape, begin, count, entry_element);
        return;
      case Op::kDequantFp8:
      case Op::kDequantMxfp4: {
        // One segment over the quantized tensor and its scale (children are keys:
        // ParseModelManifest): FP8, element for element the weight's; MXFP4, element e of the
        // [E, G·32, N] result.
        const auto kind = x.op == Op::kDequantFp8 ? EntrySegment::Kind::kDequantFp8
                                                  : EntrySegment::Kind::kDequantMxfp4;
        const ConversionExpr& w = x.of[0];
        const ConversionExpr& sc = x.of[1];
        if (!out.empty()) {
          EntrySegment& last = out.back();
          if (last.kind == kind && last.source == w.key && last.element + last.count == entry_element &&
              last.source_element + last.count == begin) {
            last.count += count;
            return;
          }
        }
        EntrySegment seg;
        seg.kind = kind;
        seg.element = entry_element;
        seg.count = count;
        seg.source = w.key;
        seg.source_shape = w.shape;
        seg.source_element = begin;
        seg.scale = sc.key;
        seg.scale_shape = sc.shape;
        seg.block_rows = x.block_rows;  // FP8 only (0 for MXFP4)
        seg.block_cols = x.block_cols;
        out.push_back(std::move(seg));
        return;
      }
      case Op::kStack: {
        // Shape S[:d] + [n] + S[d:]: per outer index, n blocks of `inner` child elements.
        const uint64_t inner = Product(x.of[0].shape, x.dim, x.of[0].shape.size());
        const uint64_t n = x.of.size();
        if (inner == 0) return;
        const uint64_t outer = begin / (n * inner);
        const uint64_t rem = begin % (n * inner);
        const uint64_t k = rem / inner, w = rem % inner;
        const uint64_t run = std::min(count, inner - w);
        ExprSegments(x.of[k], outer * inner + w, run, entry_element, out);
        begin += run, count -= run, entry_element += run;
        break;
      }
      case Op::kCat: {
        // Per outer index, child i's c_i·R elements (R: elements past dim d) one after another.
        const uint64_t r = Product(x.shape, x.dim + 1, x.shape.size());
        const uint64_t block = x.shape[x.dim] * r;
        if (block == 0) return;
        const uint64_t outer = begin / block;
        uint64_t rem = begin % block;
        size_t i = 0;
        while (rem >= x.of[i].shape[x.dim] * r) rem -= x.of[i].shape[x.dim] * r, ++i;
        const uint64_t inner = x.of[i].shape[x.dim] * r;
        const uint64_t run = std::min(count, inner - rem);
        ExprSegments(x.of[i], outer * inner + rem, run, entry_element, out);
        begin += run, count -= run, entry_element += run;
        break;
      }
      case Op::kSlice: {
        const ConversionExpr& c = x.of[0];
        const uint64_t r = Product(c.shape, x.dim + 1, c.shape.size());
        const uint64_t inner = (x.stop - x.start) * r;
        if (inner == 0) return;
        const uint64_t outer = begin / inner, w = begin % inner;
        const uint64_t run = std::min(count, inner - w);
        ExprSegments(c, outer * c.shape[x.dim] * r + x.start * r + w, run, entry_element, out);
        begin += run, count -= run, entry_element += run;
        break;
      }
    }
  }
}

Checkpoint ModelView(const Checkpoint& ckpt, const Conversion& conversion,
                     const std::string& manifest_path) {
  Checkpoint view = ckpt;
  view.tensors.clear();
  std::set<std::string> used;
  const std::string recapture =
      "; capture the model manifest again for this checkpoint (python -m reshard.model_manifest " +
      ckpt.dir.string() + " -o " + manifest_path + ")";
  for (const ConversionTarget& t : conversion.targets) {
    std::vector<const ConversionExpr*> keys;
    Keys(t.expr, keys);
    // The target's dtype: its keys' (one dtype), or the dtype its FP8 weights dequantize to.
    std::vector<const ConversionExpr*> dequants;
    DequantNodes(t.expr, dequants);
    std::optional<DType> value_dtype;
    for (const ConversionExpr* d : dequants) {
      const std::optional<DType> dt = ParseDType(d->dtype);
      if (!dt || (value_dtype && *dt != *value_dtype)) {
        Fail(ErrorCode::kUnsupported, manifest_path + ": \"" + t.name + "\" dequantizes to " +
                                          d->dtype + (value_dtype ? " and " + std::string(Name(*value_dtype)) : "") +
                                          "; one float dtype expected");
      }
      value_dtype = dt;
      used.insert(d->of[0].key), used.insert(d->of[1].key);
    }
    if (!dequants.empty() && dequants.size() * 2 != keys.size()) {
      Fail(ErrorCode::kUnsupported, manifest_path + ": \"" + t.name +
                                        "\" mixes dequantized weights with other tensors");
    }
    const SourceTensor* first = nullptr;
    for (const ConversionExpr* k : keys) {
      const SourceTensor* s = ckpt.Find(k->key);
      if (!s) {
        Fail(ErrorCode::kMismatch, ckpt.dir.string() + ": no tensor \"" + k->key + "\", which " +
                                       manifest_path + "'s conversion assembles \"" + t.name +
                                       "\" from" + recapture);
      }
      if (s->shape != k->shape || Name(s->dtype) != k->dtype) {
        Fail(ErrorCode::kMismatch,
             ckpt.dir.string() + ": tensor \"" + k->key + "\" is " + std::string(Name(s->dtype)) +
                 " " + ShapeText(s->shape) + ", but " + manifest_path + "'s conversion expects " +
                 k->dtype + " " + ShapeText(k->shape) + recapture);
      }
      if (first && s->dtype != first->dtype && dequants.empty()) {
        Fail(ErrorCode::kUnsupported,
             ckpt.dir.string() + ": \"" + t.name + "\" is assembled from tensors of two dtypes (" +
                 std::string(Name(first->dtype)) + " \"" + first->name + "\" and " +
                 std::string(Name(s->dtype)) + " \"" + k->key + "\")");
      }
      if (!first) first = s;
      used.insert(k->key);
    }
    SourceTensor v;
    v.name = t.name;
    v.dtype = value_dtype ? *value_dtype : first ? first->dtype : DType::kF32;
    v.shape = t.expr.shape;
    v.file_index = first ? first->file_index : 0;
    v.offset = first ? first->offset : 0;
    uint64_t numel = 1;
    for (uint64_t d : v.shape) numel = CheckedMul(numel, d, "tensor \"" + t.name + "\"");
    v.nbytes = BytesFor(v.dtype, numel).value_or(0);
    view.tensors.push_back(std::move(v));
  }
  if (conversion.quantization) CheckQuantizedPairs(ckpt, conversion, manifest_path);
  for (const SourceTensor& s : ckpt.tensors) {
    if (used.count(s.name)) continue;
    if (conversion.Find(s.name)) {
      Fail(ErrorCode::kMismatch,
           ckpt.dir.string() + ": holds \"" + s.name + "\" itself, and " + manifest_path +
               "'s conversion assembles a tensor of that name from others" + recapture);
    }
    view.tensors.push_back(s);
  }
  std::sort(view.tensors.begin(), view.tensors.end(),
            [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  return view;
}

void ExpandConversion(EntryMap& map, const Conversion& conversion) {
  if (conversion.targets.empty()) return;
  std::vector<EntrySegment> out;
  for (EntrySegment& s : map.segments) {
    if (s.kind == EntrySegment::Kind::kStrided) {
      const ConversionTarget* t = conversion.Find(s.source);
      if (!t) {
        out.push_back(std::move(s));
        continue;
      }
      // A DTensor box of a tensor the manifest assembles (fused experts fully_shard'ed on dim 1:
      // rows of the box are runs of the target's elements): each run of each row in turn, as
      // the target's expression lays its elements out.
      const uint64_t row = s.RowElements();
      uint64_t i = 0;
      while (row > 0 && i < s.count) {
        const uint64_t base = s.source_element + (i / row) * s.stride;
        uint64_t off = i % row;
        for (const IndexRun& r : s.runs) {
          if (i >= s.count) break;
          if (off >= r.length) {
            off -= r.length;
            continue;
          }
          const uint64_t n = std::min(r.length - off, s.count - i);
          ExprSegments(t->expr, base + r.start + off, n, s.element + i, out);
          i += n;
          off = 0;
        }
      }
      continue;
    }
    const ConversionTarget* t =
        s.kind == EntrySegment::Kind::kSource ? conversion.Find(s.source) : nullptr;
    if (!t) {
      out.push_back(std::move(s));
    } else {
      ExprSegments(t->expr, s.source_element, s.count, s.element, out);
    }
  }
  map.segments = std::move(out);
}

std::vector<TensorLocation> HubNameLocations(const std::vector<TensorLocation>& tensors,
                                             const Conversion& conversion,
                                             const std::string& manifest_path) {
  struct Run {  // key elements [key_element, +count) are bytes [byte, +count·b) of target
    uint64_t key_element, count, byte;
    const TensorLocation* target;
  };
  struct Key {
    const ConversionExpr* expr = nullptr;
    DType dtype = DType::kU8;
    std::vector<Run> runs;
  };
  std::map<std::string, Key> keys;
  std::vector<std::string> order;  // output order: kept tensors and keys, first appearance
  std::set<std::string> names;
  for (const TensorLocation& t : tensors) {
    const ConversionTarget* target = conversion.Find(t.name);
    if (!target) {
      order.push_back(t.name);
      names.insert(t.name);
      continue;
    }
    std::vector<const ConversionExpr*> dequants;
    DequantNodes(target->expr, dequants);
    if (!dequants.empty()) {
      const bool fp8 = dequants[0]->op == ConversionExpr::Op::kDequantFp8;
      Fail(ErrorCode::kUnsupported,
           "\"" + t.name + "\" was dequantized from " + (fp8 ? "FP8 weight" : "MXFP4 blocks") + " \"" +
               dequants[0]->of[0].key +
               "\" and its scale at convert: the checkpoint's quantized tensors cannot be written back "
               "(export without --hub-names writes the model's names)");
    }
    const uint64_t bits = Info(t.dtype).bits;
    if (bits % 8) {
      Fail(ErrorCode::kUnsupported, "\"" + t.name + "\" is " + std::string(Name(t.dtype)) +
                                        ": checkpoint names need whole-byte elements");
    }
    const uint64_t b = bits / 8;
    std::vector<EntrySegment> segments;
    ExprSegments(target->expr, 0, b ? t.nbytes / b : 0, 0, segments);
    std::vector<const ConversionExpr*> leaves;
    Keys(target->expr, leaves);
    for (const ConversionExpr* leaf : leaves) {
      Key& k = keys[leaf->key];
      if (!k.expr) {
        k.expr = leaf;
        k.dtype = t.dtype;
        order.push_back(leaf->key);
      }
    }
    for (const EntrySegment& s : segments) {
      keys[s.source].runs.push_back({s.source_element, s.count, s.element * b, &t});
    }
  }
  std::vector<TensorLocation> out;
  for (const std::string& name : order) {
    auto it = keys.find(name);
    if (it == keys.end()) {
      out.push_back(*std::find_if(tensors.begin(), tensors.end(),
                                  [&](const TensorLocation& t) { return t.name == name; }));
      continue;
    }
    if (names.count(name)) {
      Fail(ErrorCode::kMismatch, "the layout holds \"" + name + "\" itself, and " + manifest_path +
                                     "'s conversion reads a checkpoint tensor of that name");
    }
    Key& k = it->second;
    const uint64_t b = Info(k.dtype).bits / 8;
    TensorLocation loc;
    loc.name = name;
    loc.dtype = k.dtype;
    loc.shape = k.expr->shape;
    uint64_t numel = 1;
    for (uint64_t d : loc.shape) numel = CheckedMul(numel, d, "tensor \"" + name + "\"");
    loc.nbytes = CheckedMul(numel, b, "tensor \"" + name + "\"");
    std::stable_sort(k.runs.begin(), k.runs.end(),
                     [](const Run& x, const Run& y) { return x.key_element < y.key_element; });
    uint64_t done = 0;  // key bytes [0, done) have pieces
    for (const Run& r : k.runs) {
      uint64_t lo = r.key_element * b, hi = (r.key_element + r.count) * b;
      if (hi <= done) continue;  // held by an earlier target too
      const uint64_t skip = std::max(done, lo) - lo;
      if (lo + skip > done) break;  // a gap: reported below
      const uint64_t from = r.byte + skip, to = r.byte + (hi - lo);
      // The target's pieces over its bytes [from, to), in order.
      const auto& pieces = r.target->pieces;
      auto p = std::upper_bound(pieces.begin(), pieces.end(), from,
                                [](uint64_t v, const TensorPiece& q) { return v < q.dst_offset; });
      if (p != pieces.begin()) --p;
      for (; p != pieces.end() && p->dst_offset < to; ++p) {
        const uint64_t a = std::max(from, p->dst_offset);
        const uint64_t e = std::min(to, p->dst_offset + p->length);
        if (a >= e) continue;
        TensorPiece q = *p;
        q.src_offset = p->src_offset + (a - p->dst_offset);
        q.dst_offset = lo + (a - r.byte);
        q.length = e - a;
        loc.pieces.push_back(q);
      }
      done = hi;
    }
    if (done != loc.nbytes) {
      Fail(ErrorCode::kMismatch, manifest_path + ": checkpoint tensor \"" + name + "\" has bytes [" +
                                     std::to_string(done) + ", " + std::to_string(loc.nbytes) +
                                     ") that no tensor of the layout holds; cannot write it");
    }
    out.push_back(std::move(loc));
  }
  return out;
}

}  // namespace reshard
