// The dispatch table and the choice of a kernel for a call. flash_attention.dispatch computes the
// table once per process (set_dispatch); with kernel == "" the operator runs the table's choice
// for (dtype, d_head variant, seqlen_q bucket, mask, local window, softcap), a lookup with no
// Python on the call path, or the row's sm80-family fallback when the Hopper kernel cannot run
// the call (sm90_unfit).
#pragma once

#include <torch/extension.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "../registry.h"
#include "kernel_registry.h"
#include "message.h"
#include "tma_fit.h"

namespace flash::binding {

// The sequence bucket of flash_attention.dispatch.seq_bucket: seqlen_q rounded up to a power of
// two, 64 .. 16384.
inline int64_t seq_bucket(int64_t seqlen_q) {
    int64_t bucket = 64;
    while (bucket < seqlen_q && bucket < 16384)
        bucket *= 2;
    return bucket;
}

// local: a sliding window bounded on the left (window_left != -1 after canonical_window); such
// rows may name another Hopper kernel than the masked ones (flash_attention.dispatch).
inline uint64_t choice_key(bool bf16, int64_t d_head, int64_t bucket, bool mask, bool local,
                           bool softcap) {
    return (uint64_t(bf16) << 40) | (uint64_t(d_head) << 24) | (uint64_t(bucket) << 3) |
           (uint64_t(mask) << 2) | (uint64_t(local && mask) << 1) | uint64_t(softcap);
}

// A row's kernel and its fallback: an sm80-family kernel that runs wherever the kernel (a Hopper
// one) cannot; the same entry when the kernel is an sm80 one.
struct Choice {
    const flash::FwdKernelEntry* kernel;
    const flash::FwdKernelEntry* fallback;
};

struct DispatchTable {
    std::mutex mutex;
    std::unordered_map<uint64_t, Choice> choices;
};

inline DispatchTable& dispatch_table() {
    static DispatchTable table;
    return table;
}

// Replaces the table: rows (dtype, d_head, bucket, mask, local, softcap, kernel name, fallback
// name).
inline void set_dispatch(const std::vector<std::tuple<std::string, int64_t, int64_t, bool, bool,
                                                      bool, std::string, std::string>>& rows) {
    std::unordered_map<uint64_t, Choice> choices;
    const auto& by_name = entries_by_name();
    for (const auto& [dtype, d_head, bucket, mask, local, softcap, name, fallback] : rows) {
        const auto it = by_name.find(name);
        const auto fb = by_name.find(fallback);
        FA_CHECK(it != by_name.end() && fb != by_name.end(), "dispatch table names kernel ",
                 it == by_name.end() ? name : fallback, ", which is not in this build");
        FA_CHECK(fb->second->arch == 80, "dispatch table: fallback ", fallback,
                 " is not an sm80-family kernel");
        FA_CHECK(dtype == "fp16" || dtype == "bf16", "dispatch table: dtype ", dtype);
        choices[choice_key(dtype == "bf16", d_head, bucket, mask, local, softcap)] =
            Choice{it->second, fb->second};
    }
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    table.choices = std::move(choices);
}

// The d_head variant that serves d_head (config.variant_for): variants are the multiples of 32,
// and a variant serves the multiples of 8 down to the variant below it.
inline int64_t d_head_variant(int64_t d_head) {
    return (d_head + 31) / 32 * 32;
}

// The table's choice for a call, {nullptr, nullptr} when it has none (keyed by variant).
inline Choice lookup(bool bf16, int64_t d_head, int64_t seqlen_q, bool mask, bool local,
                     bool softcap) {
    if (d_head <= 0 || d_head % 8 != 0)
        return Choice{nullptr, nullptr};
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    const auto it = table.choices.find(
        choice_key(bf16, d_head_variant(d_head), seq_bucket(seqlen_q), mask, local, softcap));
    return it == table.choices.end() ? Choice{nullptr, nullptr} : it->second;
}

// The table's kernel for a call ('' if none), before the run-time fallback (sm90_unfit).
inline std::string choice(const std::string& dtype, int64_t d_head, int64_t seqlen_q, bool mask,
                          bool softcap, bool local) {
    const flash::FwdKernelEntry* e =
        lookup(dtype == "bf16", d_head, seqlen_q, mask, local, softcap).kernel;
    return e == nullptr ? "" : e->name;
}

// The kernel for a call: `name`, or with "" the dispatch table's choice (with its fallback).
inline Choice choose_kernel(c10::string_view name, at::ScalarType dtype, int64_t d_head,
                            int64_t seqlen_q, bool mask, bool local, bool softcap) {
    if (name.empty()) {
        const Choice chosen =
            lookup(dtype == at::kBFloat16, d_head, seqlen_q, mask, local, softcap);
        FA_CHECK(chosen.kernel != nullptr, "this build has no kernel for ", dtype,
                 " with d_head=", d_head, mask ? " with masks" : "",
                 softcap ? " with a softcap" : "",
                 " (or flash_attention has not set its dispatch table); rebuild with "
                 "FLASH_ATTENTION_KERNELS=default");
        return chosen;
    }
    const auto& table = entries_by_name();
    const auto it = table.find(std::string(name));
    FA_CHECK(it != table.end(), "kernel ", name,
             " is not in this build; rebuild with FLASH_ATTENTION_KERNELS=", name,
             " (comma-separate to add more)");
    return Choice{it->second, nullptr};
}

}  // namespace flash::binding
