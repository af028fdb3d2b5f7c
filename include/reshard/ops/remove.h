// Removing layouts from an output directory (`reshard remove OUT KEY...`): their entries in
// reshard.json, then their directories (rank files, optim/, parallel plan).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace reshard {

struct RemoveResult {
  std::vector<std::string> removed;    // keys taken out of the manifest, their directories deleted
  std::vector<std::string> unlinked;   // layouts made from a removed one: they stand alone now
  std::vector<std::string> remaining;  // keys the manifest lists afterwards
};

/// Takes `keys` out of OUT's manifest (atomically, under OUT's lock, waiting up to
/// `lock_wait_seconds` for a convert, relayout or save that holds it), then deletes their
/// directories. A layout made from a removed one by `reshard relayout` keeps its files and
/// loses its `from` (verify then checks it by its checksums alone). Refused, nothing changed:
/// a key the manifest does not list, every layout of OUT at once (delete OUT instead), part of
/// an expert-parallel save without its other parts. Throws reshard::Error.
RemoveResult RemoveLayouts(const std::filesystem::path& out, const std::vector<std::string>& keys,
                           double lock_wait_seconds = 600);

}  // namespace reshard
