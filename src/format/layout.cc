#include "reshard/format/layout.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard {

RowRange ChunkRows(uint64_t n, uint64_t world_size, uint64_t rank) {
  const uint64_t c = CeilDiv(n, world_size);
  // r·c can pass 2^64 when n is near 2^64 (e.g. n = 2^64 − 1, W = 2, r + 1 = 2); the result
  // is clamped to n anyway, so saturate instead of wrapping.
  auto boundary = [&](uint64_t r) {
    uint64_t v;
    return __builtin_mul_overflow(r, c, &v) ? n : std::min(v, n);
  };
  return {boundary(rank), boundary(rank + 1)};
}

std::string LayoutSpec::KindName() const {
  switch (kind) {
    case LayoutKind::kFsdp2: return "fsdp2";
    case LayoutKind::kFsdp1: return "fsdp1";
    case LayoutKind::kDTensor: return "dtensor";
  }
  return "unknown";
}

namespace {

std::string Hex8(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08llx", static_cast<unsigned long long>(v & 0xffffffffu));
  return buf;
}

}  // namespace

std::string LayoutSpec::Key() const {
  if (kind == LayoutKind::kDTensor) {
    std::string key = "dtensor-" + mesh.KeyPart() + "-" + plan_name + "." + Hex8(plan_xxh3 >> 32);
    if (dtype != "keep") key += "-" + dtype;
    return key;
  }
  std::string key = KindName() + "-ws" + std::to_string(world_size);
  if (kind == LayoutKind::kFsdp1) {
    std::string classes;
    for (const auto& w : wrap) classes += (classes.empty() ? "" : ".") + w;
    if (classes.empty()) {
      classes = "nowrap";
    } else if (classes.size() > 64) {
      char buf[17];
      std::snprintf(buf, sizeof buf, "%08llx",
                    static_cast<unsigned long long>(Xxh3(classes) & 0xffffffffu));
      classes = std::string("w") + buf;
    }
    key += "-" + classes;
    if (use_orig_params) key += "-orig";
    if (use_orig_params && !param_dtype.empty()) key += "-p" + param_dtype;
  }
  if (dtype != "keep") key += "-" + dtype;
  return key;
}

std::string LayoutSpec::ConvertFlags() const {
  if (kind == LayoutKind::kDTensor) {
    std::string flags = "--mesh " + mesh.Flag() + " --plan " + plan_name + ".json";
    if (dtype != "keep") flags += " --dtype " + dtype;
    return flags;
  }
  std::string flags = "--world-size " + std::to_string(world_size);
  if (kind == LayoutKind::kFsdp1) {
    flags += " --layout fsdp1";
    for (const auto& w : wrap) flags += " --wrap " + w;
    if (use_orig_params) flags += " --use-orig-params";
    if (use_orig_params && !param_dtype.empty()) flags += " --param-dtype " + param_dtype;
  }
  if (dtype != "keep") flags += " --dtype " + dtype;
  return flags;
}

void LayoutSpec::Normalize() {
  if (kind == LayoutKind::kDTensor) {
    mesh.Check("--mesh");
    world_size = static_cast<uint32_t>(mesh.Size());
    if (plan_name.empty() || plan_name.size() > 64 ||
        plan_name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") !=
            std::string::npos) {
      Fail(ErrorCode::kInvalidArgument, "plan name \"" + plan_name + "\" is not [A-Za-z0-9_]{1,64}");
    }
  } else if (!mesh.shape.empty() || !plan_name.empty()) {
    Fail(ErrorCode::kInvalidArgument, "--mesh and --plan apply to DTensor layouts only");
  }
  if (kind != LayoutKind::kFsdp1) {
    if (!wrap.empty() || use_orig_params || !param_dtype.empty()) {
      Fail(ErrorCode::kInvalidArgument,
           "--wrap, --use-orig-params and --param-dtype apply to --layout fsdp1 only");
    }
    return;
  }
  std::set<std::string> unique(wrap.begin(), wrap.end());
  wrap.assign(unique.begin(), unique.end());
  for (const auto& w : wrap) {
    if (w.empty()) Fail(ErrorCode::kInvalidArgument, "--wrap: an empty class name");
    for (char c : w) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) {
        Fail(ErrorCode::kInvalidArgument, "--wrap " + w + ": not a Python class name");
      }
    }
  }
  if (!use_orig_params) param_dtype.clear();  // alignment padding exists only with it
  if (!param_dtype.empty() && param_dtype != "bf16" && param_dtype != "fp16" &&
      param_dtype != "fp32") {
    Fail(ErrorCode::kInvalidArgument,
         "--param-dtype " + param_dtype + " is not one of bf16, fp16, fp32");
  }
}

std::optional<LayoutKind> ParseLayoutKind(std::string_view name) {
  if (name == "fsdp2") return LayoutKind::kFsdp2;
  if (name == "fsdp1") return LayoutKind::kFsdp1;
  if (name == "dtensor") return LayoutKind::kDTensor;
  return std::nullopt;
}

std::string FlatEntryName(const std::string& unit) {
  return unit.empty() ? std::string("_flat_param") : unit + "._flat_param";
}

}  // namespace reshard
