#pragma once
// What a path given as OUT is, when it is not a reshard output directory but is near one: for
// the errors of relayout, verify and inspect, and of reshard.load (reshard.layout.path_hint calls it).
#include <filesystem>
#include <string>

namespace reshard {

/// "" when there is nothing better to say than "no reshard.json"; else what the path is and
/// what to pass instead: missing; a rank file or a layout directory of OUT (pass OUT); a
/// directory holding checkpoints (step-*/reshard.json: pass one); a Hugging Face checkpoint
/// (convert it first).
std::string PathHint(const std::filesystem::path& out);

}  // namespace reshard
