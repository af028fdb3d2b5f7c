#include "reshard/format/torch_pickle.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

#include "reshard/base/error.h"

namespace reshard {

std::optional<uint64_t> TorchStorage::Nbytes() const {
  if (!dtype) return numel;
  return BytesFor(*dtype, numel);
}

bool TorchTensor::IsContiguous() const {
  if (stride.size() != shape.size()) return false;
  for (uint64_t d : shape) {
    if (d == 0) return true;
  }
  // Unsigned and overflow-checked: shapes come from the file (a product past 2^63 must not
  // wrap into a negative stride that then "matches").
  uint64_t expected = 1;
  bool overflowed = false;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (overflowed || stride[i] < 0 || static_cast<uint64_t>(stride[i]) != expected) return false;
    overflowed = __builtin_mul_overflow(expected, shape[i], &expected);
  }
  return true;
}

namespace {

enum class Kind : uint8_t {
  kNone, kBool, kInt, kBigInt, kFloat, kString, kTuple, kList, kDict, kGlobal, kStorage, kTensor,
};

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an int";
    case Kind::kBigInt: return "an int beyond 64 bits";
    case Kind::kFloat: return "a float";
    case Kind::kString: return "a string";
    case Kind::kTuple: return "a tuple";
    case Kind::kList: return "a list";
    case Kind::kDict: return "a dict";
    case Kind::kGlobal: return "a global";
    case Kind::kStorage: return "a storage";
    case Kind::kTensor: return "a tensor";
  }
  return "?";
}

// The whitelisted globals.
enum class Global : uint8_t {
  kOrderedDict,
  kRebuildTensorV2,
  kRebuildTensorV3,
  kRebuildParameter,
  kRebuildParameterWithState,
  kRebuildFromTypeV2,
  kTensorType,     // torch.Tensor / torch._tensor.Tensor
  kParameterType,  // torch.nn.parameter.Parameter
  kStorageType,    // Value::i: DType index, or -1 for UntypedStorage
  kDType,          // Value::i: DType index
};

struct Value {
  Kind kind = Kind::kNone;
  Global global = Global::kOrderedDict;  // kGlobal only
  int64_t i = 0;        // kBool, kInt, kGlobal (see Global), kStorage / kTensor (index)
  double f = 0;
  std::string s;        // kString
  std::vector<uint32_t> items;  // kTuple, kList; kDict: key, value, key, value, ...
};

struct TensorDesc {
  DType dtype;
  size_t storage;
  uint64_t storage_offset;
  std::vector<uint64_t> shape;
  std::vector<int64_t> stride;
};

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int n;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else return false;
    if (s.size() - i <= static_cast<size_t>(n)) return false;
    for (int k = 1; k <= n; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

struct OpInfo {
  uint8_t code;
  const char* name;
};

// Every opcode of pickle protocols 0-5 by name, so that a refused one is named in the error.
constexpr OpInfo kOpNames[] = {
    {'(', "MARK"}, {'.', "STOP"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"},
    {'F', "FLOAT"}, {'I', "INT"}, {'J', "BININT"}, {'K', "BININT1"}, {'L', "LONG"},
    {'M', "BININT2"}, {'N', "NONE"}, {'P', "PERSID"}, {'Q', "BINPERSID"}, {'R', "REDUCE"},
    {'S', "STRING"}, {'T', "BINSTRING"}, {'U', "SHORT_BINSTRING"}, {'V', "UNICODE"},
    {'X', "BINUNICODE"}, {'a', "APPEND"}, {'b', "BUILD"}, {'c', "GLOBAL"}, {'d', "DICT"},
    {'}', "EMPTY_DICT"}, {'e', "APPENDS"}, {'g', "GET"}, {'h', "BINGET"}, {'i', "INST"},
    {'j', "LONG_BINGET"}, {'l', "LIST"}, {']', "EMPTY_LIST"}, {'o', "OBJ"}, {'p', "PUT"},
    {'q', "BINPUT"}, {'r', "LONG_BINPUT"}, {'s', "SETITEM"}, {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"}, {'u', "SETITEMS"}, {'G', "BINFLOAT"}, {0x80, "PROTO"},
    {0x81, "NEWOBJ"}, {0x82, "EXT1"}, {0x83, "EXT2"}, {0x84, "EXT4"}, {0x85, "TUPLE1"},
    {0x86, "TUPLE2"}, {0x87, "TUPLE3"}, {0x88, "NEWTRUE"}, {0x89, "NEWFALSE"},
    {0x8a, "LONG1"}, {0x8b, "LONG4"}, {'B', "BINBYTES"}, {'C', "SHORT_BINBYTES"},
    {0x8c, "SHORT_BINUNICODE"}, {0x8d, "BINUNICODE8"}, {0x8e, "BINBYTES8"},
    {0x8f, "EMPTY_SET"}, {0x90, "ADDITEMS"}, {0x91, "FROZENSET"}, {0x92, "NEWOBJ_EX"},
    {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"}, {0x95, "FRAME"}, {0x96, "BYTEARRAY8"},
    {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
};

std::string OpName(uint8_t code) {
  char buf[64];
  for (const auto& op : kOpNames) {
    if (op.code == code) {
      std::snprintf(buf, sizeof buf, "%s (0x%02x)", op.name, code);
      return buf;
    }
  }
  std::snprintf(buf, sizeof buf, "unknown opcode 0x%02x", code);
  return buf;
}

struct DTypeName {
  std::string_view name;
  DType dtype;
};

// torch.<name> dtypes that reshard can hold (safetensors dtypes), as _rebuild_tensor_v3
// passes them.
constexpr DTypeName kTorchDTypes[] = {
    {"float32", DType::kF32},        {"float", DType::kF32},        {"float64", DType::kF64},
    {"double", DType::kF64},         {"float16", DType::kF16},      {"half", DType::kF16},
    {"bfloat16", DType::kBF16},      {"int8", DType::kI8},          {"int16", DType::kI16},
    {"short", DType::kI16},          {"int32", DType::kI32},        {"int", DType::kI32},
    {"int64", DType::kI64},          {"long", DType::kI64},         {"uint8", DType::kU8},
    {"uint16", DType::kU16},         {"uint32", DType::kU32},       {"uint64", DType::kU64},
    {"bool", DType::kBool},          {"complex64", DType::kC64},    {"cfloat", DType::kC64},
    {"float8_e4m3fn", DType::kF8_E4M3}, {"float8_e5m2", DType::kF8_E5M2},
    {"float8_e8m0fnu", DType::kF8_E8M0},
};

// torch dtypes that exist but have no safetensors dtype reshard handles.
constexpr std::string_view kUnsupportedTorchDTypes[] = {
    "complex128", "cdouble", "complex32", "chalf", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float4_e2m1fn_x2", "qint8", "qint32", "quint8", "quint4x2", "quint2x4", "bits8", "bits16",
    "bits1x8", "bits2x4", "bits4x2", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
};

constexpr DTypeName kStorageTypes[] = {
    {"DoubleStorage", DType::kF64},   {"FloatStorage", DType::kF32},
    {"HalfStorage", DType::kF16},     {"BFloat16Storage", DType::kBF16},
    {"LongStorage", DType::kI64},     {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},    {"CharStorage", DType::kI8},
    {"ByteStorage", DType::kU8},      {"BoolStorage", DType::kBool},
    {"ComplexFloatStorage", DType::kC64},
};

constexpr std::string_view kUnsupportedStorageTypes[] = {
    "ComplexDoubleStorage", "QInt8Storage", "QInt32Storage", "QUInt8Storage", "QUInt4x2Storage",
    "QUInt2x4Storage",
};

class Parser {
 public:
  Parser(std::string_view data, const std::string& path) : d_(data), path_(path) {}

  TorchPickle Run() {
    if (d_.size() > kTorchPickleMaxSize) {
      FailField(path_, "size", std::to_string(d_.size()) + " bytes",
                "at most " + std::to_string(kTorchPickleMaxSize));
    }
    while (true) {
      if (pos_ >= d_.size()) {
        Bad("the pickle ends without STOP (truncated)");
      }
      op_pos_ = pos_;
      const uint8_t op = Byte();
      if (op == '.') break;
      Step(op);
    }
    if (!marks_.empty()) Bad("STOP with an unclosed MARK");
    if (stack_.size() != 1) {
      Bad("STOP with " + std::to_string(stack_.size()) + " objects on the stack, expected 1");
    }
    if (pos_ != d_.size()) {
      Bad(std::to_string(d_.size() - pos_) + " bytes after STOP");
    }
    return Result(stack_.back());
  }

 private:
  [[noreturn]] void Bad(const std::string& what) {
    Fail(ErrorCode::kDataLoss,
         path_ + ": malformed pickle at byte " + std::to_string(op_pos_) + ": " + what);
  }
  [[noreturn]] void Refuse(const std::string& what) {
    Fail(ErrorCode::kUnsupported,
         path_ + ": at byte " + std::to_string(op_pos_) + ": " + what +
             "; reshard reads torch.save state dicts with a fixed whitelist of pickle opcodes "
             "and globals and never runs code from a checkpoint");
  }

  // ---- reading ----
  void Need(uint64_t n) {
    if (d_.size() - pos_ < n) {
      Bad("the operand needs " + std::to_string(n) + " bytes, " +
          std::to_string(d_.size() - pos_) + " left (truncated)");
    }
  }
  uint8_t Byte() {
    Need(1);
    return static_cast<uint8_t>(d_[pos_++]);
  }
  uint64_t Le(int n) {
    Need(n);
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(d_[pos_ + k]);
    pos_ += n;
    return v;
  }
  std::string_view Bytes(uint64_t n) {
    Need(n);
    std::string_view v = d_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  std::string_view Line() {
    const size_t nl = d_.find('\n', pos_);
    if (nl == std::string_view::npos) Bad("GLOBAL operand without a newline (truncated)");
    std::string_view v = d_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }

  // ---- objects ----
  uint32_t New(Kind kind) {
    if (arena_.size() >= kTorchPickleMaxObjects) {
      Fail(ErrorCode::kUnsupported, path_ + ": the pickle builds more than " +
                                        std::to_string(kTorchPickleMaxObjects) + " objects");
    }
    Charge(2 * sizeof(Value));  // the arena's vector doubles: up to twice its objects
    arena_.emplace_back();
    arena_.back().kind = kind;
    return static_cast<uint32_t>(arena_.size() - 1);
  }
  uint32_t NewInt(int64_t v) {
    uint32_t id = New(Kind::kInt);
    arena_[id].i = v;
    return id;
  }
  uint32_t NewString(std::string_view s) {
    if (!ValidUtf8(s)) Bad("a string that is not valid UTF-8: \"" + Printable(s) + "\"");
    uint32_t id = New(Kind::kString);
    Charge(s.size());
    arena_[id].s.assign(s);
    return id;
  }
  void Push(uint32_t id) {
    stack_.push_back(id);
    if (stack_.size() > stack_high_) {
      stack_high_ = stack_.size();
      Charge(2 * sizeof(uint32_t));
    }
  }
  void PushMark() {
    marks_.push_back(stack_.size());
    if (marks_.size() > marks_high_) {
      marks_high_ = marks_.size();
      Charge(2 * sizeof(size_t));
    }
  }
  // Counts `bytes` against kTorchPickleMaxMemory before they are allocated.
  void Charge(uint64_t bytes) {
    used_ += bytes;
    if (used_ > kTorchPickleMaxMemory) {
      Fail(ErrorCode::kUnsupported,
           path_ + ": at byte " + std::to_string(op_pos_) + ": reading this pickle needs more "
                   "than " + std::to_string(kTorchPickleMaxMemory >> 20) + " MiB of memory (" +
               std::to_string(arena_.size()) + " objects, " + std::to_string(memo_.size()) +
               " memo entries, a stack of " + std::to_string(stack_high_) + " and " +
               std::to_string(marks_high_) + " marks so far); a state dict's pickle needs "
               "about 3.5 KiB per tensor, so this is not one reshard reads (limit "
               "kTorchPickleMaxMemory, include/reshard/format/torch_pickle.h)");
    }
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  uint32_t Pop(const char* what) {
    if (stack_.size() <= Floor()) Bad(std::string("stack underflow (") + what + ")");
    uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  uint32_t Top(const char* what) {
    if (stack_.size() <= Floor()) Bad(std::string("stack underflow (") + what + ")");
    return stack_.back();
  }
  std::vector<uint32_t> PopMark(const char* what) {
    if (marks_.empty()) Bad(std::string(what) + " without a MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }
  void Put(uint64_t key) {
    const uint32_t top = Top("memo put");
    auto it = memo_.find(key);
    if (it != memo_.end()) {
      it->second = top;
      return;
    }
    // The pickler memoizes each object once, and every object memoized is one this reader
    // built: more memo entries than objects is a memo flood (MEMOIZE repeated on one object,
    // BINPUT under ever new keys), each entry costing memory while the file costs 1-5 bytes.
    if (memo_.size() >= arena_.size()) {
      Fail(ErrorCode::kUnsupported,
           path_ + ": at byte " + std::to_string(op_pos_) + ": memo entry " +
               std::to_string(memo_.size() + 1) + " for " + std::to_string(arena_.size()) +
               " objects built; expected at most one memo entry per object (torch.save "
               "memoizes each object once), found a memo flood");
    }
    Charge(64);  // a hash node and its bucket
    memo_.emplace(key, top);
  }
  void Get(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) Bad("memo key " + std::to_string(key) + " was never stored");
    Push(it->second);
  }
  uint32_t Tuple(std::vector<uint32_t> items) {
    Charge(items.size() * sizeof(uint32_t));
    uint32_t id = New(Kind::kTuple);
    arena_[id].items = std::move(items);
    return id;
  }
  void Append(uint32_t list, const std::vector<uint32_t>& items, const char* op) {
    if (arena_[list].kind != Kind::kList) {
      Bad(std::string(op) + " on " + KindName(arena_[list].kind) + ", expected a list");
    }
    Charge(items.size() * 2 * sizeof(uint32_t));
    auto& v = arena_[list].items;
    v.insert(v.end(), items.begin(), items.end());
  }
  void SetItems(uint32_t dict, const std::vector<uint32_t>& kv, const char* op) {
    if (arena_[dict].kind != Kind::kDict) {
      Bad(std::string(op) + " on " + KindName(arena_[dict].kind) + ", expected a dict");
    }
    if (kv.size() % 2 != 0) Bad(std::string(op) + " with an odd number of keys and values");
    Charge(kv.size() * 2 * sizeof(uint32_t));
    auto& v = arena_[dict].items;
    v.insert(v.end(), kv.begin(), kv.end());
  }

  void Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint8_t proto = Byte();
        if (proto < 2 || proto > 5) Refuse("pickle protocol " + std::to_string(proto));
        return;
      }
      case 0x95: {  // FRAME: the frame length is informational here
        const uint64_t n = Le(8);
        if (n > d_.size() - pos_) Bad("FRAME of " + std::to_string(n) + " bytes past the end");
        return;
      }
      case '(': PushMark(); return;
      case 'N': Push(New(Kind::kNone)); return;
      case 0x88:
      case 0x89: {
        uint32_t id = New(Kind::kBool);
        arena_[id].i = op == 0x88;
        Push(id);
        return;
      }
      case 'J': Push(NewInt(static_cast<int32_t>(static_cast<uint32_t>(Le(4))))); return;
      case 'K': Push(NewInt(static_cast<int64_t>(Le(1)))); return;
      case 'M': Push(NewInt(static_cast<int64_t>(Le(2)))); return;
      case 0x8a: {  // LONG1: little-endian two's complement of any length
        const uint64_t n = Le(1);
        std::string_view b = Bytes(n);
        if (n == 0) {
          Push(NewInt(0));
          return;
        }
        const bool negative = static_cast<uint8_t>(b[n - 1]) & 0x80;
        bool fits = true;
        for (uint64_t k = 8; k < n; ++k) {
          if (static_cast<uint8_t>(b[k]) != (negative ? 0xFF : 0x00)) fits = false;
        }
        uint64_t v = negative ? ~uint64_t{0} : 0;
        for (uint64_t k = std::min<uint64_t>(n, 8); k-- > 0;) {
          v = (v << 8) | static_cast<uint8_t>(b[k]);
        }
        if (n > 8 && ((v >> 63) != 0) != negative) fits = false;
        if (!fits) {
          Push(New(Kind::kBigInt));
          return;
        }
        Push(NewInt(static_cast<int64_t>(v)));
        return;
      }
      case 'G': {  // BINFLOAT: big-endian IEEE double
        std::string_view b = Bytes(8);
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(b[k]);
        uint32_t id = New(Kind::kFloat);
        std::memcpy(&arena_[id].f, &bits, 8);
        Push(id);
        return;
      }
      case 'X': Push(NewString(Bytes(Le(4)))); return;
      case 0x8c: Push(NewString(Bytes(Le(1)))); return;
      case 0x8d: Push(NewString(Bytes(Le(8)))); return;
      case ')': Push(Tuple({})); return;
      case 't': Push(Tuple(PopMark("TUPLE"))); return;
      case 0x85:
      case 0x86:
      case 0x87: {
        const int n = op - 0x84;
        std::vector<uint32_t> items(n);
        for (int k = n - 1; k >= 0; --k) items[k] = Pop("TUPLE1-3");
        Push(Tuple(std::move(items)));
        return;
      }
      case ']': Push(New(Kind::kList)); return;
      case '}': Push(New(Kind::kDict)); return;
      case 'a': {
        uint32_t v = Pop("APPEND");
        Append(Top("APPEND"), {v}, "APPEND");
        return;
      }
      case 'e': {
        std::vector<uint32_t> items = PopMark("APPENDS");
        Append(Top("APPENDS"), items, "APPENDS");
        return;
      }
      case 's': {
        uint32_t v = Pop("SETITEM");
        uint32_t k = Pop("SETITEM");
        SetItems(Top("SETITEM"), {k, v}, "SETITEM");
        return;
      }
      case 'u': {
        std::vector<uint32_t> kv = PopMark("SETITEMS");
        SetItems(Top("SETITEMS"), kv, "SETITEMS");
        return;
      }
      case 'c': {
        std::string_view module = Line();
        std::string_view name = Line();
        Push(MakeGlobal(module, name));
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        uint32_t name = Pop("STACK_GLOBAL");
        uint32_t module = Pop("STACK_GLOBAL");
        if (arena_[name].kind != Kind::kString || arena_[module].kind != Kind::kString) {
          Bad("STACK_GLOBAL with " + std::string(KindName(arena_[module].kind)) + " and " +
              KindName(arena_[name].kind) + ", expected two strings");
        }
        const std::string m = arena_[module].s, n = arena_[name].s;  // New() may move the arena
        Push(MakeGlobal(m, n));
        return;
      }
      case 'Q': Push(PersistentId(Pop("BINPERSID"))); return;
      case 'R': {
        uint32_t args = Pop("REDUCE");
        uint32_t fn = Pop("REDUCE");
        Push(Call(fn, args));
        return;
      }
      case 'b': {
        uint32_t state = Pop("BUILD");
        const Value& target = arena_[Top("BUILD")];
        // An OrderedDict state dict carries its `_metadata` attribute this way; attributes
        // do not change any tensor's bytes.
        if (target.kind != Kind::kDict) {
          Refuse(std::string("BUILD on ") + KindName(target.kind) + " (only dicts are expected)");
        }
        (void)state;
        return;
      }
      case 'q': Put(Le(1)); return;
      case 'r': Put(Le(4)); return;
      case 0x94: Put(memo_.size()); return;
      case 'h': Get(Le(1)); return;
      case 'j': Get(Le(4)); return;
      default:
        Refuse("opcode " + OpName(op) + " is not on the whitelist");
    }
  }

  uint32_t MakeGlobal(std::string_view module, std::string_view name) {
    auto make = [&](Global g, int64_t i = 0) {
      uint32_t id = New(Kind::kGlobal);
      arena_[id].global = g;
      arena_[id].i = i;
      return id;
    };
    if (module == "collections" && name == "OrderedDict") return make(Global::kOrderedDict);
    if (module == "torch._utils") {
      if (name == "_rebuild_tensor_v2") return make(Global::kRebuildTensorV2);
      if (name == "_rebuild_tensor_v3") return make(Global::kRebuildTensorV3);
      if (name == "_rebuild_parameter") return make(Global::kRebuildParameter);
      if (name == "_rebuild_parameter_with_state") return make(Global::kRebuildParameterWithState);
    }
    if (module == "torch._tensor" && name == "_rebuild_from_type_v2") {
      return make(Global::kRebuildFromTypeV2);
    }
    if ((module == "torch._tensor" || module == "torch") && name == "Tensor") {
      return make(Global::kTensorType);
    }
    if ((module == "torch.nn.parameter" || module == "torch.nn") && name == "Parameter") {
      return make(Global::kParameterType);
    }
    if ((module == "torch.storage" || module == "torch") && name == "UntypedStorage") {
      return make(Global::kStorageType, -1);
    }
    if (module == "torch") {
      for (const auto& s : kStorageTypes) {
        if (s.name == name) return make(Global::kStorageType, static_cast<int64_t>(s.dtype));
      }
      for (const auto& s : kUnsupportedStorageTypes) {
        if (s == name) {
          Fail(ErrorCode::kUnsupported,
               path_ + ": at byte " + std::to_string(op_pos_) + ": storage type torch." +
                   std::string(name) + " holds a dtype reshard cannot convert (no safetensors "
                                       "equivalent)");
        }
      }
      for (const auto& t : kTorchDTypes) {
        if (t.name == name) return make(Global::kDType, static_cast<int64_t>(t.dtype));
      }
      for (const auto& s : kUnsupportedTorchDTypes) {
        if (s == name) {
          Fail(ErrorCode::kUnsupported, path_ + ": at byte " + std::to_string(op_pos_) +
                                            ": dtype torch." + std::string(name) +
                                            " has no safetensors equivalent reshard handles");
        }
      }
    }
    Refuse("global " + Printable(module) + "." + Printable(name) + " is not on the whitelist");
  }

  uint32_t PersistentId(uint32_t pid) {
    const Value& v = arena_[pid];
    if (v.kind != Kind::kTuple || v.items.size() != 5) {
      Bad(std::string("persistent id ") + KindName(v.kind) +
          (v.kind == Kind::kTuple ? " of " + std::to_string(v.items.size()) + " items" : "") +
          ", expected ('storage', type, key, location, numel)");
    }
    const Value& tag = arena_[v.items[0]];
    const Value& type = arena_[v.items[1]];
    const Value& key = arena_[v.items[2]];
    const Value& loc = arena_[v.items[3]];
    const Value& numel = arena_[v.items[4]];
    if (tag.kind != Kind::kString || tag.s != "storage") {
      Bad("persistent id tag " + (tag.kind == Kind::kString ? "\"" + Printable(tag.s) + "\""
                                                             : std::string(KindName(tag.kind))) +
          ", expected \"storage\"");
    }
    if (type.kind != Kind::kGlobal || type.global != Global::kStorageType) {
      Bad(std::string("storage type ") + KindName(type.kind) + ", expected a torch storage class");
    }
    if (key.kind != Kind::kString || key.s.empty()) Bad("storage key is not a non-empty string");
    if (loc.kind != Kind::kString) Bad("storage location is not a string");
    if (numel.kind != Kind::kInt || numel.i < 0) {
      Bad(std::string("storage size ") + KindName(numel.kind) + ", expected an int >= 0");
    }
    TorchStorage s;
    s.key = key.s;
    if (type.i >= 0) s.dtype = static_cast<DType>(type.i);
    s.location = loc.s;
    s.numel = static_cast<uint64_t>(numel.i);
    if (!s.Nbytes()) Bad("storage \"" + Printable(s.key) + "\": its size overflows 64 bits");
    size_t index;
    auto it = storage_index_.find(s.key);
    if (it == storage_index_.end()) {
      Charge(2 * (sizeof(TorchStorage) + s.key.size() + s.location.size()) + 64 + s.key.size());
      index = storages_.size();
      storage_index_.emplace(s.key, index);
      storages_.push_back(s);
    } else {
      index = it->second;
      const TorchStorage& old = storages_[index];
      if (old.dtype != s.dtype || old.numel != s.numel) {
        Bad("storage \"" + Printable(s.key) + "\" is declared twice with different types or sizes");
      }
    }
    uint32_t id = New(Kind::kStorage);
    arena_[id].i = static_cast<int64_t>(index);
    return id;
  }

  const Value& Arg(const Value& args, size_t k, Kind kind, const char* fn, const char* what) {
    const Value& v = arena_[args.items[k]];
    if (v.kind != kind) {
      Bad(std::string(fn) + ": argument " + std::to_string(k + 1) + " (" + what + ") is " +
          KindName(v.kind) + ", expected " + KindName(kind));
    }
    return v;
  }

  std::vector<uint64_t> Sizes(const Value& t, const char* fn) {
    std::vector<uint64_t> out;
    if (t.items.size() > 64) Refuse(std::string(fn) + ": a tensor of " +
                                    std::to_string(t.items.size()) + " dimensions");
    for (uint32_t i : t.items) {
      const Value& v = arena_[i];
      if (v.kind != Kind::kInt || v.i < 0) {
        Bad(std::string(fn) + ": size has " + KindName(v.kind) +
            (v.kind == Kind::kInt ? " " + std::to_string(v.i) : "") + ", expected ints >= 0");
      }
      out.push_back(static_cast<uint64_t>(v.i));
    }
    return out;
  }

  std::vector<int64_t> Strides(const Value& t, const char* fn) {
    std::vector<int64_t> out;
    if (t.items.size() > 64) Refuse(std::string(fn) + ": a stride of " +
                                    std::to_string(t.items.size()) + " dimensions");
    for (uint32_t i : t.items) {
      const Value& v = arena_[i];
      if (v.kind != Kind::kInt) {
        Bad(std::string(fn) + ": stride has " + KindName(v.kind) + ", expected ints");
      }
      out.push_back(v.i);
    }
    return out;
  }

  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) and
  // _rebuild_tensor_v3(..., hooks, dtype[, metadata]).
  uint32_t RebuildTensor(bool v3, uint32_t args_id) {
    const char* fn = v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2";
    const Value& args = arena_[args_id];
    const size_t base = v3 ? 7 : 6;
    if (args.items.size() != base && args.items.size() != base + 1) {
      Bad(std::string(fn) + " with " + std::to_string(args.items.size()) + " arguments, expected " +
          std::to_string(base) + " or " + std::to_string(base + 1));
    }
    const Value& storage = Arg(args, 0, Kind::kStorage, fn, "storage");
    const Value& offset = Arg(args, 1, Kind::kInt, fn, "storage offset");
    const Value& size = Arg(args, 2, Kind::kTuple, fn, "size");
    const Value& stride = Arg(args, 3, Kind::kTuple, fn, "stride");
    Arg(args, 4, Kind::kBool, fn, "requires_grad");
    Arg(args, 5, Kind::kDict, fn, "backward hooks");
    TensorDesc t;
    t.storage = static_cast<size_t>(storage.i);
    const TorchStorage& s = storages_[t.storage];
    if (v3) {
      const Value& dt = arena_[args.items[6]];
      if (dt.kind != Kind::kGlobal || dt.global != Global::kDType) {
        Bad(std::string(fn) + ": argument 7 (dtype) is " + KindName(dt.kind) +
            ", expected a torch dtype");
      }
      t.dtype = static_cast<DType>(dt.i);
      if (s.dtype && *s.dtype != t.dtype) {
        Bad(std::string(fn) + ": a " + std::string(Name(t.dtype)) + " tensor on a " +
            std::string(Name(*s.dtype)) + " storage");
      }
    } else {
      if (!s.dtype) Bad(std::string(fn) + ": an untyped storage, expected a typed one");
      t.dtype = *s.dtype;
    }
    if (args.items.size() == base + 1) {
      const Value& meta = arena_[args.items[base]];
      if (!(meta.kind == Kind::kNone || (meta.kind == Kind::kDict && meta.items.empty()))) {
        Refuse(std::string(fn) + ": tensor metadata (" + KindName(meta.kind) +
               "), which may change how the bytes are read");
      }
    }
    if (offset.i < 0) Bad(std::string(fn) + ": negative storage offset " + std::to_string(offset.i));
    t.storage_offset = static_cast<uint64_t>(offset.i);
    t.shape = Sizes(size, fn);
    t.stride = Strides(stride, fn);
    if (t.shape.size() != t.stride.size()) {
      Bad(std::string(fn) + ": " + std::to_string(t.shape.size()) + " sizes but " +
          std::to_string(t.stride.size()) + " strides");
    }
    Charge(2 * sizeof(TensorDesc) + 16 * t.shape.size());
    uint32_t id = New(Kind::kTensor);
    arena_[id].i = static_cast<int64_t>(tensors_.size());
    tensors_.push_back(std::move(t));
    return id;
  }

  uint32_t Call(uint32_t fn_id, uint32_t args_id) {
    const Value& fn = arena_[fn_id];
    const Value& args = arena_[args_id];
    if (args.kind != Kind::kTuple) {
      Bad(std::string("REDUCE arguments are ") + KindName(args.kind) + ", expected a tuple");
    }
    if (fn.kind != Kind::kGlobal) {
      Refuse(std::string("REDUCE calls ") + KindName(fn.kind) + ", not a whitelisted function");
    }
    switch (fn.global) {
      case Global::kOrderedDict:
        if (!args.items.empty()) Refuse("OrderedDict called with arguments");
        return New(Kind::kDict);
      case Global::kRebuildTensorV2: return RebuildTensor(false, args_id);
      case Global::kRebuildTensorV3: return RebuildTensor(true, args_id);
      case Global::kRebuildParameter:
      case Global::kRebuildParameterWithState: {
        const bool with_state = fn.global == Global::kRebuildParameterWithState;
        const char* name = with_state ? "_rebuild_parameter_with_state" : "_rebuild_parameter";
        if (args.items.size() != (with_state ? 4u : 3u)) {
          Bad(std::string(name) + " with " + std::to_string(args.items.size()) + " arguments");
        }
        Arg(args, 0, Kind::kTensor, name, "data");
        Arg(args, 1, Kind::kBool, name, "requires_grad");
        Arg(args, 2, Kind::kDict, name, "backward hooks");
        return args.items[0];
      }
      case Global::kRebuildFromTypeV2: {
        const char* name = "_rebuild_from_type_v2";
        if (args.items.size() != 4) {
          Bad(std::string(name) + " with " + std::to_string(args.items.size()) + " arguments");
        }
        const Value& func = Arg(args, 0, Kind::kGlobal, name, "func");
        const Value& type = Arg(args, 1, Kind::kGlobal, name, "type");
        Arg(args, 2, Kind::kTuple, name, "args");
        if (type.global != Global::kTensorType && type.global != Global::kParameterType) {
          Refuse(std::string(name) + ": a tensor subclass other than torch.Tensor / Parameter");
        }
        if (func.global != Global::kRebuildTensorV2 && func.global != Global::kRebuildTensorV3 &&
            func.global != Global::kRebuildParameter &&
            func.global != Global::kRebuildParameterWithState) {
          Refuse(std::string(name) + ": func is not a tensor rebuild function");
        }
        const uint32_t inner_fn = args.items[0], inner_args = args.items[2];
        const uint32_t result = Call(inner_fn, inner_args);
        if (arena_[result].kind != Kind::kTensor) Bad(std::string(name) + ": not a tensor");
        return result;
      }
      default:
        Refuse("REDUCE calls a class or dtype (only rebuild functions and OrderedDict may be "
               "called)");
    }
  }

  TorchPickle Result(uint32_t top) {
    const Value& d = arena_[top];
    if (d.kind != Kind::kDict) {
      Fail(ErrorCode::kUnsupported,
           path_ + ": the pickle holds " + KindName(d.kind) +
               ", expected a state dict (a dict of name -> tensor, as torch.save(model.state_dict()) "
               "writes)");
    }
    TorchPickle out;
    out.storages = storages_;
    std::map<std::string, size_t> seen;
    for (size_t k = 0; k + 1 < d.items.size(); k += 2) {
      const Value& key = arena_[d.items[k]];
      const Value& value = arena_[d.items[k + 1]];
      if (key.kind != Kind::kString) {
        Fail(ErrorCode::kUnsupported, path_ + ": state dict key " + std::to_string(k / 2) +
                                          " is " + KindName(key.kind) + ", expected a string");
      }
      if (value.kind != Kind::kTensor) {
        Fail(ErrorCode::kUnsupported, path_ + ": state dict entry \"" + Printable(key.s) +
                                          "\" is " + KindName(value.kind) +
                                          ", expected a tensor (reshard reads flat state dicts)");
      }
      if (!seen.emplace(key.s, k).second) {
        Fail(ErrorCode::kDataLoss,
             path_ + ": state dict key \"" + Printable(key.s) + "\" appears twice");
      }
      const TensorDesc& t = tensors_[static_cast<size_t>(value.i)];
      out.tensors.push_back({key.s, t.dtype, t.storage, t.storage_offset, t.shape, t.stride});
    }
    return out;
  }

  std::string_view d_;
  const std::string& path_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  std::vector<Value> arena_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  size_t stack_high_ = 0, marks_high_ = 0;
  uint64_t used_ = 0;  // bytes counted by Charge
  std::unordered_map<uint64_t, uint32_t> memo_;
  std::vector<TorchStorage> storages_;
  std::unordered_map<std::string, size_t> storage_index_;
  std::vector<TensorDesc> tensors_;
};

}  // namespace

TorchPickle ParseTorchPickle(std::string_view data, const std::string& path) {
  return Parser(data, path).Run();
}

}  // namespace reshard
