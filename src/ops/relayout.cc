#include "reshard/ops/relayout.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <mutex>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "format/json_util.h"
#include "reshard/ops/path_hint.h"
#include "ops/rank_fill.h"
#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/format/manifest.h"
#include "reshard/format/model_manifest.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/io/file_io.h"
#include "reshard/io/parallel_for.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/io/rank_file_writer.h"
#include "reshard/ops/layout_reader.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/fsdp1.h"
#include "reshard/plan/optim_state.h"
#include "reshard/plan/rank_plan.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxOpenRankFiles = 64;
constexpr std::string_view kOptimDir = "optim";
constexpr std::string_view kOptimJson = "optimizer.json";
// DTensor targets: the plan's canonical form beside the rank files, so that verify plans the
// layout again (its xxh3 is the layout's plan.xxh3).
constexpr std::string_view kPlanJson = "parallel-plan.json";

// Optimizer state moves between two layout kinds when both hold one tensor per original
// parameter (FSDP2 and DTensor layouts: state elementwise, shaped and placed like its
// parameter), not across flat parameters (FSDP1) or use_orig_params.
bool OptimizerMoves(const LayoutSpec& a, const LayoutSpec& b) {
  auto per_param = [](const LayoutSpec& l) { return l.kind == LayoutKind::kFsdp2 || l.kind == LayoutKind::kDTensor; };
  if (per_param(a) && per_param(b)) return true;
  return a.kind == b.kind && a.use_orig_params == b.use_orig_params;
}

// Layouts that hold part of the model (an expert-parallel save: ManifestLayout::parts) are not
// made into another layout: none alone is the model, and no plan describes their union.
void RefusePart(const Manifest& m, const std::string& key, const std::string& mpath) {
  const ManifestLayout& l = m.layouts.at(key);
  if (l.parts.empty()) return;
  std::string parts;
  for (const auto& k : l.parts) parts += (parts.empty() ? "" : " + ") + k;
  Fail(ErrorCode::kMismatch,
       mpath + ": layout " + key + " holds part of the model only (an expert-parallel save, written as " +
           parts + "): reshard relayout cannot make another layout of such a save; resume it in the same "
           "arrangement (reshard.load + reshard.load_optimizer), or export each part (reshard export OUT "
           "--layout KEY)");
}

// The source layout: its key, unless --from names it, is the one complete layout of OUT that
// is not the target (preferring the ones with optimizer state).
std::string PickSource(const RelayoutOptions& o, const Manifest& m, const std::string& mpath,
                       const std::string& target_key) {
  if (o.from) {
    if (!m.layouts.count(*o.from)) {
      std::string have;
      for (const auto& [k, _] : m.layouts) have += (have.empty() ? "" : ", ") + k;
      Fail(ErrorCode::kNotFound, mpath + ": --from " + *o.from + ": no such layout (found: " + have + ")");
    }
    RefusePart(m, *o.from, mpath);
    return *o.from;
  }
  // Layouts made by relayout are copies: the original (the save's, or a conversion) is read.
  std::vector<std::string> all, with_optim;
  for (const auto& [k, l] : m.layouts) {
    if (k == target_key || !l.complete || !l.from.empty() || !l.parts.empty()) continue;
    all.push_back(k);
    std::error_code ec;
    if (fs::exists(o.out / (l.dir.empty() ? k : l.dir) / kOptimDir / kOptimJson, ec)) with_optim.push_back(k);
  }
  const std::vector<std::string>& pick = with_optim.empty() ? all : with_optim;
  if (pick.size() == 1) return pick.front();
  if (pick.empty()) {
    for (const auto& [k, l] : m.layouts) {
      if (k != target_key && l.complete && !l.parts.empty()) RefusePart(m, k, mpath);
    }
  }
  if (pick.empty() && m.layouts.count(target_key)) {
    // Copies made from it are there: it is the original, listed, perhaps damaged or gone.
    std::string copies;
    for (const auto& [k, l] : m.layouts) {
      if (k != target_key && l.complete && l.parts.empty()) copies += (copies.empty() ? "" : ", ") + k;
    }
    if (!copies.empty()) {
      Fail(ErrorCode::kMismatch,
           mpath + ": the new layout " + target_key + " is already listed, as this checkpoint's own (the others, " +
               copies + ", were made from it); nothing was written. If it is damaged or gone (reshard verify " +
               o.out.string() + " says), take it out and make it from one of them: reshard remove " +
               o.out.string() + " " + target_key + ", then this command with --from KEY");
    }
    Fail(ErrorCode::kMismatch, mpath + ": the new layout " + target_key + " is the source layout " +
                                          "(OUT holds no other complete layout to make it from): nothing to do");
  }
  if (pick.empty()) {
    Fail(ErrorCode::kNotFound, mpath + ": no complete layout other than " + target_key +
                                   " to make it from (found " + std::to_string(m.layouts.size()) +
                                   " layout(s))");
  }
  std::string names;
  for (const auto& k : pick) names += (names.empty() ? "" : ", ") + k;
  Fail(ErrorCode::kMismatch, mpath + ": several layouts to make " + target_key + " from (" + names +
                                        "); pass --from KEY");
}

// Refuses a new layout whose optimizer parameters differ from the source's (flat or original
// ones), when the source has optimizer state (`meta_path`: its optimizer.json), with the
// weights-only way.
void RefuseOptimizerKinds(const fs::path& given, const std::string& meta_path, const std::string& from,
                          const LayoutSpec& source_spec, const LayoutSpec& target) {
  if (OptimizerMoves(source_spec, target)) return;
  fs::path out = given.lexically_normal();  // "ckpt/" -> "ckpt": the names below sit beside it
  if (!out.has_filename() && out.has_parent_path()) out = out.parent_path();
  Fail(ErrorCode::kUnsupported,
       meta_path + ": optimizer state of layout " + from + " (" + source_spec.KindName() +
           (source_spec.use_orig_params ? ", use_orig_params" : "") + ") into " + target.Key() + " (" +
           target.KindName() + (target.use_orig_params ? ", use_orig_params" : "") +
           "): the optimizer's parameters differ between these kinds (flat parameters or original "
           "ones), which this version does not translate; reshard to a layout of the same kind, "
           "or between fsdp2 and dtensor. For the weights alone (the optimizer starting afresh): "
           "reshard export " + out.string() + " -o " + out.string() + "-hf --layout " + from +
           ", then reshard convert " +
           out.string() + "-hf -o " + out.string() + "-" + target.KindName() + "-ws" +
           std::to_string(target.world_size) + " " + target.ConvertFlags() +
           " (or reshard.load the exported directory as it is)");
}

// The optimizer state of the source layout, when saved: optimizer.json and every rank file.
struct SourceOptim {
  nlohmann::json meta;
  std::string meta_path;
  LayoutBytes bytes;
  Checkpoint view;
  std::map<std::string, nlohmann::json> scalars;  // parameter -> its scalars
};

bool OpenOptim(const fs::path& src_dir, const std::string& key, const Manifest& manifest,
               const RankFileHeader& model0, SourceOptim& so) {
  const fs::path dir = src_dir / kOptimDir;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return false;
  const fs::path meta = dir / kOptimJson;
  so.meta_path = meta.string();
  if (!fs::is_regular_file(meta, ec)) {
    Fail(ErrorCode::kNotFound, so.meta_path + ": missing: the optimizer state of layout " + key +
                                   " is incomplete (a save that did not finish); nothing was written");
  }
  so.meta = internal::ParseStrictJson(ReadWholeFile(meta, 256ull << 20), so.meta_path, "optimizer.json");
  const auto& j = so.meta;
  if (!j.is_object() || !j.contains("format") || j["format"] != "reshard.optimizer" ||
      !j.contains("format_version") || j["format_version"] != 1) {
    Fail(ErrorCode::kDataLoss, so.meta_path + ": format: found " +
                                   (j.is_object() && j.contains("format") ? internal::Describe(j["format"]) : "nothing") +
                                   ", expected \"reshard.optimizer\" of format_version 1");
  }
  if (j.contains("layout") && j["layout"] != key) {
    Fail(ErrorCode::kMismatch, so.meta_path + ": layout: found " + internal::Describe(j["layout"]) +
                                   ", expected \"" + key + "\" (the directory it is in)");
  }
  const uint32_t world = model0.world_size;
  std::vector<const RankFileHeader*> headers;
  std::vector<std::string> paths;
  for (uint32_t r = 0; r < world; ++r) {
    const fs::path p = dir / RankFileName(r, world);
    if (!fs::exists(p, ec)) {
      Fail(ErrorCode::kNotFound, p.string() + ": missing: the optimizer state of rank " + std::to_string(r) +
                                     " of layout " + key + " (optimizer.json is there); nothing was written");
    }
    so.bytes.readers.push_back(RankFileReader::Open(p));
    const RankFileHeader& h = so.bytes.readers.back().header();
    if (h.rank != r || h.layout_key != key || !(h.source == manifest.source)) {
      Fail(ErrorCode::kMismatch, p.string() + ": holds rank " + std::to_string(h.rank) + " of layout " +
                                     h.layout_key + ", source " + Hex16(h.source.fingerprint) +
                                     "; expected rank " + std::to_string(r) + " of " + key + ", source " +
                                     Hex16(manifest.source.fingerprint) + " (the manifest's)");
    }
  }
  for (const RankFileReader& r : so.bytes.readers) {
    headers.push_back(&r.header());
    paths.push_back(r.path());
  }
  so.bytes.tensors = DescribeOptimizerTensors(model0, headers, paths);
  so.view = so.bytes.Index(dir, manifest.source);
  // Scalars by parameter: "state", or the first rank listing the parameter in "rank_state".
  auto take = [&](const nlohmann::json& state, const std::string& field) {
    for (const auto& [param, desc] : internal::GetObject(state, so.meta_path, field).items()) {
      if (so.scalars.count(param)) continue;
      const auto& d = internal::GetObject(desc, so.meta_path, field + "[\"" + param + "\"]");
      so.scalars[param] = d.contains("scalars") ? d["scalars"] : nlohmann::json::object();
    }
  };
  if (j.contains("rank_state")) {
    const auto& rs = internal::GetArray(j["rank_state"], so.meta_path, "rank_state");
    if (rs.size() != world) {
      Fail(ErrorCode::kDataLoss, so.meta_path + ": rank_state: found " + std::to_string(rs.size()) +
                                     " shard coordinates, expected " + std::to_string(world));
    }
    for (size_t r = 0; r < rs.size(); ++r) take(rs[r], "rank_state[" + std::to_string(r) + "]");
  } else {
    take(internal::Member(j, "state", so.meta_path, "state"), "state");
  }
  return true;
}

// OUT/reshard-model.json (or the option) parsed; nullopt when absent.
std::optional<ModelManifest> ModelManifestOf(const RelayoutOptions& o) {
  const fs::path p = o.model_manifest ? *o.model_manifest : o.out / kModelManifestName;
  std::error_code ec;
  if (!fs::exists(p, ec)) {
    if (o.model_manifest) Fail(ErrorCode::kNotFound, p.string() + ": no such file");
    return std::nullopt;
  }
  return ReadModelManifest(p);
}

// The planning both a relayout and its check share: the source layout (and optimizer state)
// opened as virtual checkpoints, and each target rank file's job (header and byte maps).
struct RelayoutPlanner {
  RelayoutPlanner(const fs::path& out, const Manifest& manifest, const std::string& from,
                  const LayoutSpec& target, const std::optional<ModelManifest>& model, uint64_t chunk_size,
                  std::optional<ParallelPlan> plan = std::nullopt, std::string plan_path = "")
      : out_(out), manifest_(manifest), target_(target), chunk_size_(chunk_size), plan_(std::move(plan)),
        plan_path_(std::move(plan_path)) {
    if (target.kind == LayoutKind::kDTensor && !plan_) {
      Fail(ErrorCode::kInvalidArgument, "layout " + target.Key() + ": a DTensor layout needs its parallel plan (--plan)");
    }
    const LayoutSpec source_spec = manifest.layouts.at(from).Layout();
    OpenLayout(out, manifest, from, src);
    const RankFileHeader& model0 = src.bytes.readers.front().header();
    optim = OpenOptim(src.dir, from, manifest, model0, so);
    if (optim) RefuseOptimizerKinds(out, so.meta_path, from, source_spec, target);
    // Tensors stored whole in the source (buffers) stay whole in an FSDP2 target, as do the
    // model manifest's persistent buffers.
    // A DTensor source: Replicate everywhere outside fully_shard is a buffer only when
    // fully_shard sharded the other tensors (it shards every parameter of a job, formats/
    // parallel-plan.md); else a replicated parameter, sharded in an FSDP2 target.
    bool fsdp = false;
    for (const TensorEntry& e : model0.tensors) fsdp = fsdp || (e.dtensor && e.dtensor->fsdp_mesh_dim >= 0);
    for (const TensorEntry& e : model0.tensors) {
      if (e.flat || e.global_shape.empty()) continue;
      if (e.dtensor) {
        const auto& pl = e.dtensor->placements;
        if (fsdp && e.dtensor->fsdp_mesh_dim < 0 &&
            std::none_of(pl.begin(), pl.end(), [](const Placement& x) { return x.IsShard(); })) {
          whole_.insert(e.name);
        }
      } else if (!e.sharded) {
        whole_.insert(e.name);
      }
    }
    if (model) {
      for (const ModelBuffer& b : model->buffers) {
        if (b.persistent && src.view.Find(b.name)) whole_.insert(b.name);
      }
    }
    if (target.kind == LayoutKind::kFsdp1) units_ = PlanFsdp1(src.view, *model, target);
    model_lookup = [this](std::string_view n) { return src.view.Find(n); };
    optim_lookup = [this](std::string_view n) { return so.view.Find(n); };
  }
  RelayoutPlanner(const RelayoutPlanner&) = delete;

  RankFileHeader Header(uint32_t r) const {
    RankFileHeader h;
    h.writer = std::string(WriterString());
    h.SetLayout(target_);
    h.rank = r;
    h.source = manifest_.source;
    h.chunk_size = chunk_size_;
    return h;
  }

  // The model rank file of rank r: planned entries and their (checked) maps.
  RankFileJob ModelJob(uint32_t r) const {
    const RankPlan plan = units_ ? PlanRank(src.view, target_, *units_, r)
                          : plan_  ? PlanRank(src.view, target_, *plan_, r, whole_, plan_path_)
                                   : PlanRank(src.view, target_, r, whole_);
    RankFileJob job;
    job.rank = r;
    job.path = out_ / target_.Key() / RankFileName(r, target_.world_size);
    job.header = Header(r);
    for (const PlannedTensor& p : plan.tensors) {
      TensorEntry e = PlannedEntry(p);
      job.header.tensors.push_back(e);
      e.nbytes = p.nbytes;
      EntryMap map = MapEntry(e, target_.kind, target_.world_size, r, job.path.string());
      if (const std::string why = CheckSources(map, model_lookup); !why.empty()) {
        Fail(ErrorCode::kMismatch, job.path.string() + ": tensor \"" + e.name + "\": " + why);
      }
      job.maps.push_back(std::move(map));
    }
    return job;
  }

  // The optimizer rank file of rank r (`model_header`: its model rank file's planned header);
  // its planned states go to `states` (for optimizer.json).
  RankFileJob OptimJob(uint32_t r, const RankFileHeader& model_header, std::vector<PlannedState>& states) const {
    RankFileJob job;
    job.rank = r;
    job.path = out_ / target_.Key() / kOptimDir / RankFileName(r, target_.world_size);
    job.header = Header(r);
    states = PlanOptimizerRank(so.view, target_, r, model_header, job.path.string());
    for (const PlannedState& s : states) {
      TensorEntry e = s.entry;
      e.nbytes = 0;  // laid out by the writer
      job.header.tensors.push_back(std::move(e));
      if (const std::string why = CheckSources(s.map, optim_lookup); !why.empty()) {
        Fail(ErrorCode::kMismatch, job.path.string() + ": tensor \"" + s.entry.name + "\": " + why);
      }
      job.maps.push_back(s.map);
    }
    return job;
  }

  OpenedLayout src;
  SourceOptim so;
  bool optim = false;
  SourceLookup model_lookup, optim_lookup;

 private:
  fs::path out_;
  const Manifest& manifest_;
  LayoutSpec target_;
  uint64_t chunk_size_;
  std::set<std::string> whole_;
  std::optional<Fsdp1Plan> units_;
  std::optional<ParallelPlan> plan_;
  std::string plan_path_;
};

}  // namespace

std::optional<std::pair<uint32_t, uint32_t>> SplitRanks(uint32_t world_size, uint32_t index, uint32_t count) {
  if (count == 0 || index >= count) {
    Fail(ErrorCode::kInvalidArgument, "process " + std::to_string(index) + " of " + std::to_string(count) +
                                          ": expected an index below the count");
  }
  const uint32_t base = world_size / count, extra = world_size % count;
  const uint32_t first = index * base + std::min(index, extra);
  const uint32_t n = base + (index < extra ? 1 : 0);
  if (n == 0) return std::nullopt;
  return std::make_pair(first, first + n - 1);
}

std::pair<uint32_t, uint32_t> LauncherProcess(const std::function<const char*(const char*)>& getenv,
                                              std::string& what) {
  auto number = [&](const char* name) -> uint64_t {
    const char* v = getenv(name);
    uint64_t x = 0;
    const std::string_view s = v ? v : "";
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || x > 1000000) {
      Fail(ErrorCode::kInvalidArgument, std::string("--split-from-env: ") + name + "=" + Printable(s) +
                                            ": expected a whole number");
    }
    return x;
  };
  auto pair = [&](const char* id, const char* count, uint64_t first) {
    const uint64_t i = number(id), n = number(count);
    if (i < first || i - first >= n) {
      Fail(ErrorCode::kInvalidArgument, std::string("--split-from-env: ") + id + "=" + std::to_string(i) +
                                            " is outside the " + std::to_string(n) + " processes of " + count);
    }
    what = std::string(id) + "=" + std::to_string(i) + " of " + count + "=" + std::to_string(n);
    return std::make_pair(static_cast<uint32_t>(i - first), static_cast<uint32_t>(n));
  };
  if (getenv("SLURM_ARRAY_TASK_ID") && getenv("SLURM_ARRAY_TASK_COUNT")) {
    return pair("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT",
                getenv("SLURM_ARRAY_TASK_MIN") ? number("SLURM_ARRAY_TASK_MIN") : 0);
  }
  if (getenv("RANK") && getenv("WORLD_SIZE")) return pair("RANK", "WORLD_SIZE", 0);
  if (getenv("SLURM_PROCID") && getenv("SLURM_NTASKS")) return pair("SLURM_PROCID", "SLURM_NTASKS", 0);
  // Half a pair set (RANK without WORLD_SIZE, ...): name what is there and what is missing.
  std::string half;
  for (const auto& [a, b] : {std::pair{"SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"}, std::pair{"RANK", "WORLD_SIZE"},
                             std::pair{"SLURM_PROCID", "SLURM_NTASKS"}}) {
    if ((getenv(a) != nullptr) != (getenv(b) != nullptr)) {
      const char* set = getenv(a) ? a : b;
      half += std::string(half.empty() ? "" : "; ") + set + "=" + Printable(getenv(set)) + " is set but " +
              (getenv(a) ? b : a) + " is not";
    }
  }
  Fail(ErrorCode::kInvalidArgument,
       "--split-from-env: " + (half.empty() ? std::string("none of ") : half + ", and no complete pair of ") +
           "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (a Slurm array), RANK/WORLD_SIZE (torchrun) or "
           "SLURM_PROCID/SLURM_NTASKS (srun) is set; run under a launcher, or pass --ranks A-B");
}

RelayoutResult Relayout(const RelayoutOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string mpath = (o.out / kManifestName).string();
  std::optional<Manifest> manifest = ReadManifest(o.out);
  if (!manifest) {
    const std::string hint = PathHint(o.out);
    if (!hint.empty()) Fail(ErrorCode::kNotFound, o.out.string() + ": " + hint);
    Fail(ErrorCode::kNotFound, mpath + ": no such file: " + o.out.string() +
                                   " is not a complete checkpoint (reshard.save) or conversion");
  }
  // DTensor targets: the mesh gives the world size, the plan the placements.
  std::optional<ParallelPlan> parallel;
  uint32_t world_size = o.world_size;
  if (o.mesh.has_value() != o.plan_file.has_value()) {
    Fail(ErrorCode::kInvalidArgument, o.mesh ? "--mesh needs --plan FILE (formats/parallel-plan.md), as reshard convert"
                                             : "--plan needs --mesh (a DTensor layout), e.g. --mesh dp_shard=1,tp=4");
  }
  if (o.mesh) {
    o.mesh->Check("--mesh " + o.mesh->Flag());
    if (o.world_size != 0 && o.world_size != o.mesh->Size()) {
      Fail(ErrorCode::kInvalidArgument, "--world-size " + std::to_string(o.world_size) + " with --mesh " +
                                            o.mesh->Flag() + " of " + std::to_string(o.mesh->Size()) +
                                            " ranks: give --mesh alone");
    }
    if (o.kind && *o.kind != LayoutKind::kDTensor) {
      Fail(ErrorCode::kInvalidArgument, "--layout " + std::string(o.kind == LayoutKind::kFsdp1 ? "fsdp1" : "fsdp2") +
                                            " with --mesh: a mesh makes a DTensor layout; drop one of them");
    }
    world_size = static_cast<uint32_t>(std::min<uint64_t>(o.mesh->Size(), 100000));
    parallel = ParseParallelPlan(ReadWholeFile(*o.plan_file, 64ull << 20), o.plan_file->string());
  }
  if (world_size == 0 || world_size > 99999) {
    Fail(ErrorCode::kInvalidArgument, "--world-size " + std::to_string(world_size) + ": expected 1 to 99999");
  }
  if (o.chunk_size == 0 || o.chunk_size % kDataAlignment != 0 || o.chunk_size > kMaxConvertChunkSize) {
    Fail(ErrorCode::kInvalidArgument, "--chunk-size " + std::to_string(o.chunk_size) +
                                          ": expected a positive multiple of 4096 up to 1 GiB");
  }
  // The target: the source's kind and fields unless given.
  std::optional<ModelManifest> model = ModelManifestOf(o);
  auto target_of = [&](const LayoutSpec* src) {
    LayoutSpec t;
    // The source's kind unless given; a DTensor layout needs a mesh and a plan, so without
    // --mesh a DTensor source becomes FSDP2.
    t.kind = o.mesh ? LayoutKind::kDTensor
             : o.kind ? *o.kind
             : src && src->kind != LayoutKind::kDTensor ? src->kind
                                                        : LayoutKind::kFsdp2;
    if (t.kind == LayoutKind::kDTensor && !o.mesh) {
      Fail(ErrorCode::kInvalidArgument, "--layout dtensor needs --mesh and --plan: reshard relayout " +
                                            o.out.string() + " --mesh dp_shard=1,tp=4 --plan PLAN.json");
    }
    t.world_size = world_size;
    if (parallel) {
      t.mesh = *o.mesh;
      t.plan_name = parallel->name;
      t.plan_xxh3 = parallel->xxh3;
    }
    t.dtype = src ? src->dtype : "keep";
    const bool same_kind = src && src->kind == t.kind;
    if (t.kind == LayoutKind::kFsdp1) {
      t.wrap = o.wrap ? *o.wrap : same_kind ? src->wrap : std::vector<std::string>{};
      t.use_orig_params = o.use_orig_params ? *o.use_orig_params : same_kind && src->use_orig_params;
      t.param_dtype = o.param_dtype ? *o.param_dtype : same_kind ? src->param_dtype : "";
      if (t.wrap.empty() && model) {
        std::set<std::string> have;
        for (const ModelModule& m : model->modules) have.insert(m.cls);
        for (const std::string& c : model->no_split_modules) {
          if (have.count(c)) t.wrap.push_back(c);
        }
      }
    }
    t.Normalize();
    return t;
  };
  // The source key may depend on the target key (not itself): plan the target from the
  // named source, or from the defaults first.
  LayoutSpec target = target_of(nullptr);
  const std::string from = PickSource(o, *manifest, mpath, target.Key());
  const LayoutSpec source_spec = manifest->layouts.at(from).Layout();
  target = target_of(&source_spec);
  const std::string key = target.Key();
  if (key == from) {
    Fail(ErrorCode::kMismatch, mpath + ": the new layout " + key + " is the source layout " + from +
                                          " (the same world size, kind" + (o.mesh ? ", mesh and plan" : "") +
                                          "): nothing to do");
  }
  // An original layout (the save's own, or a conversion's: no `from`) is what the others are
  // made from and what `verify` compares them with: never rewritten from one of its copies.
  if (auto it = manifest->layouts.find(key); it != manifest->layouts.end() && it->second.from.empty()) {
    Fail(ErrorCode::kMismatch, mpath + ": the new layout " + key + " is already there, and it is not a "
                                          "copy made by relayout but this checkpoint's own (" +
                                          (manifest->source.saved ? "saved" : "converted") +
                                          "): relayout never rewrites it from " + from +
                                          "; nothing was written (check it with: reshard verify " + o.out.string() +
                                          "; if it is damaged or gone, take it out first: reshard remove " +
                                          o.out.string() + " " + key + ", then run this again)");
  }
  uint32_t first = 0, last = target.world_size - 1;
  if (o.ranks) {
    std::tie(first, last) = *o.ranks;
    if (first > last || last >= target.world_size) {
      Fail(ErrorCode::kInvalidArgument, "--ranks " + std::to_string(first) + "-" + std::to_string(last) +
                                            " is not a range inside 0-" + std::to_string(target.world_size - 1));
    }
  }
  // Optimizer state that cannot move is said first: what follows would not make it movable.
  {
    const fs::path meta = o.out / manifest->layouts.at(from).dir / kOptimDir / kOptimJson;
    std::error_code ec;
    if (fs::exists(meta.parent_path(), ec)) RefuseOptimizerKinds(o.out, meta.string(), from, source_spec, target);
  }
  if (target.kind == LayoutKind::kFsdp1 && !model) {
    // A checkpoint reshard.save wrote builds its model from its own config.json.
    const std::string from_dir = manifest->source.saved ? o.out.string() : std::string("HF_DIR");
    Fail(ErrorCode::kNotFound, (o.out / kModelManifestName).string() +
                                   ": missing: an FSDP1 layout is planned from the model manifest (its units "
                                   "and parameter order); capture it with python -m reshard.model_manifest " +
                                   from_dir + " -o " + (o.out / kModelManifestName).string() +
                                   ", or pass --model-manifest");
  }

  RelayoutPlanner planner(o.out, *manifest, from, target, model, o.chunk_size, parallel,
                          o.plan_file ? o.plan_file->string() : "");
  const bool optim = planner.optim;
  const SourceLookup& model_lookup = planner.model_lookup;
  const SourceLookup& optim_lookup = planner.optim_lookup;
  OpenedLayout& src = planner.src;
  SourceOptim& so = planner.so;
  const fs::path dir = o.out / key;
  const fs::path odir = dir / kOptimDir;
  std::vector<std::vector<PlannedState>> states_of_rank(target.world_size);
  auto model_job = [&](uint32_t r) { return planner.ModelJob(r); };
  auto optim_job = [&](uint32_t r, const RankFileHeader& h) { return planner.OptimJob(r, h, states_of_rank[r]); };

  std::error_code ec;
  auto lock = std::make_unique<DirectoryLock>(o.out / kLockName, o.lock_wait_seconds);
  std::string held_owner, held_by;
  const std::string fp = Hex16(manifest->source.fingerprint);
  std::optional<SharedClaim> claim = SharedClaim::Take(
      o.out / kConvertClaimName, fp,
      "reshard relayout " + Printable(fs::absolute(o.out, ec).string()) + " --from " + from + " (source fingerprint " +
          fp + "), pid " + std::to_string(::getpid()) + " on " + SafeHostName(),
      &held_owner, &held_by);
  if (!claim) {
    Fail(ErrorCode::kBusy, o.out.string() + ": a conversion of another source (fingerprint " + held_owner +
                               ") into this directory is running: " + held_by + "; nothing was written");
  }
  fs::create_directories(optim ? odir : dir, ec);
  if (ec) Fail(ErrorCode::kIo, (optim ? odir : dir).string() + ": cannot create (" + ec.message() + ")");
  RemoveStaleTemporaries(dir);
  if (optim) RemoveStaleTemporaries(odir);
  lock.reset();  // rank files need no lock: each is written under a private name and renamed

  RelayoutResult result;
  result.from_key = from;
  result.layout_key = key;
  result.layout_dir = dir;
  result.world_size = target.world_size;
  result.optimizer = optim;
  // Default: twice the cores. A relayout waits on the disk (each worker reads a 256 KiB chunk,
  // hashes it and writes it), so more reads in flight, not more CPU, is what speeds it up: the
  // ~7B save (42.11 GB, read from the GPU machine's disk) took 28.1 s with 32 workers against
  // 29.4-31.0 s with 16 (bench/HISTORY.md section 17).
  const unsigned threads = o.threads ? o.threads : 2 * std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> done{0};
  uint64_t total = 0;
  std::vector<RankFileJob> mjobs, ojobs;
  auto flush = [&] {
    RankFillOptions fo;
    fo.codec = o.codec;
    fo.zstd_level = o.zstd_level;
    fo.threads = threads;
    fo.done_bytes = &done;
    if (o.progress) fo.progress = [&] { o.progress(done.load(), total); };
    // One reader per thread; every chunk read is checked (verify = true).
    // Optimizer files first: a run killed in between leaves model rank files missing, so that
    // not even `reshard verify OUT/NEWKEY` passes on a layout whose state is not all there.
    const RankFillStats b = WriteRankFiles(ojobs, optim_lookup, [&]() -> SourceRead {
      auto reader = std::make_shared<LayoutByteReader>(so.bytes, true);
      return [reader](size_t, uint64_t at, size_t n, void* d) { reader->Read(at, n, d); };
    }, fo);
    const RankFillStats a = WriteRankFiles(mjobs, model_lookup, [&]() -> SourceRead {
      auto reader = std::make_shared<LayoutByteReader>(src.bytes, true);
      return [reader](size_t, uint64_t at, size_t n, void* d) { reader->Read(at, n, d); };
    }, fo);
    result.bytes_read += a.bytes_read + b.bytes_read;
    result.bytes_decoded += a.bytes_decoded + b.bytes_decoded;
    result.bytes_stored += a.bytes_stored + b.bytes_stored;
    mjobs.clear();
    ojobs.clear();
  };
  for (uint32_t r = first; !o.commit_only && r <= last; ++r) {
    RankFileJob mj = model_job(r);
    // The model file and the optimizer file of a rank are judged apart: a run killed after a
    // rank's optimizer file (written first) left it complete, and a re-run writes only the
    // model file (the optimizer state is most of the bytes).
    std::string damage, optim_damage;
    const bool model_fresh = RankFileUpToDate(mj.path, mj.header, o.codec, /*check_data=*/true, threads, &damage);
    std::optional<RankFileJob> oj;
    bool optim_fresh = true;
    if (optim) {
      oj = optim_job(r, mj.header);
      optim_fresh = RankFileUpToDate(oj->path, oj->header, o.codec, /*check_data=*/true, threads, &optim_damage);
    }
    if (model_fresh && optim_fresh) {
      result.ranks_up_to_date.push_back(r);
      continue;
    }
    for (const std::string* d : {&damage, &optim_damage}) {
      if (!d->empty()) result.ranks_damaged.emplace_back(r, *d);
    }
    result.ranks_written.push_back(r);
    if (!model_fresh) {
      for (const EntryMap& m : mj.maps) total += m.nbytes;
      mjobs.push_back(std::move(mj));
    }
    if (oj && !optim_fresh) {
      for (const EntryMap& m : oj->maps) total += m.nbytes;
      ojobs.push_back(std::move(*oj));
    }
    if (mjobs.size() + ojobs.size() >= kMaxOpenRankFiles) flush();
  }
  flush();

  // Commit, once every rank file of the new layout is there (this process's ranks or
  // another's): optimizer.json, then the manifest's entry, under OUT's lock.
  lock = std::make_unique<DirectoryLock>(o.out / kLockName, std::max(o.lock_wait_seconds, 600.0));
  manifest = ReadManifest(o.out);
  if (!manifest || !(manifest->source == src.view.fingerprint)) {
    Fail(ErrorCode::kMismatch, mpath + ": rewritten for another source during this run");
  }
  for (uint32_t r = 0; r < target.world_size; ++r) {
    RankFileJob mj = model_job(r);
    bool ok = RankFileUpToDate(mj.path, mj.header, o.codec);
    if (ok && optim) {
      RankFileJob oj = optim_job(r, mj.header);
      ok = RankFileUpToDate(oj.path, oj.header, o.codec);
    }
    if (!ok) result.ranks_missing.push_back(r);
  }
  if (result.ranks_missing.empty()) {
    if (parallel) WriteFileAtomic(dir / kPlanJson, CanonicalPlanJson(*parallel) + "\n");
    if (optim) {
      nlohmann::json meta = so.meta;
      meta["layout"] = key;
      auto desc_of = [&](const std::vector<PlannedState>& states) {
        nlohmann::json state = nlohmann::json::object();
        for (const PlannedState& s : states) {
          nlohmann::json& d = state[s.param];
          if (!d.contains("tensors")) {
            d["tensors"] = nlohmann::json::object();
            const auto it = so.scalars.find(s.param);
            d["scalars"] = it != so.scalars.end() ? it->second : nlohmann::json::object();
          }
          d["tensors"][s.key] = s.kind;
        }
        return state;
      };
      if (target.kind == LayoutKind::kFsdp1) {
        meta.erase("state");
        nlohmann::json rs = nlohmann::json::array();
        for (uint32_t r = 0; r < target.world_size; ++r) rs.push_back(desc_of(states_of_rank[r]));
        meta["rank_state"] = std::move(rs);
      } else {
        meta.erase("rank_state");
        meta["state"] = desc_of(states_of_rank[0]);
      }
      WriteFileAtomic(odir / kOptimJson, meta.dump(1) + "\n");
    }
    Manifest m = *manifest;
    m.writer = std::string(WriterString());
    ManifestLayout entry = ScanLayout(o.out, target, manifest->source);
    if (!entry.complete) {
      Fail(ErrorCode::kDataLoss, dir.string() + ": every rank file was checked, yet the layout scan finds it incomplete");
    }
    // Taken out (reshard remove) after this run read it: the new layout stands alone, as a
    // copy of a removed layout does (every byte was checked as it was read).
    if (m.layouts.count(from)) entry.from = from;
    m.layouts[entry.key] = std::move(entry);
    WriteManifest(o.out, m);
    result.committed = true;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace reshard

namespace reshard {

std::vector<RelayoutProblem> CheckRelayout(const fs::path& out, const std::string& key, unsigned threads,
                                           uint64_t& bytes_compared) {
  std::vector<RelayoutProblem> problems;
  std::mutex mu;
  auto problem = [&](std::string file, std::string tensor, std::string message) {
    std::lock_guard<std::mutex> g(mu);
    if (message.starts_with(file + ": ")) message.erase(0, file.size() + 2);
    problems.push_back({std::move(file), std::move(tensor), std::move(message)});
  };
  const std::string mpath = (out / kManifestName).string();
  try {
    const std::optional<Manifest> manifest = ReadManifest(out);
    if (!manifest || !manifest->layouts.count(key)) Fail(ErrorCode::kNotFound, mpath + ": no layout " + key);
    const ManifestLayout& ml = manifest->layouts.at(key);
    const LayoutSpec target = ml.Layout();
    std::optional<ModelManifest> model;
    std::error_code ec;
    if (fs::exists(out / kModelManifestName, ec)) model = ReadModelManifest(out / kModelManifestName);
    if (!manifest->layouts.count(ml.from)) {
      Fail(ErrorCode::kNotFound, mpath + ": layouts[\"" + key + "\"].from: found \"" + ml.from +
                                     "\", a layout the manifest does not list (the layout " + key +
                                     " was made from it and cannot be compared)");
    }
    // A DTensor layout: planned again from the plan relayout left beside its rank files.
    std::optional<ParallelPlan> parallel;
    const fs::path plan_path = out / (ml.dir.empty() ? key : ml.dir) / kPlanJson;
    if (target.kind == LayoutKind::kDTensor) {
      if (!fs::is_regular_file(plan_path, ec)) {
        Fail(ErrorCode::kNotFound, plan_path.string() + ": missing: the parallel plan of layout " + key +
                                       " (plan " + target.plan_name + ", xxh3 " + Hex16(target.plan_xxh3) +
                                       "); run reshard relayout " + out.string() + " --mesh " + target.mesh.Flag() +
                                       " --plan PLAN.json again");
      }
      parallel = ParseParallelPlan(ReadWholeFile(plan_path, 64ull << 20), plan_path.string());
      if (parallel->name != target.plan_name || parallel->xxh3 != target.plan_xxh3) {
        Fail(ErrorCode::kMismatch, plan_path.string() + ": plan " + parallel->name + " of xxh3 " +
                                       Hex16(parallel->xxh3) + "; the layout " + key + " names plan " +
                                       target.plan_name + " of xxh3 " + Hex16(target.plan_xxh3));
      }
    }
    RelayoutPlanner planner(out, *manifest, ml.from, target, model, kDefaultChunkSize, parallel, plan_path.string());
    const std::string against = "layout " + ml.from;
    struct Item {
      size_t file, entry;
      uint64_t chunk;
    };
    std::vector<RankFileJob> jobs;
    std::vector<std::optional<RankFileReader>> readers;
    std::vector<bool> optim_job;
    std::vector<Item> items;
    auto add = [&](RankFileJob job, bool is_optim) {
      const std::string path = job.path.string();
      std::optional<RankFileReader> r;
      try {
        r = RankFileReader::Open(job.path);
      } catch (const Error& e) {
        problem(path, "", e.what());
        return;
      }
      const RankFileHeader& h = r->header();
      if (h.layout_key != key || h.rank != job.rank || h.world_size != target.world_size ||
          !(h.source == manifest->source) || h.tensors.size() != job.header.tensors.size()) {
        problem(path, "", "holds rank " + std::to_string(h.rank) + " of " + h.layout_key + " with " +
                              std::to_string(h.tensors.size()) + " tensors; " + against + " gives rank " +
                              std::to_string(job.rank) + " of " + key + " with " +
                              std::to_string(job.header.tensors.size()));
        return;
      }
      for (size_t i = 0; i < h.tensors.size(); ++i) {
        const TensorEntry& t = h.tensors[i];
        const TensorEntry& w = job.header.tensors[i];
        if (t.name != w.name || t.dtype != w.dtype || t.sharded != w.sharded || t.global_shape != w.global_shape ||
            t.local_shape != w.local_shape || (t.sharded && !(t.rows == w.rows)) ||
            (t.flat == nullptr) != (w.flat == nullptr) || (t.flat && !(*t.flat == *w.flat)) ||
            t.dtensor.has_value() != w.dtensor.has_value() ||
            (t.dtensor && (t.dtensor->placements != w.dtensor->placements ||
                           t.dtensor->fsdp_mesh_dim != w.dtensor->fsdp_mesh_dim)) ||
            t.nbytes != job.maps[i].nbytes) {
          problem(path, t.name, "entry " + std::to_string(i) + " is not the one " + against + " gives (\"" +
                                    w.name + "\": name, dtype, shapes, rows, flat parameter or placements differ)");
          return;
        }
        for (uint64_t c = 0; c < t.ChunkCount(h.chunk_size); ++c) items.push_back({jobs.size(), i, c});
      }
      jobs.push_back(std::move(job));
      readers.push_back(std::move(r));
      optim_job.push_back(is_optim);
    };
    std::vector<PlannedState> states;
    for (uint32_t r = 0; r < target.world_size; ++r) {
      RankFileJob mj = planner.ModelJob(r);
      const RankFileHeader mh = mj.header;
      add(std::move(mj), false);
      if (planner.optim) add(planner.OptimJob(r, mh, states), true);
    }
    if (planner.optim) {
      const fs::path meta = out / (ml.dir.empty() ? key : ml.dir) / kOptimDir / kOptimJson;
      try {
        const nlohmann::json j = internal::ParseStrictJson(ReadWholeFile(meta, 256ull << 20), meta.string(), "optimizer.json");
        if (!j.is_object() || !j.contains("layout") || j["layout"] != key) {
          problem(meta.string(), "", "layout: found " + (j.is_object() && j.contains("layout") ? internal::Describe(j["layout"]) : std::string("nothing")) +
                                         ", expected \"" + key + "\"");
        }
      } catch (const Error& e) {
        problem(meta.string(), "", e.what());
      }
    }
    std::atomic<uint64_t> compared{0};
    ParallelForOptions po;
    po.threads = threads ? threads : std::max(1u, std::thread::hardware_concurrency());
    ParallelFor(items.size(), po, [&] {
      return [&, model_reader = LayoutByteReader(planner.src.bytes, true),
              optim_reader = LayoutByteReader(planner.so.bytes, true), frame = std::string(),
              scratch = std::vector<char>(), a = std::vector<char>(), b = std::vector<char>()](size_t i) mutable -> uint64_t {
        const Item& it = items[i];
        const RankFileReader& r = *readers[it.file];
        const TensorEntry& t = r.header().tensors[it.entry];
        const EntryMap& map = jobs[it.file].maps[it.entry];
        try {
          const uint64_t cs = r.header().chunk_size;
          const uint64_t len = ChunkLength(t, cs, it.chunk);
          a.resize(len);
          b.resize(len);
          r.ReadChunk(t, it.chunk, a.data(), frame);
          LayoutByteReader& lr = optim_job[it.file] ? optim_reader : model_reader;
          const SourceRead read = [&lr](size_t, uint64_t at, size_t n, void* d) { lr.Read(at, n, d); };
          FillEntry(map, optim_job[it.file] ? planner.optim_lookup : planner.model_lookup, read, it.chunk * cs, len,
                    b.data(), scratch);
          if (std::memcmp(a.data(), b.data(), len) != 0) {
            uint64_t k = 0;
            while (k < len && a[k] == b[k]) ++k;
            const uint64_t at = it.chunk * cs + k;
            problem(r.path(), t.name, "differs from " + against + " at byte " + std::to_string(at) +
                                          " of this rank's part (" + DescribeEntryByte(map, at) + ")");
          }
          compared += len;
          return len;
        } catch (const std::exception& e) {
          problem(r.path(), t.name, e.what());
          return 0;
        }
      };
    });
    bytes_compared += compared.load();
  } catch (const Error& e) {
    problem(mpath, "", e.what());
  }
  return problems;
}

}  // namespace reshard
