// Generators of torch.save-like archives for the tests: a ZIP writer (written from PKWARE's
// APPNOTE: local headers, central directory, ZIP64 records), a pickle opcode writer (from
// Python's pickletools documentation) and a state-dict pickler that emits what
// torch.save(state_dict) emits (fsdp-layouts.md R31/R32). Independent of the library's
// readers, and able to produce every malformation the tests need.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace reshard::test {

// ---- ZIP ----------------------------------------------------------------------------------

struct ZipRecord {
  std::string name;
  std::string data;
};

struct ZipOptions {
  bool zip64_records = true;       // ZIP64 end record and locator (torch always writes them)
  bool force_zip64_fields = false;  // 0xffffffff in sizes/offsets + ZIP64 extra fields
  uint16_t method = 0;             // written into both headers (data stays uncompressed)
  uint16_t flags = 0x0808;         // data descriptor + UTF-8, as torch's writer
  uint64_t alignment = 64;         // data offsets are multiples of this (extra-field padding)
};

struct ZipLayout {
  std::string bytes;
  std::vector<uint64_t> local_offsets;  // per record
  std::vector<uint64_t> data_offsets;   // per record
  std::vector<uint64_t> cd_entry_offsets;
  uint64_t cd_offset = 0;
  uint64_t cd_size = 0;
  uint64_t eocd64_offset = 0;  // 0 when absent
  uint64_t locator_offset = 0;
  uint64_t eocd_offset = 0;
};

/// CRC-32 computed bit by bit (no table), independent of the library's.
uint32_t RefCrc32(std::string_view data);

ZipLayout BuildZip(const std::vector<ZipRecord>& records, const ZipOptions& options = {});

// ---- pickle -------------------------------------------------------------------------------

class PickleWriter {
 public:
  PickleWriter& Proto(int p);
  PickleWriter& Op(uint8_t op);  // any single-byte opcode without operand
  PickleWriter& Raw(std::string_view bytes);
  PickleWriter& Global(std::string_view module, std::string_view name);  // GLOBAL
  PickleWriter& StackGlobal(std::string_view module, std::string_view name);
  PickleWriter& Str(std::string_view s);       // BINUNICODE
  PickleWriter& ShortStr(std::string_view s);  // SHORT_BINUNICODE
  PickleWriter& Str8(std::string_view s);      // BINUNICODE8
  PickleWriter& Int(int64_t v);                // BININT1 / BININT2 / BININT / LONG1
  PickleWriter& Long1(std::string_view le_bytes);
  PickleWriter& Float(double v);               // BINFLOAT
  PickleWriter& Put(uint32_t i);               // BINPUT / LONG_BINPUT
  PickleWriter& Get(uint32_t i);               // BINGET / LONG_BINGET
  PickleWriter& Memoize();
  PickleWriter& Mark() { return Op('('); }
  PickleWriter& Tuple() { return Op('t'); }
  PickleWriter& Tuple2() { return Op(0x86); }
  PickleWriter& EmptyTuple() { return Op(')'); }
  PickleWriter& EmptyDict() { return Op('}'); }
  PickleWriter& Reduce() { return Op('R'); }
  PickleWriter& Stop() { return Op('.'); }
  PickleWriter& Frame(uint64_t n);
  std::string Take() const { return out_; }

 private:
  std::string out_;
};

/// One tensor of a pickled state dict.
struct PickledTensor {
  std::string name;
  std::string storage_type;  // "FloatStorage", ... or "UntypedStorage" (then torch_dtype)
  std::string torch_dtype;   // for _rebuild_tensor_v3: "float8_e4m3fn", ...
  std::string key;           // storage key
  uint64_t storage_numel = 0;
  uint64_t offset = 0;
  std::vector<uint64_t> shape;
  std::vector<int64_t> stride;  // empty: row-major
  bool parameter = false;       // wrap in torch._utils._rebuild_parameter
  bool from_type = false;       // wrap in torch._tensor._rebuild_from_type_v2
};

struct PickleStyle {
  int protocol = 2;            // 2: GLOBAL/BINPUT, 4: FRAME/STACK_GLOBAL/MEMOIZE/SHORT_BINUNICODE
  bool ordered = true;         // OrderedDict (with a BUILD of _metadata) or a plain dict
  bool memoize_storages = true;  // BINGET the storage type and key strings like torch does
};

/// data.pkl of a state dict holding `tensors` in order.
std::string StateDictPickle(const std::vector<PickledTensor>& tensors,
                            const PickleStyle& style = {});

/// A whole archive: <prefix>/data.pkl, .format_version, .storage_alignment, byteorder,
/// data/<key> for each storage (bytes from `storages`), version.
struct StorageBytes {
  std::string key;
  std::string data;
};
ZipLayout TorchArchive(const std::string& prefix, const std::string& pickle,
                       const std::vector<StorageBytes>& storages, const ZipOptions& options = {});

}  // namespace reshard::test
