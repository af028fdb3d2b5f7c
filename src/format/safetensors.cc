#include "reshard/format/safetensors.h"

#include <algorithm>
#include <string>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard {

using internal::Describe;
using nlohmann::json;

namespace {

uint64_t ReadLE64(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

SafetensorsTensor ParseEntry(const std::string& name, const json& entry, uint64_t data_size,
                             const std::string& path) {
  const std::string field = "tensor \"" + Printable(name) + "\"";
  if (!entry.is_object()) FailField(path, field, Describe(entry), "an object");
  for (const auto& [k, v] : entry.items()) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") {
      FailField(path, field, "unknown key \"" + k + "\"", "only dtype, shape, data_offsets");
    }
  }
  SafetensorsTensor t;
  t.name = name;
  std::string dtype = internal::GetString(internal::Member(entry, "dtype", path, field), path,
                                          field + ".dtype");
  auto parsed = ParseDType(dtype);
  if (!parsed) {
    FailField(path, field + ".dtype", "\"" + dtype + "\"",
              "a safetensors dtype (BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, "
              "U64, C64, F8_E4M3, F8_E5M2, F8_E8M0, F6_E2M3, F6_E3M2, F4)");
  }
  t.dtype = *parsed;
  const json& shape =
      internal::GetArray(internal::Member(entry, "shape", path, field), path, field + ".shape");
  uint64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    uint64_t d = internal::GetU64(shape[i], path, field + ".shape[" + std::to_string(i) + "]");
    t.shape.push_back(d);
    numel = CheckedMul(numel, d, path + ": " + field + ".shape: element count");
  }
  const json& offsets = internal::GetArray(internal::Member(entry, "data_offsets", path, field),
                                           path, field + ".data_offsets");
  if (offsets.size() != 2) {
    FailField(path, field + ".data_offsets", Describe(offsets), "[begin, end]");
  }
  uint64_t begin = internal::GetU64(offsets[0], path, field + ".data_offsets[0]");
  uint64_t end = internal::GetU64(offsets[1], path, field + ".data_offsets[1]");
  if (end < begin) {
    FailField(path, field + ".data_offsets",
              "[" + std::to_string(begin) + ", " + std::to_string(end) + "]", "begin <= end");
  }
  auto nbytes = BytesFor(t.dtype, numel);
  if (!nbytes) {
    FailField(path, field + ".shape", std::to_string(numel) + " elements of " + dtype,
              "a whole number of bytes without overflow");
  }
  if (end - begin != *nbytes) {
    FailField(path, field + ".data_offsets",
              std::to_string(end - begin) + " bytes [" + std::to_string(begin) + ", " +
                  std::to_string(end) + ")",
              std::to_string(*nbytes) + " bytes (" + std::to_string(numel) + " elements of " +
                  dtype + ")");
  }
  if (end > data_size) {
    FailField(path, field + ".data_offsets",
              "end " + std::to_string(end) + " past the data (" + std::to_string(data_size) +
                  " bytes)",
              "offsets inside the file");
  }
  t.offset = begin;  // made absolute by the caller
  t.nbytes = *nbytes;
  return t;
}

}  // namespace

SafetensorsFile ParseSafetensorsHeader(std::string_view prefix, uint64_t file_size,
                                       const std::string& path) {
  if (file_size < 8 || prefix.size() < 8) {
    FailField(path, "header length", "a file of " + std::to_string(file_size) + " bytes",
              "at least 8 bytes (the u64 header length)");
  }
  const uint64_t n = ReadLE64(prefix.data());
  if (n > kSafetensorsMaxHeaderSize) {
    FailField(path, "header length", std::to_string(n) + " bytes",
              "at most " + std::to_string(kSafetensorsMaxHeaderSize));
  }
  if (n < 2) FailField(path, "header length", std::to_string(n), "at least 2 (\"{}\")");
  if (8 + n > file_size) {
    FailField(path, "header length",
              std::to_string(n) + " bytes, but the file has only " +
                  std::to_string(file_size - 8) + " after the length",
              "a header inside the file (truncated file?)");
  }
  if (prefix.size() < 8 + n) {
    Fail(ErrorCode::kInvalidArgument, path + ": internal: header prefix not fully read");
  }
  std::string_view text = prefix.substr(8, n);
  json header = internal::ParseStrictJson(text, path, "safetensors header");
  if (!header.is_object()) FailField(path, "header", Describe(header), "a JSON object");

  SafetensorsFile file;
  file.path = path;
  file.file_size = file_size;
  file.header_size = n;
  file.header_xxh3 = Xxh3(prefix.data(), 8 + n);
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = file_size - data_start;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) FailField(path, "__metadata__", Describe(value), "an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          FailField(path, "__metadata__." + Printable(mk), Describe(mv), "a string");
        }
        file.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    file.tensors.push_back(ParseEntry(key, value, data_size, path));
  }
  std::sort(file.tensors.begin(), file.tensors.end(), [](const auto& a, const auto& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  uint64_t expected = 0;
  const SafetensorsTensor* previous = nullptr;
  for (auto& t : file.tensors) {
    if (t.offset < expected) {
      FailField(path, "tensor \"" + Printable(t.name) + "\".data_offsets",
                "begin " + std::to_string(t.offset) + " overlapping \"" + previous->name +
                    "\" (which ends at " + std::to_string(expected) + ")",
                "non-overlapping tensors");
    }
    if (t.offset > expected) {
      FailField(path, "tensor \"" + Printable(t.name) + "\".data_offsets",
                "begin " + std::to_string(t.offset) + " leaving a hole after " +
                    (previous ? "\"" + Printable(previous->name) + "\"" : std::string("the header")) +
                    " at " + std::to_string(expected),
                "tensors packed without holes");
    }
    expected = t.offset + t.nbytes;
    previous = &t;
    t.offset += data_start;
  }
  if (expected != data_size) {
    FailField(path, "data size",
              std::to_string(data_size) + " bytes after the header, tensors cover " +
                  std::to_string(expected),
              "tensors covering the data exactly");
  }
  return file;
}

}  // namespace reshard
