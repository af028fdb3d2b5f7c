#include "reshard/base/version.h"

#include <string>

namespace reshard {
std::string_view WriterString() {
  static const std::string s = "reshard " + std::string(kVersion);
  return s;
}
}  // namespace reshard
