#include "reshard/format/checkpoint.h"

#include <algorithm>
#include <map>
#include <string>

#include "format/json_util.h"
#include "reshard/base/error.h"

namespace reshard {

const SourceTensor* Checkpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const SourceTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

const std::vector<std::string>& AuxFileNames() {
  static const std::vector<std::string> names = {
      "config.json",           "generation_config.json", "tokenizer.json",
      "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json",            "merges.txt",             "vocab.txt",
      "added_tokens.json",     "chat_template.jinja",    "chat_template.json",
      "preprocessor_config.json",
  };
  return names;
}

std::map<std::string, std::string> ParseWeightMap(std::string_view text, const std::string& path) {
  nlohmann::json index = internal::ParseStrictJson(text, path, "index");
  const auto& map = internal::GetObject(internal::Member(index, "weight_map", path, "index"),
                                        path, "weight_map");
  std::map<std::string, std::string> result;
  for (const auto& [key, value] : map.items()) {
    const std::string field = "weight_map[\"" + Printable(key) + "\"]";
    if (key.find('\0') != std::string::npos) {
      FailField(path, "weight_map", "the tensor name \"" + Printable(key) + "\" (a NUL inside)",
                "tensor names without NUL characters");
    }
    std::string file = internal::GetString(value, path, field);
    if (!internal::PlainFileName(file)) {
      FailField(path, field, "\"" + Printable(file) + "\"",
                "a file name in the checkpoint directory (plain: no '/', '\\', \"..\", NUL or "
                "control characters)");
    }
    result.emplace(key, std::move(file));
  }
  if (result.empty()) FailField(path, "weight_map", "an empty map", "at least one tensor");
  return result;
}

}  // namespace reshard
