#include "format/json_util.h"

#include <cctype>
#include <set>
#include <unordered_set>
#include <vector>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard::internal {

using nlohmann::json;

void CheckJsonDepth(std::string_view text, const std::string& path, std::string_view what) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > kMaxJsonDepth) {
          FailField(path, what,
                    "arrays/objects nested more than " + std::to_string(kMaxJsonDepth) +
                        " levels deep (level " + std::to_string(depth) + " opens at byte " +
                        std::to_string(i) + ")",
                    "at most " + std::to_string(kMaxJsonDepth) + " levels of nesting");
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;  // unbalanced brackets are the parser's to report
        break;
      default: break;
    }
  }
}

namespace {

// A SAX pass that builds nothing: finds syntax errors and the first duplicate object key.
// (nlohmann's parser callback cannot be used for this: its DOM builder scans the whole parent
// object for discarded values after every nested object ends, which is quadratic in the
// number of tensors of a safetensors header.)
struct DuplicateKeyFinder {
  std::vector<std::unordered_set<std::string>> keys;
  std::string duplicate;
  std::string error;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    keys.emplace_back();
    return true;
  }
  bool key(std::string& k) {
    if (!keys.back().insert(k).second) {
      duplicate = k;
      return false;  // the first one is reported; stop here
    }
    return true;
  }
  bool end_object() {
    keys.pop_back();
    return true;
  }
  bool start_array(std::size_t) { return true; }
  bool end_array() { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error = e.what();
    return false;
  }
};

}  // namespace

json ParseStrictJson(std::string_view text, const std::string& path, std::string_view what) {
  CheckJsonDepth(text, path, what);
  DuplicateKeyFinder finder;
  json::sax_parse(text.begin(), text.end(), &finder);
  if (!finder.error.empty()) {
    Fail(ErrorCode::kDataLoss,
         path + ": " + std::string(what) + " is not valid JSON (" + finder.error + ")");
  }
  if (!finder.duplicate.empty()) {
    Fail(ErrorCode::kDataLoss, path + ": " + std::string(what) + ": duplicate key \"" +
                                   Printable(finder.duplicate) + "\"");
  }
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {  // not expected after the pass above
    Fail(ErrorCode::kDataLoss,
         path + ": " + std::string(what) + " is not valid JSON (" + e.what() + ")");
  }
}

std::string Describe(const json& value) {
  std::string s = value.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return std::string(value.type_name()) + " " + s;
}

const json& Member(const json& obj, std::string_view key, const std::string& path,
                   const std::string& field) {
  if (!obj.is_object()) FailField(path, field, Describe(obj), "an object");
  auto it = obj.find(key);
  if (it == obj.end()) FailField(path, field + "." + std::string(key), "nothing", "a value");
  return *it;
}

uint64_t GetU64(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_number_unsigned()) {
    if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<uint64_t>();
    FailField(path, field, Describe(value), "a non-negative integer");
  }
  return value.get<uint64_t>();
}

std::string GetString(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_string()) FailField(path, field, Describe(value), "a string");
  return value.get<std::string>();
}

bool GetBool(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_boolean()) FailField(path, field, Describe(value), "true or false");
  return value.get<bool>();
}

uint64_t GetHex16(const json& value, const std::string& path, const std::string& field) {
  if (value.is_string()) {
    if (auto v = ParseHex16(value.get_ref<const std::string&>())) return *v;
  }
  FailField(path, field, Describe(value), "16 lower-case hex digits");
}

const json& GetArray(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_array()) FailField(path, field, Describe(value), "an array");
  return value;
}

const json& GetObject(const json& value, const std::string& path, const std::string& field) {
  if (!value.is_object()) FailField(path, field, Describe(value), "an object");
  return value;
}

json SourceToJson(const SourceFingerprint& s) {
  json files = json::array();
  for (const auto& f : s.files) {
    files.push_back({{"name", f.name}, {"size", f.size}, {"header_xxh3", Hex16(f.header_xxh3)},
                     {"sample_xxh3", Hex16(f.sample_xxh3)}});
  }
  json j = {{"files", files}, {"fingerprint", Hex16(s.fingerprint)}};
  if (s.saved) {
    j["saved"] = {{"id", Hex16(s.saved->id)},
                  {"step", s.saved->step ? json(*s.saved->step) : json(nullptr)}};
  }
  return j;
}

SourceFingerprint SourceFromJson(const json& j, const std::string& path) {
  GetObject(j, path, "source");
  std::vector<SourceFile> files;
  const json& jf = GetArray(Member(j, "files", path, "source"), path, "source.files");
  for (size_t i = 0; i < jf.size(); ++i) {
    const std::string f = "source.files[" + std::to_string(i) + "]";
    files.push_back({GetString(Member(jf[i], "name", path, f), path, f + ".name"),
                     GetU64(Member(jf[i], "size", path, f), path, f + ".size"),
                     GetHex16(Member(jf[i], "header_xxh3", path, f), path, f + ".header_xxh3"),
                     GetHex16(Member(jf[i], "sample_xxh3", path, f), path, f + ".sample_xxh3")});
  }
  SourceFingerprint s;
  if (j.contains("saved")) {
    const json& js = GetObject(j["saved"], path, "source.saved");
    SavedSource saved;
    saved.id = GetHex16(Member(js, "id", path, "source.saved"), path, "source.saved.id");
    const json& step = Member(js, "step", path, "source.saved");
    if (!step.is_null()) saved.step = GetU64(step, path, "source.saved.step");
    if (!files.empty()) {
      FailField(path, "source.files", std::to_string(files.size()) + " entries",
                "none for a saved source (source.saved)");
    }
    s = SourceFingerprint::FromSaved(saved);
  } else {
    s = SourceFingerprint::FromFiles(files);
  }
  const uint64_t fp = GetHex16(Member(j, "fingerprint", path, "source"), path, "source.fingerprint");
  if (fp != s.fingerprint) {
    FailField(path, "source.fingerprint", Hex16(fp),
              Hex16(s.fingerprint) +
                  (s.saved ? " (computed from source.saved)" : " (computed from source.files)"));
  }
  return s;
}

bool PlainFileName(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/' || c == '\\' || u < 0x20 || u == 0x7f) return false;
  }
  return true;
}

bool ValidLayoutKey(const std::string& key) {
  if (key.empty() || key == "." || key == "..") return false;
  for (char c : key) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

}  // namespace reshard::internal
