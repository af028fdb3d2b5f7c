// A restricted reader of the `data.pkl` record of torch.save archives: it interprets a
// whitelist of pickle opcodes and globals (fsdp-layouts.md R32) into a description of the
// state dict's tensors. Nothing is ever imported or called: a global outside the whitelist
// is refused when it is named, before anything could use it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"

namespace reshard {

inline constexpr uint64_t kTorchPickleMaxSize = 256ull << 20;     // bytes of data.pkl
inline constexpr uint64_t kTorchPickleMaxObjects = 1ull << 24;    // objects built while reading
// Memory the reader may use for what it builds (objects, strings, lists, the memo, stack and
// marks, storages and tensors), as it counts it (vector growth included): about 3.5 KiB per
// tensor in torch.save's pickles, so ~300,000 tensors in one data.pkl. A file needing more is
// refused naming it, never read until the allocator fails.
inline constexpr uint64_t kTorchPickleMaxMemory = 1ull << 30;

/// One storage of the archive: persistent id ('storage', <type>, key, location, numel).
struct TorchStorage {
  std::string key;                // the record is "<prefix>/data/<key>"
  std::optional<DType> dtype;     // nullopt: torch.storage.UntypedStorage (numel counts bytes)
  std::string location;           // "cpu", "cuda:0", ... (informational)
  uint64_t numel = 0;             // elements of dtype (bytes when untyped)

  /// numel × element size; nullopt on overflow.
  std::optional<uint64_t> Nbytes() const;
};

/// One entry of the state dict: a strided view of a storage.
struct TorchTensor {
  std::string name;
  DType dtype;
  size_t storage = 0;             // index into TorchPickle::storages
  uint64_t storage_offset = 0;    // in elements of dtype
  std::vector<uint64_t> shape;
  std::vector<int64_t> stride;    // in elements

  /// True when the strides are the row-major ones for the shape (dims of size 1 and empty
  /// tensors may have any stride, as torch's is_contiguous allows).
  bool IsContiguous() const;
};

struct TorchPickle {
  std::vector<TorchStorage> storages;  // each key once, in order of first use
  std::vector<TorchTensor> tensors;    // in the dict's order
};

/// Parses a data.pkl (pickle protocol 2 to 5) that holds a dict or OrderedDict of name →
/// tensor, as torch.save(model.state_dict()) writes it. `path` names the record in errors.
///
/// Opcodes: PROTO FRAME STOP MARK NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1 BINFLOAT
/// BINUNICODE SHORT_BINUNICODE BINUNICODE8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST
/// APPEND APPENDS EMPTY_DICT SETITEM SETITEMS GLOBAL STACK_GLOBAL REDUCE BUILD BINPERSID
/// BINPUT LONG_BINPUT BINGET LONG_BINGET MEMOIZE.
/// Globals: collections.OrderedDict; torch._utils._rebuild_tensor_v2 / _rebuild_tensor_v3 /
/// _rebuild_parameter / _rebuild_parameter_with_state; torch._tensor._rebuild_from_type_v2
/// (with torch.Tensor or torch.nn.Parameter as the type); the storage classes torch.<X>Storage
/// and torch.storage.UntypedStorage; torch dtypes (torch.float8_e4m3fn, ...) as arguments.
///
/// Throws kUnsupported for an opcode or global outside the whitelist (naming it and its
/// position), for dtypes reshard cannot hold (complex128, quantized) and for tensor
/// metadata; kDataLoss for malformed or truncated pickles, wrong argument types, duplicate
/// names, and a top level that is not a dict of tensors.
TorchPickle ParseTorchPickle(std::string_view data, const std::string& path);

}  // namespace reshard
