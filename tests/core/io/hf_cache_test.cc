// ResolveSource: model ids through a Hugging Face hub cache laid out as huggingface_hub writes
// it (models--Org--Name/{blobs,refs,snapshots}, snapshot files as relative symlinks into
// blobs/, refs/<name> holding the commit hash without a newline), and local paths first.
// tests/python/test_hf_cache.py checks the same layouts against huggingface_hub's own lookup.
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/io/hf_cache.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::ScopedEnv;
using test::ThrowsError;

constexpr const char* kMain = "0123456789abcdef0123456789abcdef01234567";
constexpr const char* kDev = "fedcba9876543210fedcba9876543210fedcba98";

// No variable of the host leaks into a test.
struct CleanEnv {
  ScopedEnv a{"HF_HUB_CACHE", std::nullopt}, b{"HUGGINGFACE_HUB_CACHE", std::nullopt},
      c{"HF_HOME", std::nullopt}, d{"XDG_CACHE_HOME", std::nullopt};
};

// One snapshot of repo `id` in `cache`: each file a blob named by its content, linked as
// huggingface_hub links it (snapshots/<commit>/<file> -> ../../blobs/<blob>).
void AddSnapshot(const fs::path& cache, const std::string& id, const std::string& commit,
                 const std::optional<std::string>& ref) {
  std::string folder = "models--" + id;
  for (size_t p; (p = folder.find('/')) != std::string::npos;) folder.replace(p, 1, "--");
  const fs::path repo = cache / folder;
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / commit);
  for (const std::string name : {"config.json", "model.safetensors"}) {
    const std::string blob = "blob-" + commit.substr(0, 8) + "-" + name;
    test::WriteBytes(repo / "blobs" / blob, name + " of " + commit);
    fs::create_symlink(fs::path("..") / ".." / "blobs" / blob, repo / "snapshots" / commit / name);
  }
  if (ref) {
    fs::create_directories((repo / "refs" / *ref).parent_path());
    test::WriteBytes(repo / "refs" / *ref, commit);  // no newline, as huggingface_hub writes it
  }
}

TEST(HfCache, ModelIdShape) {
  for (const char* ok : {"Qwen/Qwen2.5-0.5B", "gpt2", "meta-llama/Llama-3.2-1B", "a_b/c.d", "x/y"}) {
    EXPECT_TRUE(IsHfModelId(ok)) << ok;
  }
  for (const char* bad : {"", "/abs/path", "./Qwen", "../x", "a/b/c", "a//b", "a--b/c", "a/b..c",
                          "-a/b", "a/b-", "a/b.git", "~/models/x", "a b", "a/"}) {
    EXPECT_FALSE(IsHfModelId(bad)) << bad;
  }
  EXPECT_FALSE(IsHfModelId(std::string(97, 'a')));
  EXPECT_EQ(HfRepoCacheDir("/c", "Qwen/Qwen2.5-0.5B"), fs::path("/c/models--Qwen--Qwen2.5-0.5B"));
  EXPECT_EQ(HfRepoCacheDir("/c", "gpt2"), fs::path("/c/models--gpt2"));
}

TEST(HfCache, CacheDirFromTheEnvironment) {
  CleanEnv clean;
  ScopedEnv home("HOME", "/home/u");
  EXPECT_EQ(HfHubCacheDir(), fs::path("/home/u/.cache/huggingface/hub"));
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(HfHubCacheDir(), fs::path("/xdg/huggingface/hub"));
    ScopedEnv hf_home("HF_HOME", "~/hf");  // expanded as os.path.expanduser does
    EXPECT_EQ(HfHubCacheDir(), fs::path("/home/u/hf/hub"));
    ScopedEnv legacy("HUGGINGFACE_HUB_CACHE", "/legacy");
    EXPECT_EQ(HfHubCacheDir(), fs::path("/legacy"));
    ScopedEnv base("BASE", "/b");
    ScopedEnv hub("HF_HUB_CACHE", "${BASE}/hub-$BASE/$UNSET_VAR_FOR_TEST");
    EXPECT_EQ(HfHubCacheDir(), fs::path("/b/hub-/b/$UNSET_VAR_FOR_TEST"));
  }
}

TEST(HfCache, ResolvesRefsAndCommits) {
  CleanEnv clean;
  test::TempDir tmp;
  const fs::path cache = tmp / "hub";
  AddSnapshot(cache, "Org/Model", kMain, "main");
  AddSnapshot(cache, "Org/Model", kDev, "dev");
  AddSnapshot(cache, "Org/Model", std::string(40, 'a'), "refs/pr/1");
  const fs::path repo = cache / "models--Org--Model";
  ScopedEnv hub("HF_HUB_CACHE", cache.string());

  ResolvedSource r = ResolveSource("Org/Model");
  EXPECT_TRUE(r.from_cache);
  EXPECT_EQ(r.path, repo / "snapshots" / kMain);
  EXPECT_EQ(r.revision, "main");
  EXPECT_EQ(r.commit, kMain);
  EXPECT_EQ(r.model_id, "Org/Model");
  // The snapshot's files read through their symlinks.
  EXPECT_EQ(test::ReadBytes(r.path / "config.json"), std::string("config.json of ") + kMain);

  EXPECT_EQ(ResolveSource("Org/Model", "dev").path, repo / "snapshots" / kDev);
  EXPECT_EQ(ResolveSource("Org/Model", kDev).path, repo / "snapshots" / kDev);  // a commit hash
  EXPECT_EQ(ResolveSource("Org/Model", "refs/pr/1").path, repo / "snapshots" / std::string(40, 'a'));
  // An explicit cache directory wins over the environment.
  test::TempDir other;
  AddSnapshot(other.path(), "Org/Model", kDev, "main");
  EXPECT_EQ(ResolveSource("Org/Model", "", other.path()).path,
            other.path() / "models--Org--Model" / "snapshots" / kDev);
}

TEST(HfCache, HfHomeAndTheDefaultCache) {
  CleanEnv clean;
  test::TempDir tmp;
  AddSnapshot(tmp / "hfhome" / "hub", "gpt2", kMain, "main");
  {
    ScopedEnv hf_home("HF_HOME", (tmp / "hfhome").string());
    EXPECT_EQ(ResolveSource("gpt2").path, tmp / "hfhome" / "hub" / "models--gpt2" / "snapshots" / kMain);
  }
  AddSnapshot(tmp / "home" / ".cache" / "huggingface" / "hub", "gpt2", kDev, "main");
  ScopedEnv home("HOME", (tmp / "home").string());
  EXPECT_EQ(ResolveSource("gpt2").path,
            tmp / "home" / ".cache" / "huggingface" / "hub" / "models--gpt2" / "snapshots" / kDev);
}

TEST(HfCache, LocalPathWins) {
  CleanEnv clean;
  test::TempDir tmp;
  AddSnapshot(tmp / "hub", "Org/Model", kMain, "main");
  ScopedEnv hub("HF_HUB_CACHE", (tmp / "hub").string());
  fs::create_directories(tmp / "work" / "Org" / "Model");
  const fs::path cwd = fs::current_path();
  fs::current_path(tmp / "work");
  ResolvedSource r = ResolveSource("Org/Model");
  std::string message;
  const bool refused = ThrowsError([] { ResolveSource("Org/Model", "main"); },
                                   ErrorCode::kInvalidArgument, {"--revision main", "local path"},
                                   &message);
  fs::current_path(cwd);
  EXPECT_FALSE(r.from_cache);
  EXPECT_EQ(r.path, fs::path("Org/Model"));
  EXPECT_TRUE(refused) << message;
  // Absolute paths and files are used as they are.
  EXPECT_EQ(ResolveSource((tmp / "work").string()).path, tmp / "work");
}

TEST(HfCache, NotCachedSaysHowToDownload) {
  CleanEnv clean;
  test::TempDir tmp;
  ScopedEnv hub("HF_HUB_CACHE", (tmp / "hub").string());
  EXPECT_TRUE(ThrowsError([] { ResolveSource("Qwen/Qwen2.5-0.5B"); }, ErrorCode::kNotFound,
                          {"Qwen/Qwen2.5-0.5B: no such file or directory",
                           "not in the Hugging Face cache", "models--Qwen--Qwen2.5-0.5B",
                           "hf download Qwen/Qwen2.5-0.5B"}));
  AddSnapshot(tmp / "hub", "Qwen/Qwen2.5-0.5B", kMain, "main");
  EXPECT_TRUE(ThrowsError([] { ResolveSource("Qwen/Qwen2.5-0.5B", "v2"); }, ErrorCode::kNotFound,
                          {"revision v2 is not in the Hugging Face cache", "cached refs: main",
                           kMain, "hf download Qwen/Qwen2.5-0.5B --revision v2"}));
  EXPECT_TRUE(ThrowsError([] { ResolveSource("Qwen/Qwen2.5-0.5B", kDev); }, ErrorCode::kNotFound,
                          {"has no snapshot", kDev, "hf download Qwen/Qwen2.5-0.5B --revision"}));
  // A ref whose snapshot was deleted.
  fs::remove_all(tmp / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / kMain);
  EXPECT_TRUE(ThrowsError([] { ResolveSource("Qwen/Qwen2.5-0.5B"); }, ErrorCode::kNotFound,
                          {"revision main (commit " + std::string(kMain) + ") has no snapshot"}));
  EXPECT_TRUE(ThrowsError([] { ResolveSource("Qwen/Qwen2.5-0.5B", "../../etc"); },
                          ErrorCode::kInvalidArgument, {"not a revision name"}));
  // Not an id and not a path.
  EXPECT_TRUE(ThrowsError([&] { ResolveSource((tmp / "missing").string()); }, ErrorCode::kNotFound,
                          {"missing: no such file or directory"}));
}

}  // namespace
}  // namespace reshard
