// Description of an output directory, a layout directory, a rank file, or a HF source.
#pragma once

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace reshard {

/// Returns a JSON description; "kind" is "output", "layout", "rank_file" or "source".
nlohmann::json Inspect(const std::filesystem::path& path);

/// Human-readable rendering of Inspect()'s result.
std::string RenderInspect(const nlohmann::json& description);

}  // namespace reshard
