// What the decode translation unit (decode.cpp) gives the module: the device's KV-cache status
// word.
#pragma once

#include <cstdint>

namespace flash::binding {

// The status word's decode::kStatus* bits on a device (a synchronous read), cleared if asked.
int64_t kvcache_status(int64_t device, bool clear);

}  // namespace flash::binding
