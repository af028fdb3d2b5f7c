// reshard._C: the Python binding. It takes raw pointers and sizes (no torch headers), so the
// extension is independent of the torch version; the torch-aware logic lives in
// python/reshard/. The GIL is released while data moves.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <mutex>
#include <tuple>

#include <unistd.h>

#include "reshard/base/checksum.h"
#include "reshard/base/dtype.h"
#include "reshard/base/error.h"
#include "reshard/base/human.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/layout.h"
#include "reshard/format/manifest.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/file_io.h"
#include "reshard/io/hf_cache.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/build_info.h"
#include "reshard/ops/export.h"
#include "reshard/ops/path_hint.h"
#include "reshard/plan/byte_map.h"
#include "reshard/runtime/copier_cache.h"
#include "reshard/runtime/knobs.h"
#include "reshard/runtime/loader.h"
#include "reshard/runtime/rank_writer.h"
#include "reshard/runtime/source_load.h"
#ifdef RESHARD_HAVE_CUDA
#include "reshard/cuda/cuda_copier.h"
#endif

namespace py = pybind11;

namespace {

// This process's copy engines (reshard/runtime/copier_cache.h): the CUDA copier of each
// (device, lanes, slots), made with the environment's knobs (reshard/runtime/knobs.h). Null
// in a build without CUDA.
reshard::CopierCache* Copiers() {
#ifdef RESHARD_HAVE_CUDA
  static auto* cache = new reshard::CopierCache([](int device, int lanes, int slots) {  // never
    const reshard::CopierKnobs k = reshard::CopierKnobsFromEnv();  // destroyed: process exit frees
    return reshard::MakeCudaCopier(device, lanes, slots, k.streams,  // pinned memory, and no copier
                                   k.pinned_host_alloc ? reshard::PinnedMemory::kHostAlloc  // outlives
                                                       : reshard::PinnedMemory::kRegister);  // CUDA
  });
  return cache;
#else
  return nullptr;
#endif
}

// Rank file headers parsed in this process (reshard.load reads a file's header to check the
// model against it, then loads it: the second open reuses the parse).
reshard::HeaderCache& Headers() {
  static auto* cache = new reshard::HeaderCache(64);  // never destroyed, as Copiers
  return *cache;
}

reshard::IoMode ParseIo(const std::string& io) {
  if (io == "auto") return reshard::IoMode::kAuto;
  if (io == "buffered") return reshard::IoMode::kBuffered;
  if (io == "direct") return reshard::IoMode::kDirect;
  if (io == "readahead") return reshard::IoMode::kReadahead;
  throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                       "io must be auto, buffered, direct or readahead, not \"" + io + "\"");
}

// The FSDP1 fields of a layout, from Python: (wrap classes, use_orig_params, param_dtype).
using Fsdp1Arg = std::tuple<std::vector<std::string>, bool, std::string>;
// The DTensor fields of a layout, from Python: (mesh dim names, mesh shape, plan name, plan xxh3).
using DTensorArg = std::tuple<std::vector<std::string>, std::vector<uint32_t>, std::string, uint64_t>;
// The layout of a job (what a save writes, what a view plans): FSDP2 without `fsdp1`, else
// FSDP1 with its fields; dtype policy "keep" (saved bytes are the live ones; a load's view may
// plan another). Normalized as `reshard convert` normalizes it.
reshard::LayoutSpec JobLayout(uint32_t world_size, const std::optional<Fsdp1Arg>& fsdp1,
                              const std::string& dtype = "keep",
                              const std::optional<DTensorArg>& dtensor = std::nullopt) {
  reshard::LayoutSpec spec;
  spec.world_size = world_size;
  spec.dtype = dtype;
  if (fsdp1 && dtensor) {
    throw reshard::Error(reshard::ErrorCode::kInvalidArgument, "a layout is FSDP1 or DTensor, not both");
  }
  if (fsdp1) {
    spec.kind = reshard::LayoutKind::kFsdp1;
    std::tie(spec.wrap, spec.use_orig_params, spec.param_dtype) = *fsdp1;
  }
  if (dtensor) {
    spec.kind = reshard::LayoutKind::kDTensor;
    std::tie(spec.mesh.names, spec.mesh.shape, spec.plan_name, spec.plan_xxh3) = *dtensor;
    spec.Normalize();  // world_size = the mesh's size
    if (spec.world_size != world_size) {
      throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                           "world size " + std::to_string(world_size) + " for the mesh " +
                               spec.mesh.Flag() + " of " + std::to_string(spec.world_size) + " ranks");
    }
  }
  spec.Normalize();
  return spec;
}

// A view's layout for a DTensor job: `mesh` ("dp_shard=2,tp=2", the --mesh flag) and a parallel
// plan's JSON text (formats/parallel-plan.md; `plan_what` names it in errors).
struct ViewPlan {
  reshard::LayoutSpec layout;
  std::optional<reshard::ParallelPlan> plan;
  std::string what;
};

ViewPlan JobViewLayout(uint32_t world_size, const std::optional<Fsdp1Arg>& fsdp1, const std::string& dtype,
                       const std::string& mesh, const std::string& plan_json, const std::string& plan_what) {
  ViewPlan v;
  if (mesh.empty() != plan_json.empty()) {
    reshard::Fail(reshard::ErrorCode::kInvalidArgument, "a DTensor view needs both mesh and plan");
  }
  if (mesh.empty()) {
    v.layout = JobLayout(world_size, fsdp1, dtype);
    return v;
  }
  if (fsdp1) reshard::Fail(reshard::ErrorCode::kInvalidArgument, "fsdp1 and mesh exclude each other");
  v.what = plan_what.empty() ? "the job's parallel plan" : plan_what;
  v.plan = reshard::ParseParallelPlan(plan_json, v.what);
  v.layout.kind = reshard::LayoutKind::kDTensor;
  v.layout.mesh = reshard::ParseMeshFlag(mesh);
  v.layout.dtype = dtype;
  v.layout.plan_name = v.plan->name;
  v.layout.plan_xxh3 = v.plan->xxh3;
  v.layout.Normalize();
  if (v.layout.world_size != world_size) {
    reshard::Fail(reshard::ErrorCode::kInvalidArgument,
                  "mesh " + mesh + " has " + std::to_string(v.layout.world_size) + " ranks, world_size is " +
                      std::to_string(world_size));
  }
  return v;
}

// ---- loading: one opened rank file, raw targets --------------------------------------------

// An opened, validated rank file (preamble and header checked, the header parsed once) that
// Python holds across the checks of a load and the load itself: one open, one parse.
// reshard._C.LoadProgress: the counter behind reshard.load(progress=True).
struct LoadProgress {
  std::atomic<uint64_t> bytes{0};
};

struct RankFileHandle {
  std::shared_ptr<const reshard::RankFileReader> reader;
  const reshard::RankFileHeader& header() const { return reader->header(); }
};

RankFileHandle OpenRankFile(const std::string& path) {
  py::gil_scoped_release release;
  return {std::make_shared<const reshard::RankFileReader>(
      reshard::RankFileReader::Open(path, &Headers()))};
}

// A rank's part of a layout planned over a source that is not its rank file (a Hugging Face
// checkpoint, another layout): the same checks in Python, then its own Load.
struct SourceViewHandle {
  std::shared_ptr<const reshard::SourceRankView> view;
  const reshard::RankFileHeader& header() const { return view->header(); }
};


py::object ShardOf(const reshard::TensorEntry& e) {
  if (!e.sharded) return py::none();
  return py::make_tuple(e.rows.start, e.rows.end);
}

// ---- saving ---------------------------------------------------------------------------------

// One tensor of a save: the rank file entry (name, dtype, global shape, this rank's rows or
// whole, an FSDP1 flat object) and where its bytes are.
struct SaveTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> global_shape;
  std::optional<std::pair<uint64_t, uint64_t>> rows;  // dim-0 rows [start, end); none: whole
  uintptr_t ptr = 0;
  uint64_t nbytes = 0;
  bool on_device = false;
  std::shared_ptr<const reshard::FlatInfo> flat;       // FSDP1 flat shard
  std::vector<std::string> placements;  // DTensor layouts: one per mesh dim ("R", "S(d)", "_S(d,k)")
  int fsdp_mesh_dim = -1;               // DTensor layouts: fully_shard's mesh dim, or -1
};

double g_save_pause_seconds = 0;  // _testing.set_save_pause: sleep before each tensor

// The code of a reshard::Error as reshard.errors names it (ReshardError.code).
const char* ErrorCodeKey(reshard::ErrorCode code) {
  switch (code) {
    case reshard::ErrorCode::kInvalidArgument: return "invalid_argument";
    case reshard::ErrorCode::kNotFound: return "not_found";
    case reshard::ErrorCode::kDataLoss: return "data_loss";
    case reshard::ErrorCode::kMismatch: return "mismatch";
    case reshard::ErrorCode::kUnsupported: return "unsupported";
    case reshard::ErrorCode::kIo: return "io";
    case reshard::ErrorCode::kBusy: return "busy";
    case reshard::ErrorCode::kCancelled: return "cancelled";
  }
  return "error";
}

}  // namespace

// A DTensorSharding from torch's placement strings (binding arguments).
static reshard::DTensorSharding ShardingOf(const std::vector<std::string>& placements,
                                    const std::vector<uint32_t>& mesh_shape, int fsdp_mesh_dim) {
  reshard::DTensorSharding s;
  for (const auto& p : placements) {
    auto parsed = reshard::ParsePlacement(p);
    if (!parsed) {
      reshard::Fail(reshard::ErrorCode::kInvalidArgument,
                    "placement \"" + p + "\" is not one of R, S(d), _S(d,k)");
    }
    s.placements.push_back(*parsed);
  }
  s.fsdp_mesh_dim = fsdp_mesh_dim;
  s.mesh_shape = mesh_shape;
  return s;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "reshard native module";
  // Every reshard::Error reaches Python as the reshard.errors class of its code (one
  // translator; the classes are pure Python so that code without the extension raises them too).
  static py::object* errors = new py::object(py::module_::import("reshard.errors"));  // kept for
  py::register_exception_translator([](std::exception_ptr p) {                      // the process
    try {
      if (p) std::rethrow_exception(p);
    } catch (const reshard::Error& e) {
      py::object cls = errors->attr("error_class")(ErrorCodeKey(e.code()));
      py::object exc = cls(py::str(e.what()));
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
  m.attr("ReshardError") = errors->attr("ReshardError");
  // What `reshard convert --chunk-size` and reshard.save(chunk_size=) write when not told.
  m.attr("DEFAULT_CHUNK_SIZE") = reshard::kDefaultChunkSize;

  m.def("rank_file_name", &reshard::RankFileName, py::arg("rank"), py::arg("world_size"),
        "rank-RRRRR-of-WWWWW.reshard (formats/rank-file.md).");
  m.def(
      "chunk_rows",
      [](uint64_t n, uint64_t world_size, uint64_t rank) {
        if (world_size == 0 || rank >= world_size) {
          throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                               "chunk_rows: rank " + std::to_string(rank) + " outside world size " +
                                   std::to_string(world_size));
        }
        const reshard::RowRange r = reshard::ChunkRows(n, world_size, rank);
        return std::make_pair(r.start, r.end);
      },
      py::arg("n"), py::arg("world_size"), py::arg("rank"),
      "The FSDP2 chunk rule: (start, end) rows of n that shard `rank` of `world_size` holds.");
  m.def("flat_entry_name", &reshard::FlatEntryName, py::arg("unit"),
        "The rank-file entry of an FSDP1 unit's FlatParameter.");
  m.def("path_hint", [](const std::string& out) { return reshard::PathHint(out); }, py::arg("out"),
        "What OUT is when it is not a reshard output directory but is near one, and what to pass "
        "instead (empty when nothing better than 'no reshard.json' can be said).");
  m.def(
      "read_manifest",
      [](const std::string& out) -> std::optional<std::string> {
        std::optional<reshard::Manifest> manifest = reshard::ReadManifest(out);
        if (!manifest) return std::nullopt;
        return reshard::SerializeManifest(*manifest);
      },
      py::arg("out"),
      "OUT/reshard.json parsed and checked by the core, as JSON text; None when absent.");

  m.def("aux_file_names", [] { return reshard::AuxFileNames(); },
        "The config and tokenizer files convert copies beside the layouts (and a save from a "
        "model loaded from a Hugging Face checkpoint carries).");
  m.def(
      "checkpoint_tensors",
      [](const std::string& source) {
        const reshard::Checkpoint ckpt = reshard::OpenCheckpoint(source);
        std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>>> out;
        for (const auto& t : ckpt.tensors) {
          out.emplace_back(t.name, std::string(reshard::Name(t.dtype)), t.shape);
        }
        return out;
      },
      py::arg("source"),
      "The tensors of a Hugging Face checkpoint (directory or weight file) as the core reads "
      "them: (name, dtype name, shape), sorted by name; headers only.");
  m.def(
      "checkpoint_tensor_bytes",
      [](const std::string& source) {
        const reshard::Checkpoint ckpt = reshard::OpenCheckpoint(source);
        std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>, std::string, uint64_t, uint64_t>>
            out;
        for (const auto& t : ckpt.tensors) {
          out.emplace_back(t.name, std::string(reshard::Name(t.dtype)), t.shape, ckpt.files[t.file_index].path,
                           t.offset, t.nbytes);
        }
        return out;
      },
      py::arg("source"),
      "As checkpoint_tensors, with where each tensor's bytes are: (name, dtype name, shape, "
      "weight file path, absolute byte offset, byte count). Two names of one torch.save "
      "storage (a .bin's tie) have the same path, offset and count.");
  m.def(
      "export",
      [](const std::string& out, const std::string& hf_dir, const std::string& layout,
         uint64_t max_shard_size, unsigned threads, bool force, bool adapter) {
        reshard::ExportOptions o;
        o.out = out;
        o.hf_dir = hf_dir;
        o.layout = layout;
        o.max_shard_size = max_shard_size;
        o.threads = threads;
        o.force = force;
        o.adapter = adapter;
        reshard::ExportResult r;
        {
          py::gil_scoped_release release;
          r = reshard::Export(o);
        }
        py::dict d;
        d["layout"] = r.layout_key;
        d["hf_dir"] = r.hf_dir.string();
        d["weight_files"] = r.weight_files;
        d["aux_files"] = r.aux_files;
        d["sharded"] = r.sharded;
        d["tensors"] = r.tensors;
        d["total_size"] = r.total_size;
        d["bytes_read"] = r.bytes_read;
        d["seconds"] = r.seconds;
        return d;
      },
      py::arg("out"), py::arg("hf_dir"), py::arg("layout") = "",
      py::arg("max_shard_size") = 5'000'000'000ull, py::arg("threads") = 0u,
      py::arg("force") = false, py::arg("adapter") = false,
      "`reshard export OUT -o HF_DIR` (reshard::Export): a layout of OUT written as a Hugging "
      "Face checkpoint, streamed chunk by chunk; returns the summary `--json` prints.");
  // The CLI's rules, so that Python prints and resolves exactly as `reshard` does.
  m.def("format_bytes", [](double n) { return reshard::FormatBytes(n); }, py::arg("n"),
        "A byte count in the unit that fits: 512 B, 1.54 KB, 12.3 MB, 7.60 GB (powers of 1000).");
  m.def("format_rate", [](double n) { return reshard::FormatRate(n); }, py::arg("bytes_per_second"),
        "format_bytes(bytes_per_second) + '/s'; '-' for a rate that is not a finite number >= 0.");
  m.def("hf_hub_cache_dir", [] { return reshard::HfHubCacheDir().string(); },
        "The Hugging Face hub cache directory (HF_HUB_CACHE, HF_HOME, ~/.cache/huggingface/hub).");
  m.def(
      "resolve_source",
      [](const std::string& source, const std::optional<std::string>& revision) {
        const reshard::ResolvedSource r = reshard::ResolveSource(source, revision.value_or(""));
        py::dict d;
        d["path"] = r.path.string();
        d["from_cache"] = r.from_cache;
        d["model_id"] = r.model_id;
        d["revision"] = r.revision;
        d["commit"] = r.commit;
        return d;
      },
      py::arg("source"), py::arg("revision") = py::none(),
      "A local path (used as it is when it exists), or a Hugging Face model id found in the "
      "local cache: {'path', 'from_cache', 'model_id', 'revision', 'commit'}. Never downloads; "
      "raises NotFoundError naming `hf download` when the id is not cached.");

  m.def("build_info", [] {  // the same facts as `reshard --version` (reshard::GetBuildInfo)
    const reshard::BuildInfo b = reshard::GetBuildInfo();
    py::dict d;
    d["version"] = b.version;
    d["format_version"] = b.format_version;
#ifdef RESHARD_HAVE_CUDA
    d["cuda"] = true;  // this extension has the CUDA copy engine linked in
#else
    d["cuda"] = false;
#endif
    d["cuda_version"] = b.cuda_version;
    d["zstd"] = true;
    d["zstd_version"] = b.zstd_version;
    d["xxhash_version"] = b.xxhash_version;
    d["compiler"] = b.compiler;
    d["build_type"] = b.build_type;
    d["python_version"] = b.python_version;
    d["pybind11_version"] = b.pybind11_version;
    d["torch_version"] = b.torch_version;
    d["version_text"] = reshard::VersionText();
    return d;
  });

  m.def("cuda_device_count", [] {
#ifdef RESHARD_HAVE_CUDA
    return reshard::CudaDeviceCount();
#else
    return 0;
#endif
  });

  // ---- rank files: opened once, tensors described, loaded into raw targets ------------------
  py::class_<reshard::FlatParamInfo>(m, "FlatParam",
                                     "One original parameter inside an FSDP1 FlatParameter.")
      .def(py::init([](std::string fqn, std::string key, std::vector<uint64_t> shape, uint64_t offset) {
             reshard::FlatParamInfo p;
             p.numel = 1;
             for (uint64_t d : shape) p.numel = reshard::CheckedMul(p.numel, d, "FlatParam " + fqn);
             p.fqn = std::move(fqn);
             p.key = std::move(key);
             p.shape = std::move(shape);
             p.offset = offset;
             return p;
           }),
           py::arg("fqn"), py::arg("key"), py::arg("shape"), py::arg("offset"))
      .def_readonly("fqn", &reshard::FlatParamInfo::fqn)
      .def_readonly("key", &reshard::FlatParamInfo::key)
      .def_readonly("shape", &reshard::FlatParamInfo::shape)
      .def_readonly("numel", &reshard::FlatParamInfo::numel)
      .def_readonly("offset", &reshard::FlatParamInfo::offset)
      .def("__repr__", [](const reshard::FlatParamInfo& p) {
        return "FlatParam(" + p.fqn + " at " + std::to_string(p.offset) + ")";
      });
  py::class_<reshard::FlatInfo, std::shared_ptr<reshard::FlatInfo>>(
      m, "FlatInfo", "The unsharded FlatParameter of one FSDP1 unit (formats/rank-file.md).")
      .def(py::init([](std::string unit, uint64_t numel, uint64_t aligned_numel,
                       std::vector<reshard::FlatParamInfo> params, std::vector<std::string> shared) {
             auto f = std::make_shared<reshard::FlatInfo>();
             f->unit = std::move(unit);
             f->numel = numel;
             f->aligned_numel = aligned_numel;
             f->params = std::move(params);
             f->shared = std::move(shared);
             return f;
           }),
           py::arg("unit"), py::arg("numel"), py::arg("aligned_numel"), py::arg("params"),
           py::arg("shared"))
      .def_readonly("unit", &reshard::FlatInfo::unit)
      .def_readonly("numel", &reshard::FlatInfo::numel)
      .def_readonly("aligned_numel", &reshard::FlatInfo::aligned_numel)
      .def_readonly("params", &reshard::FlatInfo::params)
      .def_readonly("shared", &reshard::FlatInfo::shared);

  py::class_<reshard::TensorEntry>(m, "TensorInfo", "One tensor of a rank file.")
      .def_readonly("name", &reshard::TensorEntry::name)
      .def_property_readonly("dtype", [](const reshard::TensorEntry& e) {
        return std::string(reshard::Name(e.dtype));
      })
      .def_readonly("global_shape", &reshard::TensorEntry::global_shape)
      .def_readonly("local_shape", &reshard::TensorEntry::local_shape)
      .def_property_readonly("shard", &ShardOf, "(start, end) rows of dim 0, None when whole")
      .def_readonly("nbytes", &reshard::TensorEntry::nbytes)
      .def_readonly("stored_size", &reshard::TensorEntry::stored_size)
      .def_readonly("chunk_xxh3", &reshard::TensorEntry::chunk_xxh3,
                    "each chunk's XXH3-64 of this rank's bytes, from the header (no data read)")
      .def_property_readonly("codec", [](const reshard::TensorEntry& e) {
        return std::string(reshard::CodecName(e.codec));
      })
      .def_property_readonly("flat", [](const reshard::TensorEntry& e) -> py::object {
        if (!e.flat) return py::none();
        return py::cast(std::const_pointer_cast<reshard::FlatInfo>(e.flat));
      })
      .def_property_readonly(
          "placements",
          [](const reshard::TensorEntry& e) -> py::object {
            if (!e.dtensor) return py::none();
            py::list out;
            for (const auto& p : e.dtensor->placements) out.append(p.ToString());
            return std::move(out);
          },
          "DTensor layouts: one placement per mesh dim ('R', 'S(d)', '_S(d,k)'); None otherwise")
      .def_property_readonly(
          "fsdp_mesh_dim",
          [](const reshard::TensorEntry& e) -> py::object {
            if (!e.dtensor || e.dtensor->fsdp_mesh_dim < 0) return py::none();
            return py::cast(e.dtensor->fsdp_mesh_dim);
          },
          "DTensor layouts: the mesh dim fully_shard applied last, or None")
      .def("__repr__", [](const reshard::TensorEntry& e) {
        return "TensorInfo(" + e.name + ", " + std::string(reshard::Name(e.dtype)) + ", " +
               std::to_string(e.nbytes) + " bytes)";
      });

  py::class_<reshard::LoadTarget>(m, "LoadTarget",
                                  "A tensor of the file and its destination: nbytes at ptr.")
      .def(py::init([](std::string name, uintptr_t ptr, uint64_t nbytes, bool on_device) {
             return reshard::LoadTarget{std::move(name), reinterpret_cast<void*>(ptr), nbytes,
                                        on_device};
           }),
           py::arg("name"), py::arg("ptr"), py::arg("nbytes"), py::arg("on_device") = false)
      .def_readonly("name", &reshard::LoadTarget::name)
      .def_readonly("nbytes", &reshard::LoadTarget::nbytes)
      .def_readonly("on_device", &reshard::LoadTarget::on_device);

  py::class_<reshard::LoadStats>(m, "LoadStats", "What one load moved, and how long it took.")
      .def_readonly("bytes", &reshard::LoadStats::bytes)
      .def_readonly("stored_bytes", &reshard::LoadStats::stored_bytes)
      .def_readonly("tensors", &reshard::LoadStats::tensors)
      .def_readonly("seconds", &reshard::LoadStats::seconds)
      .def_property_readonly("gbps", [](const reshard::LoadStats& s) {
        return s.seconds > 0 ? s.bytes / s.seconds / 1e9 : 0.0;
      })
      .def_readonly("staging_bytes", &reshard::LoadStats::staging_bytes)
      .def_readonly("staging_alloc_seconds", &reshard::LoadStats::staging_alloc_seconds)
      .def_readonly("threads", &reshard::LoadStats::threads)
      .def_readonly("pooled", &reshard::LoadStats::pooled)
      .def_readonly("cold", &reshard::LoadStats::cold)
      .def_readonly("direct_io", &reshard::LoadStats::direct_io);

  py::class_<LoadProgress, std::shared_ptr<LoadProgress>>(
      m, "LoadProgress",
      "A byte counter the loader adds to as spans land (LoadOptions::progress), read by a "
      "progress display on another thread while a load runs without the GIL.")
      .def(py::init<>())
      .def_property_readonly("bytes", [](const LoadProgress& p) { return p.bytes.load(std::memory_order_relaxed); });

  py::class_<RankFileHandle>(m, "RankFile",
                             "An opened rank file: preamble and header checked, header parsed once.")
      .def_static("open", &OpenRankFile, py::arg("path"),
                  "Opens and validates a rank file (formats/rank-file.md invariants 1-7).")
      .def(
          "check_listed",
          [](const RankFileHandle& f, const std::string& out, const std::string& key, uint32_t rank) {
            py::gil_scoped_release release;
            const auto manifest = reshard::ReadManifest(out);
            const std::string mpath = (std::filesystem::path(out) / reshard::kManifestName).string();
            if (!manifest) reshard::Fail(reshard::ErrorCode::kNotFound, mpath + ": no such file");
            reshard::CheckListed(*f.reader, *manifest, key, rank, mpath);
          },
          py::arg("out"), py::arg("key"), py::arg("rank"),
          "Checks that this is the file OUT/reshard.json lists as rank `rank` of layout `key` "
          "(size, header hash, layout, dtype policy, source); raises LayoutMismatchError.")
      .def_property_readonly("path", [](const RankFileHandle& f) { return f.reader->path(); })
      .def_property_readonly("file_size", [](const RankFileHandle& f) { return f.reader->file_size(); })
      .def_property_readonly("rank", [](const RankFileHandle& f) { return f.header().rank; })
      .def_property_readonly("world_size", [](const RankFileHandle& f) { return f.header().world_size; })
      .def_property_readonly("layout_key", [](const RankFileHandle& f) { return f.header().layout_key; })
      .def_property_readonly("kind", [](const RankFileHandle& f) { return f.header().Layout().KindName(); })
      .def_property_readonly("dtype_policy", [](const RankFileHandle& f) { return f.header().dtype_policy; })
      .def_property_readonly("chunk_size", [](const RankFileHandle& f) { return f.header().chunk_size; })
      .def_property_readonly("source_fingerprint", [](const RankFileHandle& f) {
        return reshard::Hex16(f.header().source.fingerprint);
      })
      .def_property_readonly(
          "saved",
          [](const RankFileHandle& f) -> py::object {
            const auto& s = f.header().source.saved;
            if (!s) return py::none();
            return py::make_tuple(reshard::Hex16(s->id), s->step ? py::cast(*s->step) : py::none());
          },
          "(save id as 16 hex digits, step or None) for a checkpoint saved from training, else None")
      .def_property_readonly(
          "tensors",
          [](py::object self) {
            const RankFileHandle& f = self.cast<const RankFileHandle&>();
            py::list out;
            for (const auto& t : f.header().tensors) {
              out.append(py::cast(&t, py::return_value_policy::reference_internal, self));
            }
            return out;
          },
          "The tensors in file order")
      .def_property_readonly(
          "mesh",
          [](const RankFileHandle& f) -> py::object {
            const reshard::RankFileHeader& h = f.header();
            if (h.kind != reshard::LayoutKind::kDTensor) return py::none();
            return py::make_tuple(h.mesh.names, h.mesh.shape);
          },
          "DTensor layouts: (dim names, dim sizes) of the device mesh; None otherwise")
      .def_property_readonly(
          "coordinate",
          [](const RankFileHandle& f) -> py::object {
            const reshard::RankFileHeader& h = f.header();
            if (h.kind != reshard::LayoutKind::kDTensor) return py::none();
            return py::cast(h.mesh.Coordinate(h.rank));
          },
          "DTensor layouts: this rank's mesh coordinate (row-major); None otherwise")
      .def("header_json", [](const RankFileHandle& f) { return reshard::SerializeHeader(f.header()); })
      .def(
          "load",
          [](const RankFileHandle& f, const std::vector<reshard::LoadTarget>& targets, int device,
             unsigned threads, bool verify, const std::string& io,
             const std::shared_ptr<LoadProgress>& progress) {
            reshard::LoadOptions o = reshard::KnobbedLoadOptions(threads, reshard::SlotsKnob(std::nullopt));
            o.verify_checksums = verify;
            o.io = ParseIo(io);
            if (progress) o.progress = &progress->bytes;
            py::gil_scoped_release release;
            return reshard::LoadThroughCache(Copiers(), *f.reader, targets, device, o);
          },
          py::arg("targets"), py::arg("device") = 0, py::arg("threads") = 8,
          py::arg("verify") = true, py::arg("io") = "auto", py::arg("progress") = nullptr,
          "Loads targets (LoadTarget: a subset of the file's tensors, each named once) with the "
          "pipelined loader; CUDA targets through this process's copy engine for `device`. "
          "The knobs of formats' measurements come from RESHARD_* environment variables.");

  py::class_<SourceViewHandle>(
      m, "SourceRankView",
      "A rank's part of an FSDP2 layout planned over a Hugging Face checkpoint or another "
      "layout's rank files, loaded from there without storing a conversion.")
      .def_static(
          "of_checkpoint",
          [](const std::string& src, uint32_t world_size, uint32_t rank, const std::string& dtype,
             const std::set<std::string>& whole, const std::string& manifest_json,
             const std::optional<Fsdp1Arg>& fsdp1, const std::string& mesh, const std::string& plan,
             const std::string& plan_what) {
            const ViewPlan v = JobViewLayout(world_size, fsdp1, dtype, mesh, plan, plan_what);
            py::gil_scoped_release release;
            return SourceViewHandle{reshard::SourceRankView::OfCheckpoint(
                src, v.layout, rank, whole, manifest_json, v.plan ? &*v.plan : nullptr, v.what)};
          },
          py::arg("src"), py::arg("world_size"), py::arg("rank"), py::arg("dtype") = "keep",
          py::arg("whole") = std::set<std::string>{}, py::arg("model_manifest") = "",
          py::arg("fsdp1") = std::nullopt, py::arg("mesh") = "", py::arg("plan") = "",
          py::arg("plan_what") = "",
          "Plans rank `rank` of the layout of world size `world_size` (FSDP2, or FSDP1 with "
          "fsdp1=(wrap classes, use_orig_params, param_dtype), or a DTensor layout with mesh="
          "'dp_shard=2,tp=2' and plan=a parallel plan's JSON text, plan_what naming it in "
          "errors) and dtype policy `dtype` over the checkpoint SRC; `whole`: tensors stored "
          "whole (persistent buffers); `model_manifest`: a model manifest's JSON (its "
          "conversion of the checkpoint's keys; FSDP1's units).")
      .def_static(
          "of_layout",
          [](const std::string& out, const std::string& key, uint32_t world_size, uint32_t rank,
             const std::string& dtype, const std::set<std::string>& whole,
             const std::string& manifest_json, const std::optional<Fsdp1Arg>& fsdp1,
             const std::string& mesh, const std::string& plan, const std::string& plan_what) {
            const ViewPlan v = JobViewLayout(world_size, fsdp1, dtype, mesh, plan, plan_what);
            py::gil_scoped_release release;
            return SourceViewHandle{reshard::SourceRankView::OfLayout(
                out, key, v.layout, rank, whole, manifest_json, &Headers(), v.plan ? &*v.plan : nullptr, v.what)};
          },
          py::arg("out"), py::arg("key"), py::arg("world_size"), py::arg("rank"),
          py::arg("dtype") = "keep", py::arg("whole") = std::set<std::string>{},
          py::arg("model_manifest") = "", py::arg("fsdp1") = std::nullopt, py::arg("mesh") = "",
          py::arg("plan") = "", py::arg("plan_what") = "",
          "Plans rank `rank` of a layout (as of_checkpoint) over layout KEY of OUT (every rank "
          "file checked against OUT/reshard.json; chunks read whole and checked).")
      .def_property_readonly("path", [](const SourceViewHandle& f) { return f.view->description(); })
      .def_property_readonly("description", [](const SourceViewHandle& f) { return f.view->description(); })
      .def_property_readonly("files", [](const SourceViewHandle& f) { return f.view->files(); })
      .def(
          "read_ranges",
          [](const SourceViewHandle& f) {
            py::list out;
            for (const auto& r : f.view->ReadRanges()) out.append(py::make_tuple(r.path, r.offset, r.length));
            return out;
          },
          "The (path, offset, length) file ranges a load of every planned tensor reads, sorted and merged "
          "(whole chunks of another layout): what a ceiling of the same reads reads")
      .def_property_readonly("converted_tensors", [](const SourceViewHandle& f) { return f.view->ConvertedTensors(); },
                             "How many planned tensors change dtype while read (the layout's dtype policy over a "
                             "source of another dtype), for reports")
      .def_property_readonly("rank", [](const SourceViewHandle& f) { return f.header().rank; })
      .def_property_readonly("world_size", [](const SourceViewHandle& f) { return f.header().world_size; })
      .def_property_readonly("layout_key", [](const SourceViewHandle& f) { return f.header().layout_key; })
      .def_property_readonly("dtype_policy", [](const SourceViewHandle& f) { return f.header().dtype_policy; })
      .def_property_readonly(
          "coordinate",
          [](const SourceViewHandle& f) -> py::object {
            const reshard::RankFileHeader& h = f.header();
            if (h.kind != reshard::LayoutKind::kDTensor) return py::none();
            return py::cast(h.mesh.Coordinate(h.rank));
          },
          "DTensor layouts: the planned rank's mesh coordinate (row-major); None otherwise")
      .def_property_readonly(
          "tensors",
          [](py::object self) {
            const SourceViewHandle& f = self.cast<const SourceViewHandle&>();
            py::list out;
            for (const auto& t : f.header().tensors) {
              out.append(py::cast(&t, py::return_value_policy::reference_internal, self));
            }
            return out;
          },
          "The planned tensors (as a rank file of the layout would list them)")
      .def(
          "load",
          [](const SourceViewHandle& f, const std::vector<reshard::LoadTarget>& targets, int device,
             unsigned threads, bool verify, const std::string& io,
             const std::shared_ptr<LoadProgress>& progress) {
            reshard::LoadOptions o = reshard::KnobbedLoadOptions(threads, reshard::SlotsKnob(std::nullopt));
            o.verify_checksums = verify;
            o.io = ParseIo(io);
            if (progress) o.progress = &progress->bytes;
            std::shared_ptr<const reshard::SourceRankView> view = f.view;
            py::gil_scoped_release release;
            return reshard::LoadThroughCache(
                Copiers(), targets, device, o,
                [&](reshard::DeviceCopier* copier, const reshard::LoadOptions& lo) {
                  return view->Load(targets, copier, lo);
                });
          },
          py::arg("targets"), py::arg("device") = 0, py::arg("threads") = 8,
          py::arg("verify") = true, py::arg("io") = "auto", py::arg("progress") = nullptr,
          "Loads targets as RankFile.load does, reading the source's bytes.");

  m.def("page_cache_residency", &reshard::PageCacheResidency, py::arg("path"));

  m.def(
      "prepare",
      [](int device, unsigned threads, std::optional<unsigned> slots_arg,
         std::optional<uint64_t> slot_bytes, bool wait) {
        unsigned slots = reshard::SlotsKnob(slots_arg);
#ifdef RESHARD_HAVE_CUDA
        if (reshard::CudaDeviceCount() <= device || device < 0) {
          throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                               "prepare: CUDA device " + std::to_string(device) + " is not visible");
        }
        threads = std::max(1u, threads);
        slots = std::max(1u, slots);
        // Enough for a warm and a cold load with this process's knobs (default chunk size).
        Copiers()->PrepareAsync(device, static_cast<int>(threads), static_cast<int>(slots),
                                slot_bytes.value_or(reshard::DefaultPreparedSlotBytes(threads, slots)),
                                reshard::WarmupKnob());
        if (wait) {
          py::gil_scoped_release release;
          Copiers()->WaitPrepared();
        }
#else
        (void)device, (void)threads, (void)slots, (void)slot_bytes, (void)wait;
        throw reshard::Error(reshard::ErrorCode::kUnsupported,
                             "this reshard build has no CUDA support; nothing to prepare");
#endif
      },
      py::arg("device"), py::arg("threads"), py::arg("slots") = py::none(),
      py::arg("slot_bytes") = py::none(), py::arg("wait") = false,
      "Creates the CUDA copier of (device, threads, slots) with its pinned staging on a "
      "background thread, so that the first load in this process finds it ready.");

  m.def("wait_prepared", [] {
#ifdef RESHARD_HAVE_CUDA
    py::gil_scoped_release release;
    Copiers()->WaitPrepared();
#endif
  }, "Waits for every prepare() still running; raises the first error one of them met.");

  // ---- save: one rank file of a live model (formats/rank-file.md, source.saved) ----------
  py::class_<SaveTensor>(m, "SaveTensor", "One tensor of a save and where its bytes are.")
      .def(py::init([](std::string name, std::string dtype, std::vector<uint64_t> global_shape,
                       std::optional<std::pair<uint64_t, uint64_t>> rows, uintptr_t ptr,
                       uint64_t nbytes, bool on_device,
                       std::shared_ptr<reshard::FlatInfo> flat, std::vector<std::string> placements,
                       int fsdp_mesh_dim) {
             return SaveTensor{std::move(name), std::move(dtype), std::move(global_shape), rows,
                               ptr, nbytes, on_device, std::move(flat), std::move(placements),
                               fsdp_mesh_dim};
           }),
           py::arg("name"), py::arg("dtype"), py::arg("global_shape"), py::arg("rows"),
           py::arg("ptr"), py::arg("nbytes"), py::arg("on_device") = false,
           py::arg("flat") = nullptr, py::arg("placements") = std::vector<std::string>{},
           py::arg("fsdp_mesh_dim") = -1)
      .def_readonly("name", &SaveTensor::name)
      .def_readonly("nbytes", &SaveTensor::nbytes);

  py::class_<reshard::SaveReport>(m, "SaveStats", "What one rank file's save wrote.")
      .def_readonly("bytes", &reshard::SaveReport::bytes)
      .def_readonly("file_size", &reshard::SaveReport::file_size)
      .def_property_readonly("header_xxh3", [](const reshard::SaveReport& r) { return reshard::Hex16(r.header_xxh3); })
      .def_readonly("staging_bytes", &reshard::SaveReport::staging_bytes)
      .def_readonly("seconds", &reshard::SaveReport::seconds);

  m.def(
      "save",
      [](const std::string& path, const std::string& layout_key, uint32_t world_size,
         uint32_t rank, uint64_t save_id, std::optional<uint64_t> step,
         const std::vector<SaveTensor>& tensors, uint64_t chunk_size, int device,
         uint64_t staging_bytes, bool verify, const std::optional<Fsdp1Arg>& fsdp1,
         const std::optional<DTensorArg>& dtensor) {
        const reshard::LayoutSpec spec = JobLayout(world_size, fsdp1, "keep", dtensor);
        if (spec.Key() != layout_key) {
          throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                               path + ": layout key \"" + layout_key +
                                   "\" is not the key of the layout described (\"" + spec.Key() +
                                   "\")");
        }
        reshard::RankFileHeader h;
        h.SetLayout(spec);
        h.rank = rank;
        h.source = reshard::SourceFingerprint::FromSaved({save_id, step});
        h.chunk_size = chunk_size;
        std::vector<reshard::SaveSource> sources;
        bool any_device = false;
        for (const SaveTensor& t : tensors) {
          auto d = reshard::ParseDType(t.dtype);
          if (!d) {
            throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                                 "tensor \"" + t.name + "\": unknown dtype " + t.dtype);
          }
          reshard::TensorEntry e;
          e.name = t.name;
          e.dtype = *d;
          e.global_shape = t.global_shape;
          e.local_shape = t.global_shape;
          e.sharded = t.rows.has_value();
          if (t.rows) {
            e.rows = {t.rows->first, t.rows->second};
            if (!e.local_shape.empty()) e.local_shape[0] = t.rows->second - t.rows->first;
          }
          if (t.flat) {
            // A rank's flat shard is c = ceil(numel / W) elements, zero-padded past numel.
            e.flat = t.flat;
            e.local_shape = {reshard::CeilDiv(t.flat->numel, world_size)};
          }
          if (spec.kind == reshard::LayoutKind::kDTensor) {
            // The local tensor of this mesh coordinate by its placements (formats/rank-file.md,
            // DTensor layouts); the writer checks nbytes against it.
            if (t.rows || t.flat) {
              throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                                   "tensor \"" + t.name + "\": rows or a flat object in a DTensor layout");
            }
            reshard::DTensorSharding s = ShardingOf(t.placements, spec.mesh.shape, t.fsdp_mesh_dim);
            e.sharded = false;
            e.local_shape = reshard::DTensorLocalShape(t.global_shape, s, spec.mesh.shape,
                                                       spec.mesh.Coordinate(rank), path + ": tensor \"" + t.name + "\"");
            e.dtensor = std::move(s);
          } else if (!t.placements.empty()) {
            throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                                 "tensor \"" + t.name + "\": placements outside a DTensor layout");
          }
          h.tensors.push_back(std::move(e));
          sources.push_back({t.name, reinterpret_cast<const void*>(t.ptr), t.nbytes, t.on_device});
          any_device |= t.on_device && t.nbytes > 0;
        }
        reshard::SaveOptions o;
        o.staging_bytes = staging_bytes;
        o.verify_data = verify;
        if (const double pause = g_save_pause_seconds; pause > 0) {
          o.before_tensor = [pause](size_t) {
            std::this_thread::sleep_for(std::chrono::duration<double>(pause));
          };
        }
        reshard::SaveReport r;
        {
          py::gil_scoped_release release;
          reshard::DeviceCopier* copier = nullptr;
          reshard::CopierLease lease;
          if (any_device) {
#ifdef RESHARD_HAVE_CUDA
            lease = Copiers()->Acquire(device, 1, 2);
            copier = lease.copier;
#else
            (void)device;
            throw reshard::Error(reshard::ErrorCode::kUnsupported,
                                 "this reshard build has no CUDA support; rebuild with a CUDA "
                                 "toolkit to save from a GPU");
#endif
          }
          r = reshard::SaveRankFile(path, std::move(h), sources, copier, o);
        }
        return r;
      },
      py::arg("path"), py::arg("layout_key"), py::arg("world_size"), py::arg("rank"),
      py::arg("save_id"), py::arg("step"), py::arg("tensors"),
      py::arg("chunk_size") = reshard::kDefaultChunkSize, py::arg("device") = 0,
      py::arg("staging_bytes") = 32ull << 20, py::arg("verify") = false,
      py::arg("fsdp1") = std::nullopt, py::arg("dtensor") = std::nullopt,
      "Writes one rank file atomically from SaveTensors. layout_key must be the key of the "
      "layout: fsdp2-wsN, with fsdp1=(wrap, use_orig_params, param_dtype) the FSDP1 one, with "
      "dtensor=(mesh names, mesh shape, plan name, plan xxh3) the DTensor one (each SaveTensor's "
      "placements and fsdp_mesh_dim give its local shape at mesh coordinate `rank`).");

  m.def(
      "layout_key",
      [](uint32_t world_size, const std::optional<Fsdp1Arg>& fsdp1, const std::string& dtype) {
        reshard::LayoutSpec spec = JobLayout(world_size, fsdp1);
        spec.dtype = dtype;
        spec.Normalize();
        return spec.Key();
      },
      py::arg("world_size"), py::arg("fsdp1") = std::nullopt, py::arg("dtype") = "keep",
      "Key of a layout: fsdp2-wsN[-policy], or with fsdp1=(wrap, use_orig_params, "
      "param_dtype) the key `reshard convert --layout fsdp1` gives those flags; dtype is the "
      "policy (keep, bf16, fp16, fp32).");

  m.def(
      "write_saved_manifest",
      [](const std::string& out, uint32_t world_size, uint64_t save_id,
         std::optional<uint64_t> step, const std::vector<std::string>& aux_files,
         const std::optional<Fsdp1Arg>& fsdp1, const std::optional<DTensorArg>& dtensor,
         const std::vector<std::string>& parts) {
        const reshard::LayoutSpec spec = JobLayout(world_size, fsdp1, "keep", dtensor);
        py::gil_scoped_release release;
        return reshard::WriteSavedManifest(out, spec,
                                           reshard::SourceFingerprint::FromSaved({save_id, step}),
                                           aux_files, parts)
            .key;
      },
      py::arg("out"), py::arg("world_size"), py::arg("save_id"), py::arg("step"),
      py::arg("aux_files"), py::arg("fsdp1") = std::nullopt, py::arg("dtensor") = std::nullopt,
      py::arg("parts") = std::vector<std::string>{},
      "After every rank file of a saved layout exists: checks them and writes OUT/reshard.json. "
      "fsdp1=(wrap, use_orig_params, param_dtype) for an FSDP1 layout, dtensor=(mesh names, "
      "mesh shape, plan name, plan xxh3) for a DTensor one; parts: the keys of the layouts one "
      "save writes the model as, when more than one (each holds part of it).");

  m.def(
      "plan_of_placements",
      [](const std::string& name, const std::vector<std::string>& mesh_names,
         const std::vector<uint32_t>& mesh_shape,
         const std::vector<std::tuple<std::string, size_t, bool, std::vector<std::string>, int>>& tensors) {
        reshard::MeshSpec mesh{mesh_names, mesh_shape};
        mesh.Check("mesh");
        std::vector<reshard::PlacedTensor> placed;
        placed.reserve(tensors.size());
        for (const auto& [tname, ndim, whole, placements, fsdp] : tensors) {
          placed.push_back({tname, ndim, whole, ShardingOf(placements, mesh_shape, fsdp)});
        }
        const reshard::ParallelPlan plan = reshard::PlanOfShardings(name, mesh, placed);
        reshard::LayoutSpec spec;
        spec.kind = reshard::LayoutKind::kDTensor;
        spec.mesh = mesh;
        spec.plan_name = plan.name;
        spec.plan_xxh3 = plan.xxh3;
        spec.Normalize();
        return py::make_tuple(spec.Key(), plan.name, plan.xxh3, reshard::CanonicalPlanJson(plan));
      },
      py::arg("name"), py::arg("mesh_names"), py::arg("mesh_shape"), py::arg("tensors"),
      "The parallel plan named `name` that gives each tensor (name, ndim, whole, placements, "
      "fsdp_mesh_dim) exactly its placements on the mesh (reshard/format/parallel_plan.h, "
      "PlanOfShardings): (layout key, plan name, plan xxh3, the plan's canonical JSON). Raises "
      "UnsupportedError naming the tensor when no plan can say them.");

  m.def(
      "dtensor_local_indices",
      [](const std::vector<uint64_t>& global_shape, const std::vector<std::string>& placements,
         const std::vector<uint32_t>& mesh_shape, const std::vector<uint32_t>& coordinate,
         int fsdp_mesh_dim) {
        const reshard::DTensorSharding s = ShardingOf(placements, mesh_shape, fsdp_mesh_dim);
        std::vector<std::vector<std::pair<uint64_t, uint64_t>>> out;
        for (const auto& runs : reshard::DTensorLocalIndices(global_shape, s, mesh_shape, coordinate, "dtensor")) {
          out.emplace_back();
          for (const auto& r : runs) out.back().emplace_back(r.start, r.length);
        }
        return out;
      },
      py::arg("global_shape"), py::arg("placements"), py::arg("mesh_shape"), py::arg("coordinate"),
      py::arg("fsdp_mesh_dim") = -1,
      "Per tensor dim, the (start, length) runs of global indices that the local tensor "
      "(DTensor.to_local()) of mesh coordinate `coordinate` holds, in order; placements as "
      "torch's str ('R', 'S(0)', '_S(0,2)'); fsdp_mesh_dim: fully_shard's mesh dim over a TP "
      "DTensor, applied last (reshard/format/dtensor.h).");

  // ---- test and benchmark hooks: not API ------------------------------------------------------
  py::module_ testing = m.def_submodule("_testing", "Test and benchmark hooks of reshard._C (not API).");
  testing.def(
      "dtensor_entry_elements",
      [](const std::vector<uint64_t>& global_shape, const std::vector<std::string>& placements,
         const std::vector<uint32_t>& mesh_shape, uint32_t rank, int fsdp_mesh_dim) {
        reshard::TensorEntry e;
        e.name = "t";
        e.dtype = reshard::DType::kF32;
        e.global_shape = global_shape;
        e.dtensor = ShardingOf(placements, mesh_shape, fsdp_mesh_dim);
        reshard::MeshSpec mesh;
        mesh.shape = mesh_shape;
        for (const auto& runs :
             reshard::DTensorLocalIndices(global_shape, *e.dtensor, mesh_shape, mesh.Coordinate(rank), "t")) {
          e.local_shape.push_back(reshard::CountOf(runs));
        }
        uint64_t numel = 1;
        for (uint64_t d : e.local_shape) numel *= d;
        e.nbytes = numel * 4;
        const reshard::EntryMap map =
            reshard::MapEntry(e, reshard::LayoutKind::kDTensor, static_cast<uint32_t>(mesh.Size()), rank, "t");
        std::vector<uint64_t> elements;
        for (const auto& seg : map.segments) {
          for (uint64_t i = 0; i < seg.count; ++i) elements.push_back(seg.SourceElementAt(i));
        }
        return py::make_tuple(e.local_shape, elements, map.segments.size());
      },
      py::arg("global_shape"), py::arg("placements"), py::arg("mesh_shape"), py::arg("rank"),
      py::arg("fsdp_mesh_dim") = -1,
      "(local_shape, source element of each entry element, segments) of the byte map of a DTensor "
      "entry (MapEntry), for small tensors.");
  testing.def(
      "read_header",
      [](const std::string& path) { return reshard::SerializeHeader(OpenRankFile(path).header()); },
      py::arg("path"), "A rank file's checked header as JSON text.");
  testing.def(
      "set_save_pause",
      [](double seconds) { g_save_pause_seconds = seconds; }, py::arg("seconds"),
      "Every later save sleeps this long before each tensor (to interrupt a save mid-write).");
  testing.def(
      "load_raw",
      [](const std::string& path,
         const std::vector<std::tuple<std::string, uintptr_t, uint64_t, bool>>& targets,
         int device, unsigned threads, bool verify, const std::string& io,
         std::optional<unsigned> slots_arg, std::optional<uint64_t> span_bytes, std::optional<uint64_t> cold_span_bytes,
         std::optional<unsigned> cold_threads, std::optional<uint64_t> hash_piece_bytes,
         std::optional<uint64_t> lead_in_bytes) {
        const unsigned slots = reshard::SlotsKnob(slots_arg);
        std::vector<reshard::LoadTarget> t;
        t.reserve(targets.size());
        for (const auto& [name, ptr, nbytes, on_device] : targets) {
          t.push_back({name, reinterpret_cast<void*>(ptr), nbytes, on_device});
        }
        reshard::LoadOptions o = reshard::KnobbedLoadOptions(
            threads, slots, {span_bytes, cold_span_bytes, cold_threads, hash_piece_bytes, lead_in_bytes});
        o.verify_checksums = verify;
        o.io = ParseIo(io);
        reshard::LoadStats r;
        reshard::LoadDiagnostics g;
        double copier_wait = 0, open_seconds = 0;
        {
          py::gil_scoped_release release;
          const auto t_open = std::chrono::steady_clock::now();
          reshard::RankFileReader reader = reshard::RankFileReader::Open(path, &Headers());
          open_seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_open).count();
          r = reshard::LoadThroughCache(Copiers(), reader, t, device, o, &g, &copier_wait);
        }
        py::dict d;
        d["bytes"] = r.bytes;
        d["stored_bytes"] = r.stored_bytes;
        d["tensors"] = r.tensors;
        d["seconds"] = r.seconds;
        d["gbps"] = r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0.0;
        d["staging_bytes"] = r.staging_bytes;
        d["staging_alloc_seconds"] = r.staging_alloc_seconds;
        d["copier_wait_seconds"] = copier_wait;
        d["residency_seconds"] = g.residency_seconds;
        d["sync_seconds"] = g.sync_seconds;
        d["read_seconds"] = g.read_seconds;
        d["wait_seconds"] = g.wait_seconds;
        d["first_copy_seconds"] = g.first_copy_seconds;
        d["reads_done_seconds"] = g.reads_done_seconds;
        d["lane_start_seconds"] = g.lane_start_seconds;
        d["lane_end_seconds"] = g.lane_end_seconds;
        d["issue_seconds"] = g.issue_seconds;
        d["lane_wall_seconds"] = g.lane_wall_seconds;
        d["lane_cpu_seconds"] = g.lane_cpu_seconds;
        d["preemptions"] = g.preemptions;
        d["lanes_on_shared_cpus"] = g.lanes_on_shared_cpus;
        d["open_seconds"] = open_seconds;  // opening and checking the file's header (not in seconds)
        d["header_cache_hits"] = Headers().hits();  // in this process, so far
        d["span_bytes"] = g.span_bytes;
        d["pooled"] = r.pooled;
        d["cold"] = r.cold;
        d["threads"] = r.threads;
        d["direct_io"] = r.direct_io;
        d["readahead"] = g.readahead;
        d["resident_fraction"] = g.resident_fraction;
        return d;
      },
      py::arg("path"), py::arg("targets"), py::arg("device") = 0, py::arg("threads") = 8,
      py::arg("verify") = true, py::arg("io") = "auto", py::arg("slots") = py::none(),
      py::arg("span_bytes") = py::none(), py::arg("cold_span_bytes") = py::none(),
      py::arg("cold_threads") = py::none(), py::arg("hash_piece_bytes") = py::none(),
      py::arg("lead_in_bytes") = py::none(),
      "The loader with every knob and its whole report (diagnostics included), from a path "
      "and (name, pointer, nbytes, on_device) tuples: for benchmarks.");

}
