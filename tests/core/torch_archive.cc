#include "core/torch_archive.h"

#include <cstdint>
#include <cstring>
#include <map>

namespace reshard::test {

namespace {

void PutLe(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t RefCrc32(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : data) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

ZipLayout BuildZip(const std::vector<ZipRecord>& records, const ZipOptions& o) {
  ZipLayout z;
  std::string& b = z.bytes;
  const uint32_t marker32 = 0xFFFFFFFFu;
  for (const auto& r : records) {
    const uint64_t lho = b.size();
    z.local_offsets.push_back(lho);
    PutLe(b, 0x04034b50, 4);
    PutLe(b, o.force_zip64_fields ? 45 : 20, 2);
    PutLe(b, o.flags, 2);
    PutLe(b, o.method, 2);
    PutLe(b, 0, 2);  // time
    PutLe(b, 0, 2);  // date
    PutLe(b, RefCrc32(r.data), 4);
    PutLe(b, r.data.size(), 4);
    PutLe(b, r.data.size(), 4);
    PutLe(b, r.name.size(), 2);
    uint64_t pad = 0;
    if (o.alignment > 1) {
      const uint64_t unpadded = lho + 30 + r.name.size() + 4;
      pad = (o.alignment - unpadded % o.alignment) % o.alignment;
    }
    const bool extra = o.alignment > 1;
    PutLe(b, extra ? 4 + pad : 0, 2);
    b += r.name;
    if (extra) {
      PutLe(b, 0x4246, 2);  // "FB", the id torch's writer uses for padding
      PutLe(b, pad, 2);
      b.append(pad, 'Z');
    }
    z.data_offsets.push_back(b.size());
    b += r.data;
    if (o.flags & 0x8) {  // data descriptor
      PutLe(b, 0x08074b50, 4);
      PutLe(b, RefCrc32(r.data), 4);
      PutLe(b, r.data.size(), 4);
      PutLe(b, r.data.size(), 4);
    }
  }
  z.cd_offset = b.size();
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    z.cd_entry_offsets.push_back(b.size());
    std::string x;
    if (o.force_zip64_fields) {
      PutLe(x, 0x0001, 2);
      PutLe(x, 24, 2);
      PutLe(x, r.data.size(), 8);
      PutLe(x, r.data.size(), 8);
      PutLe(x, z.local_offsets[i], 8);
    }
    PutLe(b, 0x02014b50, 4);
    PutLe(b, 0x031e, 2);  // made by
    PutLe(b, o.force_zip64_fields ? 45 : 20, 2);
    PutLe(b, o.flags, 2);
    PutLe(b, o.method, 2);
    PutLe(b, 0, 2);
    PutLe(b, 0, 2);
    PutLe(b, RefCrc32(r.data), 4);
    PutLe(b, o.force_zip64_fields ? marker32 : r.data.size(), 4);
    PutLe(b, o.force_zip64_fields ? marker32 : r.data.size(), 4);
    PutLe(b, r.name.size(), 2);
    PutLe(b, x.size(), 2);
    PutLe(b, 0, 2);  // comment
    PutLe(b, 0, 2);  // disk
    PutLe(b, 0, 2);  // internal attributes
    PutLe(b, 0, 4);  // external attributes
    PutLe(b, o.force_zip64_fields ? marker32 : z.local_offsets[i], 4);
    b += r.name;
    b += x;
  }
  z.cd_size = b.size() - z.cd_offset;
  if (o.zip64_records || o.force_zip64_fields) {
    z.eocd64_offset = b.size();
    PutLe(b, 0x06064b50, 4);
    PutLe(b, 44, 8);
    PutLe(b, 45, 2);
    PutLe(b, 45, 2);
    PutLe(b, 0, 4);
    PutLe(b, 0, 4);
    PutLe(b, records.size(), 8);
    PutLe(b, records.size(), 8);
    PutLe(b, z.cd_size, 8);
    PutLe(b, z.cd_offset, 8);
    z.locator_offset = b.size();
    PutLe(b, 0x07064b50, 4);
    PutLe(b, 0, 4);
    PutLe(b, z.eocd64_offset, 8);
    PutLe(b, 1, 4);
  }
  z.eocd_offset = b.size();
  PutLe(b, 0x06054b50, 4);
  PutLe(b, 0, 2);
  PutLe(b, 0, 2);
  PutLe(b, o.force_zip64_fields ? 0xFFFF : records.size(), 2);
  PutLe(b, o.force_zip64_fields ? 0xFFFF : records.size(), 2);
  PutLe(b, o.force_zip64_fields ? marker32 : z.cd_size, 4);
  PutLe(b, o.force_zip64_fields ? marker32 : z.cd_offset, 4);
  PutLe(b, 0, 2);
  return z;
}

// ---- pickle -----------------------------------------------------------------------------

PickleWriter& PickleWriter::Proto(int p) {
  out_.push_back(static_cast<char>(0x80));
  out_.push_back(static_cast<char>(p));
  return *this;
}
PickleWriter& PickleWriter::Op(uint8_t op) {
  out_.push_back(static_cast<char>(op));
  return *this;
}
PickleWriter& PickleWriter::Raw(std::string_view bytes) {
  out_ += bytes;
  return *this;
}
PickleWriter& PickleWriter::Global(std::string_view module, std::string_view name) {
  out_ += 'c';
  out_ += module;
  out_ += '\n';
  out_ += name;
  out_ += '\n';
  return *this;
}
PickleWriter& PickleWriter::StackGlobal(std::string_view module, std::string_view name) {
  ShortStr(module);
  ShortStr(name);
  return Op(0x93);
}
PickleWriter& PickleWriter::Str(std::string_view s) {
  out_ += 'X';
  PutLe(out_, s.size(), 4);
  out_ += s;
  return *this;
}
PickleWriter& PickleWriter::ShortStr(std::string_view s) {
  out_.push_back(static_cast<char>(0x8c));
  PutLe(out_, s.size(), 1);
  out_ += s;
  return *this;
}
PickleWriter& PickleWriter::Str8(std::string_view s) {
  out_.push_back(static_cast<char>(0x8d));
  PutLe(out_, s.size(), 8);
  out_ += s;
  return *this;
}
PickleWriter& PickleWriter::Int(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += 'K';
    PutLe(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    out_ += 'M';
    PutLe(out_, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += 'J';
    PutLe(out_, static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    // LONG1: the shortest two's complement little-endian form.
    std::string le;
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) le.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    while (le.size() > 1) {
      const auto last = static_cast<unsigned char>(le.back());
      const auto prev = static_cast<unsigned char>(le[le.size() - 2]);
      if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) {
        le.pop_back();
      } else {
        break;
      }
    }
    Long1(le);
  }
  return *this;
}
PickleWriter& PickleWriter::Long1(std::string_view le_bytes) {
  out_.push_back(static_cast<char>(0x8a));
  PutLe(out_, le_bytes.size(), 1);
  out_ += le_bytes;
  return *this;
}
PickleWriter& PickleWriter::Float(double v) {
  out_ += 'G';
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  return *this;
}
PickleWriter& PickleWriter::Put(uint32_t i) {
  if (i < 256) {
    out_ += 'q';
    PutLe(out_, i, 1);
  } else {
    out_ += 'r';
    PutLe(out_, i, 4);
  }
  return *this;
}
PickleWriter& PickleWriter::Get(uint32_t i) {
  if (i < 256) {
    out_ += 'h';
    PutLe(out_, i, 1);
  } else {
    out_ += 'j';
    PutLe(out_, i, 4);
  }
  return *this;
}
PickleWriter& PickleWriter::Memoize() { return Op(0x94); }
PickleWriter& PickleWriter::Frame(uint64_t n) {
  out_.push_back(static_cast<char>(0x95));
  PutLe(out_, n, 8);
  return *this;
}

namespace {

// Emits pickles the way CPython's pickler does for torch's reduce tuples, with a memo.
class StatePickler {
 public:
  explicit StatePickler(const PickleStyle& s) : s_(s) {}

  std::string Run(const std::vector<PickledTensor>& tensors) {
    w_.Proto(s_.protocol);
    if (s_.ordered) {
      Global("collections", "OrderedDict");
      w_.EmptyTuple().Reduce();
      Memo();
    } else {
      w_.EmptyDict();
      Memo();
    }
    w_.Mark();
    for (const auto& t : tensors) {
      String(t.name);
      Tensor(t);
    }
    w_.Op('u');  // SETITEMS
    if (s_.ordered) {
      // state: {"_metadata": OrderedDict({"": {"version": 1}})}, set by BUILD.
      w_.EmptyDict();
      Memo();
      String("_metadata");
      Global("collections", "OrderedDict");
      w_.EmptyTuple().Reduce();
      Memo();
      String("");
      w_.EmptyDict();
      Memo();
      String("version");
      w_.Int(1).Op('s');  // SETITEM
      w_.Op('s');
      w_.Op('s');
      w_.Op('b');  // BUILD
    }
    w_.Stop();
    std::string body = w_.Take();
    if (s_.protocol >= 4) {
      // One frame after PROTO, as CPython writes small pickles.
      PickleWriter f;
      f.Proto(s_.protocol).Frame(body.size() - 2);
      return f.Take() + body.substr(2);
    }
    return body;
  }

 private:
  void Memo() {
    if (s_.protocol >= 4) {
      w_.Memoize();
    } else {
      w_.Put(next_);
    }
    ++next_;
  }
  void String(const std::string& v) {
    auto it = strings_.find(v);
    if (s_.memoize_storages && it != strings_.end()) {
      w_.Get(it->second);
      return;
    }
    if (s_.protocol >= 4 && v.size() < 256) {
      w_.ShortStr(v);
    } else {
      w_.Str(v);
    }
    strings_[v] = next_;
    Memo();
  }
  void Global(const std::string& module, const std::string& name) {
    const std::string k = module + "\n" + name;
    auto it = globals_.find(k);
    if (it != globals_.end()) {
      w_.Get(it->second);
      return;
    }
    if (s_.protocol >= 4) {
      String(module);
      String(name);
      w_.Op(0x93);
    } else {
      w_.Global(module, name);
    }
    globals_[k] = next_;
    Memo();
  }
  void IntTuple(const std::vector<int64_t>& v) {
    if (v.empty()) {
      w_.EmptyTuple();
      return;
    }
    if (v.size() <= 3) {
      for (auto x : v) w_.Int(x);
      w_.Op(static_cast<uint8_t>(0x84 + v.size()));
    } else {
      w_.Mark();
      for (auto x : v) w_.Int(x);
      w_.Tuple();
    }
    Memo();
  }
  void Tensor(const PickledTensor& t) {
    if (t.from_type) {
      Global("torch._tensor", "_rebuild_from_type_v2");
      w_.Mark();
    }
    if (t.parameter) Global("torch._utils", "_rebuild_parameter");
    if (t.parameter) w_.Mark();
    const bool v3 = t.storage_type == "UntypedStorage";
    if (t.from_type) {
      Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
      Global("torch._tensor", "Tensor");
      w_.Mark();
    } else {
      Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
      w_.Mark();
    }
    // persistent id ('storage', type, key, 'cpu', numel)
    w_.Mark();
    String("storage");
    Global(v3 ? "torch.storage" : "torch", t.storage_type);
    String(t.key);
    String("cpu");
    w_.Int(static_cast<int64_t>(t.storage_numel));
    w_.Tuple();
    Memo();
    w_.Op('Q');  // BINPERSID
    w_.Int(static_cast<int64_t>(t.offset));
    std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
    std::vector<int64_t> stride = t.stride;
    if (stride.empty()) {
      stride.resize(shape.size());
      int64_t s = 1;
      for (size_t i = shape.size(); i-- > 0;) {
        stride[i] = s;
        s *= shape[i];
      }
    }
    IntTuple(shape);
    IntTuple(stride);
    w_.Op(0x89);  // NEWFALSE
    Global("collections", "OrderedDict");
    w_.EmptyTuple().Reduce();
    Memo();
    if (v3) Global("torch", t.torch_dtype);
    w_.Tuple();
    Memo();
    if (t.from_type) {  // (func, type, args, state) closes the outer MARK
      w_.EmptyDict();
      Memo();
      w_.Tuple();
      Memo();
      w_.Reduce();
      Memo();
    } else {
      w_.Reduce();
      Memo();
    }
    if (t.parameter) {
      w_.Op(0x88);  // NEWTRUE
      Global("collections", "OrderedDict");
      w_.EmptyTuple().Reduce();
      Memo();
      w_.Tuple();
      Memo();
      w_.Reduce();
      Memo();
    }
  }

  PickleStyle s_;
  PickleWriter w_;
  uint32_t next_ = 0;
  std::map<std::string, uint32_t> strings_, globals_;
};

}  // namespace

std::string StateDictPickle(const std::vector<PickledTensor>& tensors, const PickleStyle& style) {
  return StatePickler(style).Run(tensors);
}

ZipLayout TorchArchive(const std::string& prefix, const std::string& pickle,
                       const std::vector<StorageBytes>& storages, const ZipOptions& options) {
  std::vector<ZipRecord> records;
  records.push_back({prefix + "/data.pkl", pickle});
  records.push_back({prefix + "/.format_version", "1"});
  records.push_back({prefix + "/.storage_alignment", "64"});
  records.push_back({prefix + "/byteorder", "little"});
  for (const auto& s : storages) records.push_back({prefix + "/data/" + s.key, s.data});
  records.push_back({prefix + "/version", "3\n"});
  records.push_back({prefix + "/.data/serialization_id", std::string(40, '7')});
  return BuildZip(records, options);
}

}  // namespace reshard::test
