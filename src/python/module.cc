// reshard._C: the Python binding. It takes raw pointers and sizes (no torch headers), so the
// extension is independent of the torch version; the torch-aware logic lives in
// python/reshard/. The GIL is released while data moves.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <mutex>
#include <tuple>

#include <unistd.h>

#include "reshard/base/dtype.h"
#include "reshard/base/error.h"
#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/file_io.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/build_info.h"
#include "reshard/runtime/loader.h"
#include "reshard/runtime/rank_writer.h"
#ifdef RESHARD_HAVE_CUDA
#include "reshard/cuda/cuda_copier.h"
#endif

namespace py = pybind11;

namespace {

// A tuning knob: the argument, else RESHARD_<NAME> from the environment (a whole number in
// [0, max]), else the loader's default (include/reshard/runtime/loader.h).
uint64_t Knob(std::optional<uint64_t> arg, const char* env, uint64_t fallback, uint64_t max) {
  uint64_t n = fallback;
  std::string text;
  if (arg) {
    n = *arg;
  } else if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {
    text = v;
    bool digits = text.size() <= 19;
    for (char c : text) digits &= c >= '0' && c <= '9';
    if (!digits) {
      throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                           std::string(env) + "=\"" + text + "\": expected a whole number of at most 19 digits");
    }
    n = std::stoull(text);
  }
  if (n > max) {
    throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                         std::string(arg ? "" : "environment ") + env + " = " + std::to_string(n) +
                             ": at most " + std::to_string(max));
  }
  return n;
}

#ifdef RESHARD_HAVE_CUDA
// Copiers are cached per (device, lanes, slots) so that streams and pinned staging are made
// once per process. prepare() makes one in the background (while the caller builds its
// model). A copier is used by one load, save or prepare at a time: each holds the copier's
// lease throughout (two at once would share lanes, and a Reserve during a load would re-carve
// the staging under it); a load that comes while a prepare runs waits for it.
struct CopierLease {
  reshard::DeviceCopier* copier = nullptr;
  reshard::WorkerPool* pool = nullptr;  // the copier's reader threads, one per lane
  std::unique_lock<std::mutex> lock;
};

class Copiers {
 public:
  static Copiers& Get() {
    static Copiers* c = new Copiers;  // never destroyed: process exit frees pinned memory,
    return *c;                        // and no copier outlives the CUDA runtime's teardown
  }

  CopierLease Acquire(int device, int lanes, int slots) {
    Entry* e = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (pid_ != ::getpid()) {
        // This process is a fork()ed child of the one that made the entries: it has neither
        // their pools' threads nor the parent's CUDA state, and an entry's `use` may be held
        // by a thread that does not exist here. Left alone (not destroyed), made anew.
        for (auto& [key, entry] : cache_) (void)entry.release();
        cache_.clear();
        pid_ = ::getpid();
      }
      auto& slot = cache_[{device, lanes, slots}];
      if (!slot) slot = std::make_unique<Entry>();
      e = slot.get();
    }
    std::unique_lock<std::mutex> use(e->use);
    if (!e->copier) {
      // RESHARD_STREAMS (for measuring): lanes sharing that many CUDA streams; read when the
      // copier is made, so once per process and (device, lanes, slots).
      const int streams = static_cast<int>(Knob(std::nullopt, "RESHARD_STREAMS", 0, 1024));
      e->copier = reshard::MakeCudaCopier(device, lanes, slots, streams);
    }
    // Started once with the copier (by prepare, in the background), so loads start no threads.
    if (!e->pool) e->pool = std::make_unique<reshard::WorkerPool>(static_cast<unsigned>(std::max(1, lanes)));
    return {e->copier.get(), e->pool.get(), std::move(use)};
  }

  // Creates the copier and reserves `slot_bytes` of staging per lane and slot on another
  // thread; returns at once. Errors are kept and raised by wait_prepared().
  void PrepareAsync(int device, int lanes, int slots, size_t slot_bytes) {
    std::lock_guard<std::mutex> g(prep_mu_);
    ForgetParentPreparesLocked();
    // RESHARD_WARMUP=0 (for measuring): no warm-up of the lanes.
    const bool warm = Knob(std::nullopt, "RESHARD_WARMUP", 1, 1) != 0;
    pending_.push_back(std::async(std::launch::async, [=, this] {
      CopierLease lease = Acquire(device, lanes, slots);
      lease.copier->Reserve(slot_bytes, lanes);
      // Each lane's one-time costs paid now, on the pool thread that will drive it in loads.
      if (warm) {
        lease.pool->Run(static_cast<unsigned>(lanes), [&](unsigned lane) {
          lease.copier->Warm(static_cast<int>(lane));
        });
      }
    }));
  }

  void WaitPrepared() {
    std::vector<std::future<void>> p;
    {
      std::lock_guard<std::mutex> g(prep_mu_);
      ForgetParentPreparesLocked();
      p.swap(pending_);
    }
    for (auto& f : p) f.get();  // rethrows the first error
  }

 private:
  // In a fork()ed child, the parent's pending prepares have no threads: waiting for (or
  // destroying) their futures would block forever. Left alone.
  void ForgetParentPreparesLocked() {
    if (prep_pid_ == ::getpid()) return;
    (void)new std::vector<std::future<void>>(std::move(pending_));
    pending_.clear();
    prep_pid_ = ::getpid();
  }

  struct Entry {
    std::mutex use;  // held by the one load / save / prepare using the copier
    std::unique_ptr<reshard::DeviceCopier> copier;
    std::unique_ptr<reshard::WorkerPool> pool;
  };
  std::mutex mu_;  // guards cache_ and pid_
  std::map<std::tuple<int, int, int>, std::unique_ptr<Entry>> cache_;
  pid_t pid_ = ::getpid();  // the process that made cache_'s entries
  std::mutex prep_mu_;      // guards pending_ and prep_pid_
  std::vector<std::future<void>> pending_;
  pid_t prep_pid_ = ::getpid();
};

CopierLease CachedCopier(int device, int lanes, int slots) {
  return Copiers::Get().Acquire(device, lanes, slots);
}
#endif

// Rank file headers parsed in this process (reshard.load reads a file's header to check the
// model against it, then loads it: the second open reuses the parse).
reshard::HeaderCache& Headers() {
  static auto* cache = new reshard::HeaderCache(64);  // never destroyed, as Copiers
  return *cache;
}

// Staging slots per reader thread: the argument, else RESHARD_SLOTS, else 2.
unsigned Slots(std::optional<unsigned> arg) {
  return static_cast<unsigned>(std::max<uint64_t>(
      1, Knob(arg ? std::optional<uint64_t>(*arg) : std::nullopt, "RESHARD_SLOTS", 2, 64)));
}

reshard::LoadOptions TunedOptions(unsigned threads, unsigned slots,
                                  std::optional<uint64_t> span_bytes,
                                  std::optional<uint64_t> cold_span_bytes,
                                  std::optional<unsigned> cold_threads,
                                  std::optional<uint64_t> hash_piece_bytes,
                                  std::optional<uint64_t> lead_in_bytes = std::nullopt) {
  constexpr uint64_t kMaxSpan = 1ull << 30;  // a staging slot of 1 GiB is already absurd
  reshard::LoadOptions o;
  o.threads = threads;
  o.slots_per_thread = slots;
  o.span_bytes = Knob(span_bytes, "RESHARD_SPAN_BYTES", o.span_bytes, kMaxSpan);
  o.cold_span_bytes = Knob(cold_span_bytes, "RESHARD_COLD_SPAN_BYTES", o.cold_span_bytes, kMaxSpan);
  o.cold_threads = static_cast<unsigned>(
      Knob(cold_threads ? std::optional<uint64_t>(*cold_threads) : std::nullopt,
           "RESHARD_COLD_THREADS", o.cold_threads, 1024));
  o.hash_piece_bytes = Knob(hash_piece_bytes, "RESHARD_HASH_PIECE_BYTES", o.hash_piece_bytes, kMaxSpan);
  o.lead_in_bytes = Knob(lead_in_bytes, "RESHARD_LEAD_IN_BYTES", o.lead_in_bytes, kMaxSpan);
  return o;
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
// One flat object (formats/rank-file.md, FSDP1 layouts): (unit, numel, aligned_numel,
// params as (fqn, key, shape, offset), shared).
using FlatParamArg = std::tuple<std::string, std::string, std::vector<uint64_t>, uint64_t>;
using FlatArg = std::tuple<std::string, uint64_t, uint64_t, std::vector<FlatParamArg>,
                           std::vector<std::string>>;

// The layout a save writes: FSDP2 without `fsdp1`, else FSDP1 with its fields; dtype policy
// "keep" (saved bytes are the live ones). Normalized as `reshard convert` normalizes it.
reshard::LayoutSpec SavedLayout(uint32_t world_size, const std::optional<Fsdp1Arg>& fsdp1) {
  reshard::LayoutSpec spec;
  spec.world_size = world_size;
  spec.dtype = "keep";
  if (fsdp1) {
    spec.kind = reshard::LayoutKind::kFsdp1;
    std::tie(spec.wrap, spec.use_orig_params, spec.param_dtype) = *fsdp1;
  }
  spec.Normalize();
  return spec;
}

std::shared_ptr<const reshard::FlatInfo> MakeFlat(const std::string& entry, const FlatArg& arg) {
  auto flat = std::make_shared<reshard::FlatInfo>();
  const auto& [unit, numel, aligned_numel, params, shared] = arg;
  flat->unit = unit;
  flat->numel = numel;
  flat->aligned_numel = aligned_numel;
  flat->shared = shared;
  for (const auto& [fqn, key, shape, offset] : params) {
    reshard::FlatParamInfo p;
    p.fqn = fqn;
    p.key = key;
    p.shape = shape;
    p.offset = offset;
    p.numel = 1;
    for (uint64_t d : shape) p.numel = reshard::CheckedMul(p.numel, d, "tensor \"" + entry + "\": " + fqn);
    flat->params.push_back(std::move(p));
  }
  return flat;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "reshard native module";
  py::register_exception<reshard::Error>(m, "ReshardError", PyExc_RuntimeError);

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
    d["openmp"] = b.openmp;
    d["openmp_version"] = b.openmp_version;
    d["xxhash_version"] = b.xxhash_version;
    d["compiler"] = b.compiler;
    d["build_type"] = b.build_type;
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

  m.def(
      "read_header",
      [](const std::string& path) {
        reshard::RankFileReader r = reshard::RankFileReader::Open(path, &Headers());
        return reshard::SerializeHeader(r.header());
      },
      py::arg("path"),
      "Validates a rank file's preamble and header and returns the header as JSON text.");

  m.def("page_cache_residency", &reshard::PageCacheResidency, py::arg("path"));

  m.def(
      "load",
      [](const std::string& path,
         const std::vector<std::tuple<std::string, uintptr_t, uint64_t, bool>>& targets,
         int device, unsigned threads, bool verify, const std::string& io,
         std::optional<unsigned> slots_arg, std::optional<uint64_t> span_bytes, std::optional<uint64_t> cold_span_bytes,
         std::optional<unsigned> cold_threads, std::optional<uint64_t> hash_piece_bytes,
         std::optional<uint64_t> lead_in_bytes) {
        const unsigned slots = Slots(slots_arg);
        std::vector<reshard::LoadTarget> t;
        t.reserve(targets.size());
        bool any_device = false;
        for (const auto& [name, ptr, nbytes, on_device] : targets) {
          t.push_back({name, reinterpret_cast<void*>(ptr), nbytes, on_device});
          any_device |= on_device;
        }
        reshard::LoadOptions o = TunedOptions(threads, slots, span_bytes, cold_span_bytes,
                                              cold_threads, hash_piece_bytes, lead_in_bytes);
        o.verify_checksums = verify;
        o.io = ParseIo(io);
        reshard::LoadReport r;
        double copier_wait = 0, open_seconds = 0;
        {
          py::gil_scoped_release release;
          const auto t_open = std::chrono::steady_clock::now();
          reshard::RankFileReader reader = reshard::RankFileReader::Open(path, &Headers());
          open_seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_open).count();
          reshard::DeviceCopier* copier = nullptr;
#ifdef RESHARD_HAVE_CUDA
          CopierLease lease;
#endif
          if (any_device) {
#ifdef RESHARD_HAVE_CUDA
            const unsigned lanes = std::max<unsigned>(1, threads);
            const auto t0 = std::chrono::steady_clock::now();
            lease = CachedCopier(device, static_cast<int>(lanes), static_cast<int>(slots));
            copier = lease.copier;
            o.pool = lease.pool;
            // Waiting for a prepare still running (or another load) is part of this load.
            copier_wait =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#else
            throw reshard::Error(reshard::ErrorCode::kUnsupported,
                                 "this reshard build has no CUDA support; rebuild with a CUDA "
                                 "toolkit to load onto a GPU");
#endif
          }
          r = reshard::LoadRankFile(reader, t, copier, o);
          r.seconds += copier_wait;
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
        d["residency_seconds"] = r.residency_seconds;
        d["sync_seconds"] = r.sync_seconds;
        d["read_seconds"] = r.read_seconds;
        d["wait_seconds"] = r.wait_seconds;
        d["first_copy_seconds"] = r.first_copy_seconds;
        d["reads_done_seconds"] = r.reads_done_seconds;
        d["lane_start_seconds"] = r.lane_start_seconds;
        d["lane_end_seconds"] = r.lane_end_seconds;
        d["issue_seconds"] = r.issue_seconds;
        d["lane_wall_seconds"] = r.lane_wall_seconds;
        d["lane_cpu_seconds"] = r.lane_cpu_seconds;
        d["preemptions"] = r.preemptions;
        d["lanes_on_shared_cpus"] = r.lanes_on_shared_cpus;
        d["open_seconds"] = open_seconds;  // opening and checking the file's header (not in seconds)
        d["header_cache_hits"] = Headers().hits();  // in this process, so far
        d["span_bytes"] = r.span_bytes;
        d["pooled"] = r.pooled;
        d["cold"] = r.cold;
        d["threads"] = r.threads;
        d["direct_io"] = r.direct_io;
        d["readahead"] = r.readahead;
        d["resident_fraction"] = r.resident_fraction;
        return d;
      },
      py::arg("path"), py::arg("targets"), py::arg("device") = 0, py::arg("threads") = 8,
      py::arg("verify") = true, py::arg("io") = "auto", py::arg("slots") = py::none(),
      py::arg("span_bytes") = py::none(), py::arg("cold_span_bytes") = py::none(),
      py::arg("cold_threads") = py::none(), py::arg("hash_piece_bytes") = py::none(),
      py::arg("lead_in_bytes") = py::none(),
      "Loads tensors of one rank file into raw destinations: targets are "
      "(name, pointer, nbytes, on_device) tuples.");

  m.def(
      "prepare",
      [](int device, unsigned threads, std::optional<unsigned> slots_arg,
         std::optional<uint64_t> slot_bytes, bool wait) {
        unsigned slots = Slots(slots_arg);
#ifdef RESHARD_HAVE_CUDA
        if (reshard::CudaDeviceCount() <= device || device < 0) {
          throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                               "prepare: CUDA device " + std::to_string(device) + " is not visible");
        }
        threads = std::max(1u, threads);
        slots = std::max(1u, slots);
        // Enough for a warm and a cold load with this process's knobs (default chunk size).
        const reshard::LoadOptions o =
            TunedOptions(threads, slots, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
        Copiers::Get().PrepareAsync(
            device, static_cast<int>(threads), static_cast<int>(slots),
            slot_bytes.value_or(reshard::PreparedSlotBytes(o, reshard::kDefaultChunkSize)));
        if (wait) {
          py::gil_scoped_release release;
          Copiers::Get().WaitPrepared();
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
    Copiers::Get().WaitPrepared();
#endif
  }, "Waits for every prepare() still running; raises the first error one of them met.");

  // ---- save: one rank file of a live model (formats/rank-file.md, source.saved) ----------
  using SaveTensor = std::tuple<std::string, std::string, std::vector<uint64_t>, bool, uint64_t,
                                uint64_t, uintptr_t, uint64_t, bool>;
  m.def(
      "save",
      [](const std::string& path, const std::string& layout_key, uint32_t world_size,
         uint32_t rank, uint64_t save_id, std::optional<uint64_t> step,
         const std::vector<SaveTensor>& tensors, uint64_t chunk_size, int device,
         uint64_t staging_bytes, bool verify, double pause_seconds,
         const std::optional<Fsdp1Arg>& fsdp1, const std::map<std::string, FlatArg>& flat) {
        const reshard::LayoutSpec spec = SavedLayout(world_size, fsdp1);
        if (spec.Key() != layout_key) {
          throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                               path + ": layout key \"" + layout_key +
                                   "\" is not the key of the layout described (\"" + spec.Key() +
                                   "\")");
        }
        reshard::RankFileHeader h;
        h.layout_key = layout_key;
        h.kind = spec.kind;
        h.world_size = world_size;
        h.dtype_policy = spec.dtype;
        h.wrap = spec.wrap;
        h.use_orig_params = spec.use_orig_params;
        h.param_dtype = spec.param_dtype;
        h.rank = rank;
        h.source = reshard::SourceFingerprint::FromSaved({save_id, step});
        h.chunk_size = chunk_size;
        std::vector<reshard::SaveSource> sources;
        bool any_device = false;
        for (const auto& [name, dtype, shape, sharded, start, end, ptr, nbytes, on_device] :
             tensors) {
          auto d = reshard::ParseDType(dtype);
          if (!d) {
            throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                                 "tensor \"" + name + "\": unknown dtype " + dtype);
          }
          reshard::TensorEntry e;
          e.name = name;
          e.dtype = *d;
          e.global_shape = shape;
          e.local_shape = shape;
          e.sharded = sharded;
          if (sharded) {
            e.rows = {start, end};
            if (!shape.empty()) e.local_shape[0] = end - start;
          }
          if (auto it = flat.find(name); it != flat.end()) {
            // A rank's flat shard is c = ceil(numel / W) elements, zero-padded past numel.
            e.flat = MakeFlat(name, it->second);
            e.local_shape = {reshard::CeilDiv(e.flat->numel, world_size)};
          }
          h.tensors.push_back(std::move(e));
          sources.push_back({name, reinterpret_cast<const void*>(ptr), nbytes, on_device});
          any_device |= on_device && nbytes > 0;
        }
        for (const auto& [name, _] : flat) {
          if (!h.Find(name)) {
            throw reshard::Error(reshard::ErrorCode::kInvalidArgument,
                                 path + ": a flat object for \"" + name + "\", which is no tensor");
          }
        }
        reshard::SaveOptions o;
        o.staging_bytes = staging_bytes;
        o.verify_data = verify;
        if (pause_seconds > 0) {  // test hook: a save that can be interrupted between tensors
          o.before_tensor = [pause_seconds](size_t) {
            std::this_thread::sleep_for(std::chrono::duration<double>(pause_seconds));
          };
        }
        reshard::SaveReport r;
        {
          py::gil_scoped_release release;
          reshard::DeviceCopier* copier = nullptr;
#ifdef RESHARD_HAVE_CUDA
          CopierLease lease;
#endif
          if (any_device) {
#ifdef RESHARD_HAVE_CUDA
            lease = CachedCopier(device, 1, 2);
            copier = lease.copier;
#else
            throw reshard::Error(reshard::ErrorCode::kUnsupported,
                                 "this reshard build has no CUDA support; rebuild with a CUDA "
                                 "toolkit to save from a GPU");
#endif
          }
          r = reshard::SaveRankFile(path, std::move(h), sources, copier, o);
        }
        py::dict d;
        d["bytes"] = r.bytes;
        d["file_size"] = r.file_size;
        d["header_xxh3"] = r.header_xxh3;
        d["staging_bytes"] = r.staging_bytes;
        d["seconds"] = r.seconds;
        return d;
      },
      py::arg("path"), py::arg("layout_key"), py::arg("world_size"), py::arg("rank"),
      py::arg("save_id"), py::arg("step"), py::arg("tensors"),
      py::arg("chunk_size") = reshard::kDefaultChunkSize, py::arg("device") = 0,
      py::arg("staging_bytes") = 32ull << 20, py::arg("verify") = false,
      py::arg("pause_seconds") = 0.0, py::arg("fsdp1") = std::nullopt,
      py::arg("flat") = std::map<std::string, FlatArg>{},
      "Writes one rank file atomically from raw sources: tensors are (name, dtype, "
      "global_shape, sharded, row_start, row_end, pointer, nbytes, on_device) tuples. "
      "layout_key must be the key of the layout: fsdp2-wsN, or with fsdp1=(wrap, "
      "use_orig_params, param_dtype) the FSDP1 one; flat maps entry names to their flat "
      "objects (unit, numel, aligned_numel, [(fqn, key, shape, offset)], shared), whose "
      "local shape is then [ceil(numel / world_size)].");

  m.def(
      "layout_key",
      [](uint32_t world_size, const std::optional<Fsdp1Arg>& fsdp1) {
        return SavedLayout(world_size, fsdp1).Key();
      },
      py::arg("world_size"), py::arg("fsdp1") = std::nullopt,
      "Key of the layout a save writes (dtype policy keep): fsdp2-wsN, or with "
      "fsdp1=(wrap, use_orig_params, param_dtype) the key `reshard convert --layout fsdp1` "
      "gives those flags.");

  m.def(
      "write_saved_manifest",
      [](const std::string& out, uint32_t world_size, uint64_t save_id,
         std::optional<uint64_t> step, const std::vector<std::string>& aux_files,
         const std::optional<Fsdp1Arg>& fsdp1) {
        const reshard::LayoutSpec spec = SavedLayout(world_size, fsdp1);
        py::gil_scoped_release release;
        return reshard::WriteSavedManifest(out, spec,
                                           reshard::SourceFingerprint::FromSaved({save_id, step}),
                                           aux_files)
            .key;
      },
      py::arg("out"), py::arg("world_size"), py::arg("save_id"), py::arg("step"),
      py::arg("aux_files"), py::arg("fsdp1") = std::nullopt,
      "After every rank file of a saved layout exists: checks them and writes OUT/reshard.json. "
      "fsdp1=(wrap, use_orig_params, param_dtype) for an FSDP1 layout.");
}
