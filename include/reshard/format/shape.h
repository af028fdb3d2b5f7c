// Tensor shapes as reshard's messages print them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace reshard {

/// "[4864, 896]"; "[]" for a 0-dim shape.
inline std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace reshard
