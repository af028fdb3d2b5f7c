// Replays the hostile-file corpus tests/golden/ (written by tests/golden/make_golden.py, listed with
// the expected error in tests/golden/expectations.json) through the core: every broken file
// must be refused with a reshard::Error of the expected code whose message names the file and
// carries the expected field / found / expected text; nothing may crash, hang or allocate
// without bound (scripts/sanitize.sh runs this suite under ASan+UBSan). Also replays
// tests/fuzz/regressions/ (inputs that once crashed a fuzz target) through the same parsers.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "reshard/base/error.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/format/safetensors.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/inspect.h"
#include "reshard/ops/verify.h"
#include "core/test_util.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::ThrowsError;

const fs::path kGolden = RESHARD_GOLDEN_DIR;
const fs::path kRegressions = RESHARD_FUZZ_REGRESSIONS_DIR;

struct GoldenCase {
  std::string file;  // relative to tests/golden
  std::string kind;
  std::string code;  // ErrorCodeName, empty when no exception is expected
  std::vector<std::string> contains;
  std::string what;
};

void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.file << " (" << c.what << ")"; }

std::vector<GoldenCase> LoadCases() {
  std::ifstream in(kGolden / "expectations.json");
  if (!in) return {};
  const nlohmann::json j = nlohmann::json::parse(in);
  std::vector<GoldenCase> cases;
  for (const auto& c : j.at("cases")) {
    cases.push_back({c.at("file"), c.at("kind"), c.at("code"),
                     c.at("contains").get<std::vector<std::string>>(), c.value("what", "")});
  }
  return cases;
}

ErrorCode CodeByName(const std::string& name) {
  for (ErrorCode c : {ErrorCode::kInvalidArgument, ErrorCode::kNotFound, ErrorCode::kDataLoss,
                      ErrorCode::kMismatch, ErrorCode::kUnsupported, ErrorCode::kIo,
                      ErrorCode::kBusy}) {
    if (ErrorCodeName(c) == name) return c;
  }
  ADD_FAILURE() << "unknown error code name \"" << name << "\" in expectations.json";
  return ErrorCode::kDataLoss;
}

std::vector<std::string_view> Views(const std::vector<std::string>& v) {
  return {v.begin(), v.end()};
}

template <typename Fn>
::testing::AssertionResult Throws(Fn&& fn, const GoldenCase& c) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string m = e.what();
    if (ErrorCodeName(e.code()) != c.code) {
      return ::testing::AssertionFailure() << "error code " << ErrorCodeName(e.code())
                                           << ", expected " << c.code << "; message: " << m;
    }
    for (const auto& n : c.contains) {
      if (m.find(n) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << n << "\"; message: " << m;
      }
    }
    return ::testing::AssertionSuccess() << m;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-reshard exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Verify() must report one problem whose file + message contain every expected substring.
::testing::AssertionResult VerifyReports(const fs::path& path, const GoldenCase& c) {
  VerifyOptions o;
  o.path = path;
  o.threads = 2;
  VerifyReport r;
  try {
    r = Verify(o);
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "Verify threw: " << e.what();
  }
  std::string all;
  for (const auto& p : r.problems) {
    const std::string text = p.file + ": " + (p.tensor.empty() ? "" : "tensor \"" + p.tensor + "\": ") + p.message;
    all += "\n  " + text;
    if (std::all_of(c.contains.begin(), c.contains.end(),
                    [&](const std::string& n) { return text.find(n) != std::string::npos; })) {
      return ::testing::AssertionSuccess();
    }
  }
  return ::testing::AssertionFailure() << "no problem has all of the expected text; problems:"
                                       << (all.empty() ? " none" : all);
}

class GoldenTest : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(GoldenTest, RefusedWithItsError) {
  const GoldenCase& c = GetParam();
  const fs::path path = kGolden / c.file;
  ASSERT_TRUE(fs::exists(path)) << path;
  if (c.kind == "safetensors") {
    EXPECT_TRUE(Throws([&] { ReadSafetensorsHeader(path.string()); }, c));
    EXPECT_TRUE(Throws([&] { OpenCheckpoint(path); }, c));  // what convert and inspect do
  } else if (c.kind == "checkpoint") {
    EXPECT_TRUE(Throws([&] { OpenCheckpoint(path); }, c));
  } else if (c.kind == "manifest") {
    EXPECT_TRUE(Throws([&] { ReadManifest(path); }, c));
    EXPECT_TRUE(Throws([&] { Inspect(path); }, c));
  } else if (c.kind == "rank_open") {
    EXPECT_TRUE(Throws([&] { RankFileReader::Open(path); }, c));
    EXPECT_TRUE(Throws([&] { Inspect(path); }, c));
    EXPECT_TRUE(VerifyReports(path, c));
  } else if (c.kind == "rank_data") {
    // The preamble and header are intact; the data, or where the file sits, is not.
    RankFileReader r = RankFileReader::Open(path);
    EXPECT_TRUE(VerifyReports(path, c));
  } else if (c.kind == "rank_valid") {
    RankFileReader r = RankFileReader::Open(path);
    VerifyOptions o;
    o.path = path;
    o.threads = 2;
    const VerifyReport report = Verify(o);
    for (const auto& p : report.problems) ADD_FAILURE() << p.file << ": " << p.message;
    EXPECT_EQ(report.files, 1u);
    // Every tensor reads back through the reader too.
    for (const auto& t : r.header().tensors) {
      std::string buf(t.nbytes, '\0');
      r.ReadTensor(t, buf.data());
    }
  } else {
    FAIL() << "unknown kind \"" << c.kind << "\" in expectations.json";
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, GoldenTest, ::testing::ValuesIn(LoadCases()),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           std::string n = info.param.file;
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GoldenTest);

TEST(GoldenCorpus, TableListsEveryFileAndEnoughCases) {
  const auto cases = LoadCases();
  ASSERT_GE(cases.size(), 50u) << "tests/golden/expectations.json missing or short; run "
                                  "tests/golden/make_golden.py";
  std::set<fs::path> listed;
  for (const auto& c : cases) {
    const fs::path p = kGolden / c.file;
    EXPECT_TRUE(fs::exists(p)) << p;
    if (fs::is_directory(p)) {
      for (const auto& e : fs::recursive_directory_iterator(p)) listed.insert(e.path());
    } else {
      listed.insert(p);
    }
  }
  for (const auto& e : fs::recursive_directory_iterator(kGolden)) {
    if (!e.is_regular_file() || e.path().parent_path() == kGolden) continue;
    EXPECT_TRUE(listed.count(e.path())) << e.path() << " is in tests/golden but not in the table";
  }
  for (const std::string kind : {"safetensors", "rank_open", "rank_data", "checkpoint", "manifest"}) {
    EXPECT_TRUE(std::any_of(cases.begin(), cases.end(),
                            [&](const GoldenCase& c) { return c.kind == kind; }))
        << "no case of kind " << kind;
  }
}

// ---- fuzz regressions: each input once crashed a target; now each parser must refuse it
// with a reshard::Error or accept it, and never crash (the targets' own checks are in
// tests/fuzz/fuzz_*.cc; scripts/fuzz_ci.sh replays the files through the targets too).

std::vector<fs::path> Regressions(const std::string& target) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(kRegressions / target, ec)) {
    for (const auto& e : fs::directory_iterator(kRegressions / target)) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

template <typename Fn>
void NoCrash(const fs::path& file, Fn&& fn) {
  try {
    fn(test::ReadBytes(file));
  } catch (const Error&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << file << ": non-reshard exception " << e.what();
  }
}

TEST(FuzzRegressions, SafetensorsHeader) {
  for (const auto& f : Regressions("safetensors_header")) {
    NoCrash(f, [&](const std::string& b) { ParseSafetensorsHeader(b, b.size(), f.string()); });
  }
}

TEST(FuzzRegressions, IndexJson) {
  for (const auto& f : Regressions("index_json")) {
    NoCrash(f, [&](const std::string& b) { ParseWeightMap(b, f.string()); });
  }
}

TEST(FuzzRegressions, Manifest) {
  for (const auto& f : Regressions("manifest")) {
    NoCrash(f, [&](const std::string& b) { ParseManifest(b, f.string()); });
  }
}

TEST(FuzzRegressions, RankFile) {
  // Inputs are a preamble followed by the header (tests/fuzz/fuzz_rank_file.cc).
  for (const auto& f : Regressions("rank_file")) {
    NoCrash(f, [&](const std::string& b) {
      if (b.size() < kPreambleSize) return;
      const std::string_view header = std::string_view(b).substr(kPreambleSize);
      ParseHeader(header, UINT64_MAX / 2, f.string());
    });
  }
}

}  // namespace
}  // namespace reshard
