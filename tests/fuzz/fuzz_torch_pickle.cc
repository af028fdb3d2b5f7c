// libFuzzer target: the restricted pickle reader of torch.save's data.pkl must refuse any
// input it does not understand with a reshard::Error, never crash, hang or leak.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "reshard/base/error.h"
#include "reshard/format/torch_pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string name = "fuzz.pkl";
  try {
    const reshard::TorchPickle p =
        reshard::ParseTorchPickle(std::string_view(reinterpret_cast<const char*>(data), size), name);
    // Whatever is accepted must be self-consistent.
    for (const auto& t : p.tensors) {
      if (t.storage >= p.storages.size() || t.shape.size() != t.stride.size()) __builtin_trap();
      (void)t.IsContiguous();
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
