// Verification of an output directory (or one layout directory, or one rank file).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace reshard {

struct VerifyProblem {
  std::string file;     // the file concerned
  std::string tensor;   // the tensor concerned, or empty
  std::string message;  // what is wrong
};

struct VerifyOptions {
  std::filesystem::path path;                  // OUT, OUT/<key>, or a rank file
  std::optional<std::filesystem::path> source;  // compare with the source byte for byte
  unsigned threads = 0;
  /// Called now and then with (layout key, bytes checked, bytes to check) while a layout's
  /// chunks are checked, from a worker thread; calls are serialized, the values never
  /// decrease within a layout, and each layout ends with a call where the two are equal.
  std::function<void(const std::string&, uint64_t, uint64_t)> progress;
};

struct VerifyReport {
  std::vector<VerifyProblem> problems;
  /// What is there besides the layouts checked, not wrong in them (verifying OUT): temporary
  /// files of an unfinished or killed write, a directory of rank files the manifest does not
  /// list (a convert or relayout that did not finish). Said, not counted as problems.
  std::vector<std::string> notes;
  std::vector<std::string> layouts;  // keys checked
  uint64_t files = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;                // decoded bytes checked
  uint64_t source_bytes_compared = 0;
  double seconds = 0;
  bool ok() const { return problems.empty(); }
};

/// Checks every file's preamble, header and every chunk checksum; every rank present; with
/// a source, that the ranks reassemble every source tensor byte for byte and that no tensor
/// is missing or extra. Problems are collected, not thrown; only unusable arguments throw.
VerifyReport Verify(const VerifyOptions& options);

}  // namespace reshard
