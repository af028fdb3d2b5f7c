#include "reshard/format/model_manifest.h"

#include <algorithm>
#include <set>

#include "format/json_util.h"
#include "reshard/base/error.h"
#include "reshard/format/shape.h"

namespace reshard {

namespace {

using internal::GetArray;
using internal::GetBool;
using internal::GetString;
using internal::GetU64;
using internal::Member;
using nlohmann::json;

std::vector<uint64_t> ShapeOf(const json& v, const std::string& path, const std::string& field) {
  const json& a = GetArray(v, path, field);
  std::vector<uint64_t> shape;
  for (size_t i = 0; i < a.size(); ++i) {
    shape.push_back(GetU64(a[i], path, field + "[" + std::to_string(i) + "]"));
  }
  return shape;
}

uint64_t NumelOf(const std::vector<uint64_t>& shape, const std::string& what) {
  uint64_t n = 1;
  for (uint64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

// Conversion trees are shallow (a stack inside a cat, a slice of a key); deeper is not a
// capture's output.
constexpr int kMaxConversionDepth = 16;

ConversionExpr ParseExpr(const json& v, const std::string& path, const std::string& f, int depth);

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// A dequantization's two operands, both checkpoint keys (transformers dequantizes each stored
// tensor first), appended to x.of.
void ParseQuantizedOperands(const json& v, const std::string& path, const std::string& f, int depth,
                            const char* expected, ConversionExpr& x) {
  const json& of = GetArray(Member(v, "of", path, f), path, f + ".of");
  if (of.size() != 2) FailField(path, f + ".of", std::to_string(of.size()) + " operands", expected);
  for (size_t i = 0; i < 2; ++i) {
    x.of.push_back(ParseExpr(of[i], path, f + ".of[" + std::to_string(i) + "]", depth + 1));
    if (x.of[i].op != ConversionExpr::Op::kKey) {
      FailField(path, f + ".of[" + std::to_string(i) + "]", "an expression",
                "a checkpoint key (transformers dequantizes each stored tensor first)");
    }
  }
}

// {"op": "dequant_fp8", "block": [bm, bn], "dtype": D, "of": [weight key, scale key]}: the
// weight (F8_E4M3, ≥ 2 dims [..., R, C]) times its scale (F32 [..., ceil(R/bm), ceil(C/bn)]).
ConversionExpr ParseDequantFp8(const json& v, const std::string& path, const std::string& f,
                               int depth) {
  ConversionExpr x;
  x.op = ConversionExpr::Op::kDequantFp8;
  x.dtype = GetString(Member(v, "dtype", path, f), path, f + ".dtype");
  if (x.dtype != "BF16" && x.dtype != "F16" && x.dtype != "F32") {
    FailField(path, f + ".dtype", "\"" + x.dtype + "\"", "one of BF16, F16, F32");
  }
  const std::vector<uint64_t> block = ShapeOf(Member(v, "block", path, f), path, f + ".block");
  if (block.size() != 2 || block[0] == 0 || block[1] == 0) {
    FailField(path, f + ".block", ShapeText(block), "[rows, cols], both positive");
  }
  x.block_rows = block[0], x.block_cols = block[1];
  ParseQuantizedOperands(v, path, f, depth, "two: [weight, scale]", x);
  const ConversionExpr& w = x.of[0];
  const ConversionExpr& s = x.of[1];
  if (w.dtype != "F8_E4M3") FailField(path, f + ".of[0].dtype", "\"" + w.dtype + "\"", "\"F8_E4M3\"");
  if (s.dtype != "F32") FailField(path, f + ".of[1].dtype", "\"" + s.dtype + "\"", "\"F32\"");
  const size_t n = w.shape.size();
  std::vector<uint64_t> want = w.shape;
  if (n >= 2) {
    want[n - 2] = CeilDiv(w.shape[n - 2], x.block_rows);
    want[n - 1] = CeilDiv(w.shape[n - 1], x.block_cols);
  }
  if (n < 2 || s.shape != want) {
    FailField(path, f + ".of[1].shape", ShapeText(s.shape),
              n < 2 ? "a weight of at least 2 dims" : ShapeText(want) + " (the weight's blocks)");
  }
  x.shape = w.shape;
  return x;
}

// {"op": "dequant_mxfp4", "dtype": "BF16", "of": [blocks key, scales key]}: gpt-oss's MXFP4
// experts (transformers' Mxfp4Dequantize): blocks U8 [E, N, G, 16] (32 FP4 e2m1 values per
// block, low nibble first), scales U8 [E, N, G] (E8M0 exponents, bias 127); the result
// [E, G·32, N] (the dequantized [E, N, G·32] transposed), in bfloat16 as transformers computes it.
ConversionExpr ParseDequantMxfp4(const json& v, const std::string& path, const std::string& f,
                                 int depth) {
  ConversionExpr x;
  x.op = ConversionExpr::Op::kDequantMxfp4;
  x.dtype = GetString(Member(v, "dtype", path, f), path, f + ".dtype");
  if (x.dtype != "BF16") FailField(path, f + ".dtype", "\"" + x.dtype + "\"", "\"BF16\"");
  ParseQuantizedOperands(v, path, f, depth, "two: [blocks, scales]", x);
  const ConversionExpr& b = x.of[0];
  const ConversionExpr& s = x.of[1];
  if (b.dtype != "U8") FailField(path, f + ".of[0].dtype", "\"" + b.dtype + "\"", "\"U8\"");
  if (s.dtype != "U8") FailField(path, f + ".of[1].dtype", "\"" + s.dtype + "\"", "\"U8\"");
  if (b.shape.size() != 4 || b.shape[3] != 16) {
    FailField(path, f + ".of[0].shape", ShapeText(b.shape), "[experts, rows, blocks, 16]");
  }
  const std::vector<uint64_t> want(b.shape.begin(), b.shape.end() - 1);
  if (s.shape != want) FailField(path, f + ".of[1].shape", ShapeText(s.shape), ShapeText(want));
  x.shape = {b.shape[0], CheckedMul(b.shape[2], 32, path + ": " + f), b.shape[1]};
  return x;
}

ConversionExpr ParseExpr(const json& v, const std::string& path, const std::string& f, int depth) {
  if (depth > kMaxConversionDepth) {
    FailField(path, f, "a conversion nested deeper than " + std::to_string(kMaxConversionDepth),
              "at most " + std::to_string(kMaxConversionDepth) + " levels");
  }
  internal::GetObject(v, path, f);
  ConversionExpr x;
  const std::string op = GetString(Member(v, "op", path, f), path, f + ".op");
  if (op == "key") {
    x.op = ConversionExpr::Op::kKey;
    x.key = GetString(Member(v, "key", path, f), path, f + ".key");
    x.dtype = GetString(Member(v, "dtype", path, f), path, f + ".dtype");
    x.shape = ShapeOf(Member(v, "shape", path, f), path, f + ".shape");
    NumelOf(x.shape, path + ": " + f + ".shape");
    return x;
  }
  if (op == "dequant_fp8") return ParseDequantFp8(v, path, f, depth);
  if (op == "dequant_mxfp4") return ParseDequantMxfp4(v, path, f, depth);
  if (op == "stack") {
    x.op = ConversionExpr::Op::kStack;
  } else if (op == "cat") {
    x.op = ConversionExpr::Op::kCat;
  } else if (op == "slice") {
    x.op = ConversionExpr::Op::kSlice;
  } else {
    FailField(path, f + ".op", "\"" + op + "\"", "one of key, stack, cat, slice, dequant_fp8, dequant_mxfp4");
  }
  x.dim = static_cast<uint32_t>(std::min<uint64_t>(GetU64(Member(v, "dim", path, f), path, f + ".dim"), 1u << 20));
  const json& of = GetArray(Member(v, "of", path, f), path, f + ".of");
  if (of.empty()) FailField(path, f + ".of", "an empty list", "at least one operand");
  for (size_t i = 0; i < of.size(); ++i) {
    x.of.push_back(ParseExpr(of[i], path, f + ".of[" + std::to_string(i) + "]", depth + 1));
  }
  const std::vector<uint64_t>& s0 = x.of[0].shape;
  if (x.op == ConversionExpr::Op::kStack) {
    if (x.dim > s0.size()) {
      FailField(path, f + ".dim", std::to_string(x.dim), "at most " + std::to_string(s0.size()));
    }
    for (size_t i = 1; i < x.of.size(); ++i) {
      if (x.of[i].shape != s0) {
        FailField(path, f + ".of[" + std::to_string(i) + "]", "shape " + ShapeText(x.of[i].shape),
                  ShapeText(s0) + " (stacked operands have one shape)");
      }
    }
    x.shape = s0;
    x.shape.insert(x.shape.begin() + x.dim, x.of.size());
  } else if (x.op == ConversionExpr::Op::kCat) {
    if (x.dim >= s0.size()) {
      FailField(path, f + ".dim", std::to_string(x.dim), "below " + std::to_string(s0.size()));
    }
    x.shape = s0;
    for (size_t i = 1; i < x.of.size(); ++i) {
      std::vector<uint64_t> si = x.of[i].shape;
      if (si.size() == s0.size()) si[x.dim] = s0[x.dim];
      if (si != s0) {
        FailField(path, f + ".of[" + std::to_string(i) + "]", "shape " + ShapeText(x.of[i].shape),
                  "the shape of the first operand but for dim " + std::to_string(x.dim));
      }
      x.shape[x.dim] += x.of[i].shape[x.dim];
    }
  } else {
    if (x.of.size() != 1) {
      FailField(path, f + ".of", std::to_string(x.of.size()) + " operands", "one (a slice)");
    }
    if (x.dim >= s0.size()) {
      FailField(path, f + ".dim", std::to_string(x.dim), "below " + std::to_string(s0.size()));
    }
    x.start = GetU64(Member(v, "start", path, f), path, f + ".start");
    x.stop = GetU64(Member(v, "stop", path, f), path, f + ".stop");
    if (x.start > x.stop || x.stop > s0[x.dim]) {
      FailField(path, f, "slice [" + std::to_string(x.start) + ", " + std::to_string(x.stop) + ")",
                "a range inside dim " + std::to_string(x.dim) + " of " + ShapeText(s0));
    }
    x.shape = s0;
    x.shape[x.dim] = x.stop - x.start;
  }
  NumelOf(x.shape, path + ": " + f + ".shape");
  return x;
}

Conversion ParseConversion(const json& v, const std::string& path) {
  internal::GetObject(v, path, "conversion");
  Conversion c;
  c.transformers_version =
      GetString(Member(v, "transformers", path, "conversion"), path, "conversion.transformers");
  const json& targets = GetArray(Member(v, "targets", path, "conversion"), path, "conversion.targets");
  for (size_t i = 0; i < targets.size(); ++i) {
    const std::string f = "conversion.targets[" + std::to_string(i) + "]";
    ConversionTarget t;
    t.name = GetString(Member(targets[i], "name", path, f), path, f + ".name");
    const std::vector<uint64_t> shape = ShapeOf(Member(targets[i], "shape", path, f), path, f + ".shape");
    t.expr = ParseExpr(Member(targets[i], "expr", path, f), path, f + ".expr", 0);
    if (t.expr.shape != shape) {
      FailField(path, f + ".shape", ShapeText(shape),
                ShapeText(t.expr.shape) + " (the shape its expr gives)");
    }
    c.targets.push_back(std::move(t));
  }
  std::sort(c.targets.begin(), c.targets.end(),
            [](const ConversionTarget& a, const ConversionTarget& b) { return a.name < b.name; });
  for (size_t i = 1; i < c.targets.size(); ++i) {
    if (c.targets[i].name == c.targets[i - 1].name) {
      FailField(path, "conversion.targets", "\"" + c.targets[i].name + "\" a second time",
                "each target once");
    }
  }
  if (v.contains("quantization") && !v["quantization"].is_null()) {
    const json& q = v["quantization"];
    const std::string f = "conversion.quantization";
    internal::GetObject(q, path, f);
    Quantization qz;
    qz.method = GetString(Member(q, "method", path, f), path, f + ".method");
    if (qz.method != "fp8" && qz.method != "mxfp4") {
      FailField(path, f + ".method", "\"" + qz.method + "\"", "\"fp8\" or \"mxfp4\"");
    }
    const std::string policy = GetString(Member(q, "policy", path, f), path, f + ".policy");
    if (policy == "dequantize") {
      qz.policy = Quantization::Policy::kDequantize;
    } else if (policy == "keep") {
      qz.policy = Quantization::Policy::kKeep;
    } else {
      FailField(path, f + ".policy", "\"" + policy + "\"", "\"dequantize\" or \"keep\"");
    }
    qz.weight_block_size =
        ShapeOf(Member(q, "weight_block_size", path, f), path, f + ".weight_block_size");
    c.quantization = std::move(qz);
  }
  const json& refused = GetArray(Member(v, "refused", path, "conversion"), path, "conversion.refused");
  for (size_t i = 0; i < refused.size(); ++i) {
    c.refused.push_back(GetString(refused[i], path, "conversion.refused[" + std::to_string(i) + "]"));
  }
  return c;
}

std::string ParentName(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

const ConversionTarget* Conversion::Find(std::string_view name) const {
  auto it = std::lower_bound(targets.begin(), targets.end(), name,
                             [](const ConversionTarget& t, std::string_view n) { return t.name < n; });
  return it != targets.end() && it->name == name ? &*it : nullptr;
}

ModelManifest ParseModelManifest(std::string_view text, const std::string& path) {
  json j = internal::ParseStrictJson(text, path, "model manifest");
  if (!j.is_object()) FailField(path, "model manifest", internal::Describe(j), "a JSON object");
  const std::string format = GetString(Member(j, "format", path, "model manifest"), path, "format");
  if (format != kModelManifestFormatName) {
    FailField(path, "format", "\"" + format + "\"", "\"reshard.model\"");
  }
  const uint64_t version =
      GetU64(Member(j, "format_version", path, "model manifest"), path, "format_version");
  if (version != 1 && version != kModelManifestVersion) {
    FailField(path, "format_version", std::to_string(version),
              "1 or " + std::to_string(kModelManifestVersion));
  }
  ModelManifest m;
  m.model_class = GetString(Member(j, "model_class", path, "model manifest"), path, "model_class");
  m.base_model_prefix =
      GetString(Member(j, "base_model_prefix", path, "model manifest"), path, "base_model_prefix");
  const json& nsm =
      GetArray(Member(j, "no_split_modules", path, "model manifest"), path, "no_split_modules");
  for (size_t i = 0; i < nsm.size(); ++i) {
    m.no_split_modules.push_back(
        GetString(nsm[i], path, "no_split_modules[" + std::to_string(i) + "]"));
  }
  const json& params = GetArray(Member(j, "params", path, "model manifest"), path, "params");
  std::set<std::string> param_names;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string f = "params[" + std::to_string(i) + "]";
    ModelParam p;
    const json& names = GetArray(Member(params[i], "names", path, f), path, f + ".names");
    if (names.empty()) FailField(path, f + ".names", "an empty list", "at least one name");
    for (size_t k = 0; k < names.size(); ++k) {
      p.names.push_back(GetString(names[k], path, f + ".names[" + std::to_string(k) + "]"));
      if (!param_names.insert(p.names.back()).second) {
        FailField(path, f + ".names", "\"" + p.names.back() + "\" a second time",
                  "each parameter name once");
      }
    }
    p.shape = ShapeOf(Member(params[i], "shape", path, f), path, f + ".shape");
    NumelOf(p.shape, path + ": " + f + ".shape");
    if (params[i].contains("unsaved")) p.unsaved = GetBool(params[i]["unsaved"], path, f + ".unsaved");
    m.params.push_back(std::move(p));
  }
  const json& modules = GetArray(Member(j, "modules", path, "model manifest"), path, "modules");
  if (modules.empty()) FailField(path, "modules", "an empty list", "the root module first");
  std::set<std::string> module_names;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string f = "modules[" + std::to_string(i) + "]";
    ModelModule mod;
    mod.name = GetString(Member(modules[i], "name", path, f), path, f + ".name");
    mod.cls = GetString(Member(modules[i], "class", path, f), path, f + ".class");
    if ((i == 0) != mod.name.empty()) {
      FailField(path, f + ".name", "\"" + mod.name + "\"",
                i == 0 ? "\"\" (the root first)" : "a non-empty module path");
    }
    if (!module_names.insert(mod.name).second) {
      FailField(path, f + ".name", "\"" + mod.name + "\" a second time", "unique module paths");
    }
    if (i > 0 && !module_names.count(ParentName(mod.name))) {
      FailField(path, f + ".name", "\"" + mod.name + "\" before its parent",
                "modules in named_modules() pre-order");
    }
    const json& ps = GetArray(Member(modules[i], "params", path, f), path, f + ".params");
    for (size_t k = 0; k < ps.size(); ++k) {
      const std::string pf = f + ".params[" + std::to_string(k) + "]";
      const json& pair = GetArray(ps[k], path, pf);
      if (pair.size() != 2) FailField(path, pf, internal::Describe(pair), "[local name, index]");
      const std::string local = GetString(pair[0], path, pf + "[0]");
      const uint64_t index = GetU64(pair[1], path, pf + "[1]");
      if (index >= m.params.size()) {
        FailField(path, pf + "[1]", std::to_string(index),
                  "an index below " + std::to_string(m.params.size()));
      }
      if (local.empty() || local.find('.') != std::string::npos) {
        FailField(path, pf + "[0]", "\"" + local + "\"", "a parameter name without '.'");
      }
      mod.params.emplace_back(local, static_cast<uint32_t>(index));
    }
    m.modules.push_back(std::move(mod));
  }
  const json& buffers = GetArray(Member(j, "buffers", path, "model manifest"), path, "buffers");
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string f = "buffers[" + std::to_string(i) + "]";
    ModelBuffer b;
    b.name = GetString(Member(buffers[i], "name", path, f), path, f + ".name");
    b.shape = ShapeOf(Member(buffers[i], "shape", path, f), path, f + ".shape");
    b.persistent = GetBool(Member(buffers[i], "persistent", path, f), path, f + ".persistent");
    m.buffers.push_back(std::move(b));
  }
  if (version >= 2 && j.contains("conversion") && !j["conversion"].is_null()) {
    m.conversion = ParseConversion(j["conversion"], path);
  }
  return m;
}

}  // namespace reshard
