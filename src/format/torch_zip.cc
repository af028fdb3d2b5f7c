#include "reshard/format/torch_zip.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/format/shape.h"
#include "reshard/format/torch_pickle.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace reshard {

namespace {

std::string StrideText(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + ")";
}

// Refuses files that are not ZIP archives with a message saying what they look like.
void CheckMagic(const ByteSource& src) {
  const uint64_t size = src.Size();
  uint8_t m[4] = {0, 0, 0, 0};
  const size_t n = static_cast<size_t>(std::min<uint64_t>(size, 4));
  src.Read(0, n, m);
  if (n == 4 && m[0] == 'P' && m[1] == 'K' && m[2] == 3 && m[3] == 4) return;
  if (n >= 1 && m[0] == 0x80) {
    Fail(ErrorCode::kUnsupported,
         src.Name() + ": a legacy torch.save pickle (the format of torch < 1.6, or "
                      "_use_new_zipfile_serialization=False), which cannot be read without "
                      "running it; load it with torch.load and save it again with torch.save "
                      "(zip format) or as safetensors");
  }
  char found[48];
  std::snprintf(found, sizeof found, "%u bytes starting %02x %02x %02x %02x",
                static_cast<unsigned>(n), m[0], m[1], m[2], m[3]);
  FailField(src.Name(), "magic", size < 4 ? "a file of " + std::to_string(size) + " bytes" : found,
            "50 4b 03 04 (PK\\x03\\x04): a torch.save zip archive, the pytorch_model.bin format "
            "(or pass a safetensors checkpoint)");
}

std::string ReadRecord(const ByteSource& src, const ZipDirectory& dir, const ZipEntry& e) {
  const uint64_t at = ZipEntryDataOffset(src, dir, e);
  std::string bytes(e.size, '\0');
  src.Read(at, e.size, bytes.data());
  return bytes;
}

}  // namespace

WeightFile ParseTorchZip(const ByteSource& src) {
  const std::string& path = src.Name();
  CheckMagic(src);
  const ZipDirectory dir = ReadZipDirectory(src);
  if (dir.entries.empty()) FailField(path, "ZIP archive", "no records", "a data.pkl record");
  const std::string& first = dir.entries.front().name;
  const size_t slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    FailField(path, "first record", "\"" + Printable(first) + "\"",
              "a name under one top-level directory (\"archive/data.pkl\", ...)");
  }
  const std::string prefix = first.substr(0, slash + 1);
  const std::string pkl_name = prefix + "data.pkl";
  const ZipEntry* pkl = dir.Find(pkl_name);
  if (!pkl) {
    FailField(path, "record " + Printable(pkl_name), "nothing",
              "the pickled state dict (torch archives hold <prefix>/data.pkl; the prefix is "
              "taken from the first record, \"" + Printable(first) + "\")");
  }
  if (pkl->size > kTorchPickleMaxSize) {
    FailField(path, Printable(pkl_name), std::to_string(pkl->size) + " bytes",
              "at most " + std::to_string(kTorchPickleMaxSize));
  }
  const std::string pickle = ReadRecord(src, dir, *pkl);
  const uint32_t crc = Crc32(pickle.data(), pickle.size());
  if (crc != pkl->crc32) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "CRC-32 %08x, the central directory says %08x", crc,
                  pkl->crc32);
    FailField(path, Printable(pkl_name), buf, "matching checksums (the record is corrupt)");
  }
  if (const ZipEntry* bo = dir.Find(prefix + "byteorder")) {
    if (bo->size > 16) {
      FailField(path, Printable(prefix) + "byteorder", std::to_string(bo->size) + " bytes", "\"little\"");
    }
    const std::string order = ReadRecord(src, dir, *bo);
    if (order != "little") {
      Fail(ErrorCode::kUnsupported,
           path + ": " + Printable(prefix) + "byteorder is \"" + Printable(order) +
               "\": only little-endian checkpoints are supported");
    }
  }
  const TorchPickle parsed = ParseTorchPickle(pickle, path + " (" + Printable(pkl_name) + ")");

  // Storages: their records and where their data starts.
  std::vector<uint64_t> storage_offset(parsed.storages.size());
  std::vector<uint64_t> storage_bytes(parsed.storages.size());
  for (size_t i = 0; i < parsed.storages.size(); ++i) {
    const TorchStorage& s = parsed.storages[i];
    const std::string rec = prefix + "data/" + s.key;
    const ZipEntry* e = dir.Find(rec);
    if (!e) {
      FailField(path, "storage \"" + Printable(s.key) + "\"", "no record " + Printable(rec),
                "one record per storage named in data.pkl");
    }
    const uint64_t nbytes = *s.Nbytes();  // checked by the pickle reader
    if (e->size != nbytes) {
      FailField(path, "record " + Printable(rec),
                std::to_string(e->size) + " bytes",
                std::to_string(nbytes) + " (" + std::to_string(s.numel) + " " +
                    (s.dtype ? std::string(Name(*s.dtype)) + " elements" : std::string("bytes")) +
                    " as data.pkl declares)");
    }
    storage_offset[i] = ZipEntryDataOffset(src, dir, *e);
    storage_bytes[i] = nbytes;
  }

  WeightFile file;
  file.path = path;
  file.format = WeightFormat::kTorchZip;
  file.file_size = src.Size();
  file.header_xxh3 = Xxh3(pickle);
  for (const TorchTensor& t : parsed.tensors) {
    const std::string field = "tensor \"" + Printable(t.name) + "\"";
    uint64_t numel = 1;
    for (uint64_t d : t.shape) numel = CheckedMul(numel, d, path + ": " + field + " numel");
    const auto nbytes = BytesFor(t.dtype, numel);
    if (!nbytes) {
      FailField(path, field, std::to_string(numel) + " elements", "a size without overflow");
    }
    const uint64_t item = Info(t.dtype).bits / 8;
    WeightTensor w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.shape = t.shape;
    w.nbytes = *nbytes;
    w.offset = storage_offset[t.storage];
    if (numel > 0) {
      if (!t.IsContiguous()) {
        Fail(ErrorCode::kUnsupported,
             path + ": " + field + " is not contiguous (shape " + ShapeText(t.shape) +
                 ", stride " + StrideText(t.stride) +
                 "); reshard reads row-major tensors only: save "
                 "{k: v.contiguous() for k, v in state_dict.items()}");
      }
      const uint64_t begin = CheckedMul(t.storage_offset, item, path + ": " + field + " offset");
      const uint64_t end = CheckedAdd(begin, *nbytes, path + ": " + field + " end");
      if (end > storage_bytes[t.storage]) {
        FailField(path, field,
                  "bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                      ") of storage \"" + Printable(parsed.storages[t.storage].key) + "\"",
                  "a range inside the storage's " + std::to_string(storage_bytes[t.storage]) +
                      " bytes");
      }
      w.offset += begin;
    }
    file.tensors.push_back(std::move(w));
  }
  std::sort(file.tensors.begin(), file.tensors.end(), [](const auto& a, const auto& b) {
    if (a.offset != b.offset) return a.offset < b.offset;
    if (a.nbytes != b.nbytes) return a.nbytes < b.nbytes;
    return a.name < b.name;
  });
  // The data sample, hashed as one stream (the same value as hashing the concatenation).
  constexpr uint64_t kSample = 4096;
  XXH3_state_t* state = XXH3_createState();
  if (!state) Fail(ErrorCode::kIo, path + ": out of memory");
  struct FreeState {
    XXH3_state_t* s;
    ~FreeState() { XXH3_freeState(s); }
  } free_state{state};
  XXH3_64bits_reset(state);
  char buf[2 * kSample];
  for (const auto& t : file.tensors) {
    const uint64_t n = std::min(kSample, t.nbytes);
    src.Read(t.offset, n, buf);
    src.Read(t.offset + t.nbytes - n, n, buf + n);
    XXH3_64bits_update(state, buf, 2 * n);
  }
  file.sample_xxh3 = XXH3_64bits_digest(state);
  return file;
}

}  // namespace reshard
