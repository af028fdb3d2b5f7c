// Where a checkpoint named on the command line lives: a local path, or a Hugging Face model id
// ("Qwen/Qwen2.5-0.5B") found in the local Hugging Face hub cache, as huggingface_hub lays it
// out. The one rule for the CLI (convert's SRC, verify --source, inspect PATH) and for Python
// (reshard._C.resolve_source: reshard.empty_model, check_weights' reference). Never uses the
// network.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace reshard {

/// The hub cache directory as huggingface_hub computes it: $HF_HUB_CACHE, else the legacy
/// $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
/// ~/.cache/huggingface/hub (a leading ~ and $VAR / ${VAR} in the variables are expanded, as
/// os.path.expanduser and os.path.expandvars do).
std::filesystem::path HfHubCacheDir();

/// Whether `text` has the shape of a Hugging Face repository id, as huggingface_hub's
/// validate_repo_id checks it: "Name" or "Org/Name", each part of letters, digits, '_', '-'
/// and '.', starting and ending with a letter, digit or '_', no "--" or "..", not ending in
/// ".git", at most 96 characters.
bool IsHfModelId(std::string_view text);

/// The cache folder of model `model_id`: <cache>/models--Org--Name.
std::filesystem::path HfRepoCacheDir(const std::filesystem::path& cache, std::string_view model_id);

struct ResolvedSource {
  std::filesystem::path path;  // the directory or file to read
  bool from_cache = false;     // a model id resolved through the hub cache
  std::string model_id;        // from_cache: the id
  std::string revision;        // from_cache: the revision asked for ("main" by default)
  std::string commit;          // from_cache: the snapshot's commit hash
};

/// Resolves `source` as the CLI's SRC:
///  1. a path that exists (file, directory or symlink to one) is used as it is, even when it
///     also has the shape of a model id: a local path wins;
///  2. otherwise a model id is looked up in `cache` (default HfHubCacheDir()):
///     models--Org--Name/refs/<revision> holds the commit hash of snapshots/<commit>/, whose
///     files are symlinks into blobs/; `revision` is a ref name (default "main", e.g. a
///     branch or tag) or a 40-digit commit hash with a snapshot in the cache;
///  3. anything else is kNotFound.
/// Throws kNotFound when the id (or that revision of it) is not cached, naming the cache
/// directory looked in and the `hf download` command that fetches it; kInvalidArgument for a
/// revision given with a local path or a malformed revision.
ResolvedSource ResolveSource(const std::string& source, const std::string& revision = "",
                             const std::optional<std::filesystem::path>& cache = std::nullopt);

}  // namespace reshard
