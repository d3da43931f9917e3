// The kernels of this build (the generated registry, registry.h): looked up by name for a call
// that names its kernel or a dispatch table row, and listed for Python (flash_attention's
// available_configs and dispatch read the list).
#pragma once

#include <torch/extension.h>

#include <string>
#include <unordered_map>

#include "../registry.h"

namespace flash::binding {

inline const std::unordered_map<std::string, const flash::FwdKernelEntry*>& entries_by_name() {
    static const auto table = [] {
        std::unordered_map<std::string, const flash::FwdKernelEntry*> map;
        int count = 0;
        const flash::FwdKernelEntry* const* entries = flash::fwd_kernel_registry(&count);
        for (int i = 0; i < count; ++i)
            map.emplace(entries[i]->name, entries[i]);
        return map;
    }();
    return table;
}

inline py::list list_kernels() {
    py::list out;
    int count = 0;
    const flash::FwdKernelEntry* const* entries = flash::fwd_kernel_registry(&count);
    for (int i = 0; i < count; ++i) {
        const flash::FwdKernelEntry& e = *entries[i];
        py::dict d;
        d["name"] = e.name;
        d["dtype"] = e.dtype == flash::DType::kFp16 ? "fp16" : "bf16";
        d["d_head"] = e.d_head;
        d["block_r"] = e.block_r;
        d["block_c"] = e.block_c;
        d["threads"] = e.threads;
        d["smem_bytes"] = e.smem_bytes;
        d["mask"] = e.mask;
        d["softcap"] = e.softcap;
        d["arch"] = e.arch;
        out.append(d);
    }
    return out;
}

}  // namespace flash::binding
