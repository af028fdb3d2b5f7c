#include "reshard/runtime/device_copier.h"

#include "reshard/base/error.h"

namespace reshard {

double DeviceCopier::Reserve(size_t, int) { return 0; }

void DeviceCopier::Warm(int) {}

void DeviceCopier::CopyToHostAsync(int, int, void*, const void*, size_t) {
  Fail(ErrorCode::kUnsupported, "this device copier copies host to device only");
}

}  // namespace reshard
