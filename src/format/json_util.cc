#include "format/json_util.h"

#include <cctype>
#include <cstring>
#include <optional>
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

// Builds the document in one SAX pass and stops at the first duplicate object key: one
// tokenization instead of a key-checking pass and then a parse (the rank file header's
// chunk_xxh3 arrays made the two passes the bulk of a header's parse time). A public-API
// builder, not nlohmann's parser callback: its DOM builder scans the whole parent object for
// discarded values after every nested object ends, which is quadratic in the number of
// tensors of a safetensors header. Only the open containers are held by pointer: an object
// member never moves, and an array is appended to only while none of its children is open.
// An array under the key `hex_key` whose elements are all hex16 strings is kept as one binary
// value of their 64-bit values (HexArrayValues): no string per element (a rank file header
// holds one per checksum chunk), in host byte order (never written out). JSON text never makes
// a binary value, so one means exactly that; any other element turns the array back into a
// plain one, element for element.
class StrictDomBuilder {
 public:
  StrictDomBuilder(json& root, std::string_view hex_key) : root_(root), hex_key_(hex_key) {}
  std::string duplicate;
  std::string error;

  bool null() { return Put(nullptr); }
  bool boolean(bool v) { return Put(v); }
  bool number_integer(json::number_integer_t v) { return Put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return Put(v); }
  bool number_float(json::number_float_t v, const std::string&) { return Put(v); }
  bool string(std::string& v) {
    if (hex_) {
      if (const auto x = ParseHex16(v)) {
        hex_values_.push_back(*x);
        return true;
      }
    }
    return Put(std::move(v));
  }
  bool binary(json::binary_t& v) { return Put(json::binary_t(std::move(v))); }
  bool start_object(std::size_t) {
    open_.push_back(&Place(json::object()));
    return true;
  }
  bool key(std::string& k) {
    if (open_.back()->contains(k)) {
      duplicate = k;
      return false;  // the first one is reported; stop here
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    const bool hex = !hex_key_.empty() && !open_.empty() && open_.back()->is_object() && key_ == hex_key_;
    open_.push_back(&Place(json::array()));
    hex_ = hex;
    hex_values_.clear();
    return true;
  }
  bool end_array() {
    if (hex_) {
      json::binary_t bytes(std::vector<uint8_t>(hex_values_.size() * 8));
      if (!bytes.empty()) std::memcpy(bytes.data(), hex_values_.data(), bytes.size());  // no null memcpy
      *open_.back() = json::binary(std::move(bytes));
      hex_ = false;
    }
    open_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error = e.what();
    return false;
  }

 private:
  json& Place(json&& v) {
    if (hex_) {  // not a hex16 string: the values so far become strings again
      for (const uint64_t x : hex_values_) open_.back()->push_back(Hex16(x));
      hex_ = false;
    }
    if (open_.empty()) return root_ = std::move(v);
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return parent.back();
    }
    return parent[key_] = std::move(v);
  }
  bool Put(json&& v) {
    Place(std::move(v));
    return true;
  }

  json& root_;
  std::string_view hex_key_;
  std::vector<json*> open_;
  std::string key_;
  bool hex_ = false;  // the innermost open array may still become a binary value
  std::vector<uint64_t> hex_values_;
};

}  // namespace

json ParseStrictJson(std::string_view text, const std::string& path, std::string_view what,
                     std::string_view hex_array_key) {
  CheckJsonDepth(text, path, what);
  json doc;
  StrictDomBuilder builder(doc, hex_array_key);
  json::sax_parse(text.begin(), text.end(), &builder);
  if (!builder.error.empty()) {
    Fail(ErrorCode::kDataLoss,
         path + ": " + std::string(what) + " is not valid JSON (" + builder.error + ")");
  }
  if (!builder.duplicate.empty()) {
    Fail(ErrorCode::kDataLoss, path + ": " + std::string(what) + ": duplicate key \"" +
                                   Printable(builder.duplicate) + "\"");
  }
  return doc;
}

namespace {

bool HoldsKeptArray(const json& j) {
  if (j.is_binary()) return true;
  if (j.is_structured()) {
    for (const json& v : j) {
      if (HoldsKeptArray(v)) return true;
    }
  }
  return false;
}

// `j` with every array ParseStrictJson kept whole (a binary value) turned back into the
// array of hex16 strings it was read from, so an error shows the file's own text. Recursion
// is bounded: every parsed document passed CheckJsonDepth.
json KeptArraysBack(const json& j) {
  if (j.is_binary()) {
    json a = json::array();
    for (const uint64_t v : HexArrayValues(j).value_or(std::vector<uint64_t>{})) a.push_back(Hex16(v));
    return a;
  }
  if (j.is_object()) {
    json o = json::object();
    for (auto it = j.begin(); it != j.end(); ++it) o[it.key()] = KeptArraysBack(it.value());
    return o;
  }
  if (j.is_array()) {
    json a = json::array();
    for (const json& v : j) a.push_back(KeptArraysBack(v));
    return a;
  }
  return j;
}

}  // namespace

std::string Describe(const json& value) {
  if (HoldsKeptArray(value)) return Describe(KeptArraysBack(value));
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

std::optional<std::vector<uint64_t>> HexArrayValues(const json& value) {
  if (!value.is_binary()) return std::nullopt;
  const json::binary_t& bytes = value.get_binary();
  std::vector<uint64_t> v(bytes.size() / 8);
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * 8);  // an empty array: no null memcpy
  return v;
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
