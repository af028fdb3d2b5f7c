// Strict JSON helpers shared by the parsers of safetensors headers, rank file headers and
// manifests. Internal to the layers (src/format/; not installed).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "reshard/format/source.h"

namespace reshard::internal {

/// Parses `text`, rejecting duplicate object keys at any depth. Throws kDataLoss naming
/// `path` and `what` ("header", "manifest", ...).
nlohmann::json ParseStrictJson(std::string_view text, const std::string& path,
                               std::string_view what);

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

/// A layout key names a directory inside OUT: [A-Za-z0-9._-]+, not "." or "..".
bool ValidLayoutKey(const std::string& key);

}  // namespace reshard::internal
