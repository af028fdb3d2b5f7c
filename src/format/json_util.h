// Strict JSON helpers shared by the parsers of safetensors headers, rank file headers and
// manifests. Internal to the layers (src/format/; not installed).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "reshard/format/source.h"

namespace reshard::internal {

/// The deepest nesting of arrays and objects any reshard JSON reader accepts (formats/*.md):
/// reshard's own files nest at most 4 levels, Hugging Face config.json files a few more.
inline constexpr size_t kMaxJsonDepth = 64;

/// Throws kDataLoss naming `path` and `what` when `text` nests arrays / objects deeper than
/// kMaxJsonDepth: a linear scan (no recursion) run before any parser sees the text, so that
/// a hostile file cannot exhaust the stack of a recursive parse, dump or destructor.
void CheckJsonDepth(std::string_view text, const std::string& path, std::string_view what);

/// Parses `text` (depth checked first by CheckJsonDepth), rejecting duplicate object keys at
/// any depth. Throws kDataLoss naming `path` and `what` ("header", "manifest", ...).
/// `hex_array_key`: an array that is the value of this key in an object, and holds only
/// strings of 16 lower-case hex digits, is parsed into a binary value (read it with
/// HexArrayValues), not a string per element; any other such array is left as it is.
nlohmann::json ParseStrictJson(std::string_view text, const std::string& path,
                               std::string_view what, std::string_view hex_array_key = {});

/// The values of an array ParseStrictJson kept whole (see hex_array_key), in order; nullopt
/// for any other value.
std::optional<std::vector<uint64_t>> HexArrayValues(const nlohmann::json& value);

/// Short description of a JSON value's type and value for error messages.
std::string Describe(const nlohmann::json& value);

/// Field accessors: each throws kDataLoss "<path>: <field>: found ..., expected ...".
const nlohmann::json& Member(const nlohmann::json& obj, std::string_view key,
                             const std::string& path, const std::string& field);
uint64_t GetU64(const nlohmann::json& value, const std::string& path, const std::string& field);
std::string GetString(const nlohmann::json& value, const std::string& path,
                      const std::string& field);
bool GetBool(const nlohmann::json& value, const std::string& path, const std::string& field);
uint64_t GetHex16(const nlohmann::json& value, const std::string& path, const std::string& field);
const nlohmann::json& GetArray(const nlohmann::json& value, const std::string& path,
                               const std::string& field);
const nlohmann::json& GetObject(const nlohmann::json& value, const std::string& path,
                                const std::string& field);

/// The `source` object shared by rank file headers and manifests (formats/rank-file.md):
/// written from, and parsed and checked (fingerprint recomputed) into, a SourceFingerprint.
nlohmann::json SourceToJson(const SourceFingerprint& source);
SourceFingerprint SourceFromJson(const nlohmann::json& value, const std::string& path);

/// A plain file name inside a directory: not empty, not "." or "..", no '/' or '\\', no NUL
/// or other control character (bytes below 0x20 and 0x7f). Not an absolute path by
/// construction.
bool PlainFileName(std::string_view name);

/// A layout key names a directory inside OUT: [A-Za-z0-9._-]+, not "." or "..".
bool ValidLayoutKey(const std::string& key);

}  // namespace reshard::internal
