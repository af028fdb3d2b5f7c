#pragma once
#include <string_view>
namespace reshard {
inline constexpr std::string_view kVersion = "0.1.0";
std::string_view WriterString();  // "reshard 0.1.0"
}  // namespace reshard
