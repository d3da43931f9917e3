// The kernels of this build (the generated registries, registry.h), per direction: listed, and
// looked up by name for a call that names its kernel or a dispatch table row.
#pragma once

#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../registry.h"

namespace flash::binding {

// The registry of Entry's direction (FwdKernelEntry, BwdKernelEntry or DecKernelEntry), in build
// order.
template <class Entry>
const std::vector<const Entry*>& registry_entries() {
    static const std::vector<const Entry*> entries = [] {
        int count = 0;
        const Entry* const* table = nullptr;
        if constexpr (std::is_same_v<Entry, flash::FwdKernelEntry>)
            table = flash::fwd_kernel_registry(&count);
        else if constexpr (std::is_same_v<Entry, flash::BwdKernelEntry>)
            table = flash::bwd_kernel_registry(&count);
        else
            table = flash::dec_kernel_registry(&count);
        return std::vector<const Entry*>(table, table + count);
    }();
    return entries;
}

template <class Entry>
const std::unordered_map<std::string, const Entry*>& entries_by_name() {
    static const auto table = [] {
        std::unordered_map<std::string, const Entry*> map;
        for (const Entry* e : registry_entries<Entry>())
            map.emplace(e->name, e);
        return map;
    }();
    return table;
}

}  // namespace flash::binding
