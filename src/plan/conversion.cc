#include "reshard/plan/conversion.h"

#include <algorithm>
#include <map>
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

}  // namespace

void ExprSegments(const ConversionExpr& x, uint64_t begin, uint64_t count, uint64_t entry_element,
                  std::vector<EntrySegment>& out) {
  using Op = ConversionExpr::Op;
  while (count > 0) {
    switch (x.op) {
      case Op::kKey:
        Push(out, x.key, x.shape, begin, count, entry_element);
        return;
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
      if (first && s->dtype != first->dtype) {
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
    v.dtype = first ? first->dtype : DType::kF32;
    v.shape = t.expr.shape;
    v.file_index = first ? first->file_index : 0;
    v.offset = first ? first->offset : 0;
    uint64_t numel = 1;
    for (uint64_t d : v.shape) numel = CheckedMul(numel, d, "tensor \"" + t.name + "\"");
    v.nbytes = BytesFor(v.dtype, numel).value_or(0);
    view.tensors.push_back(std::move(v));
  }
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
