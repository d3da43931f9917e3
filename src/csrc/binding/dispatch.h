// The dispatch tables and the choice of a kernel for a call, one table per direction.
// flash_attention computes the rows once per process (set_dispatch: flash_attention.ops for the
// forward, flash_attention.backward for the backward, from each kind's rows); with kernel == ""
// the operator runs the table's choice for (dtype, d_head variant, seqlen_q bucket, mask, local
// window, softcap), a lookup with no Python on the call path, or the row's sm80-family fallback
// when the Hopper kernel cannot run the call (sm90_unfit). The backward's rows are by dtype,
// d_head variant and softcap alone (bucket 64, no mask: masks are run-time arguments there).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../registry.h"
#include "kernel_registry.h"
#include "message.h"

namespace flash::binding {

// The sequence bucket of flash_attention.dispatch.seq_bucket: seqlen_q rounded up to a power of
// two, 64 .. 16384.
inline int64_t seq_bucket(int64_t seqlen_q) {
    int64_t bucket = 64;
    while (bucket < seqlen_q && bucket < 16384)
        bucket *= 2;
    return bucket;
}

// The name of a flash::DType in kernel names and table rows.
inline const char* dtype_name(flash::DType t) {
    switch (t) {
        case flash::DType::kFp16:
            return "fp16";
        case flash::DType::kBf16:
            return "bf16";
        case flash::DType::kE4m3:
            return "e4m3";
        case flash::DType::kE5m2:
            return "e5m2";
    }
    return "?";
}

// The dtype of a table row: 0 fp16, 1 bf16, 2 e4m3, 3 e5m2 (flash::DType); -1 for any other.
// A decode row over an FP8 cache names q's dtype and the cache's, "bf16_e4m3": code q + 4 x
// (the cache's code), so q's dtype with a cache of its own dtype keeps q's code.
inline int dtype_code(const std::string& dtype) {
    const auto one = [](const std::string& t) {
        return t == "fp16" ? 0 : t == "bf16" ? 1 : t == "e4m3" ? 2 : t == "e5m2" ? 3 : -1;
    };
    const size_t cut = dtype.find('_');
    if (cut == std::string::npos)
        return one(dtype);
    const int q = one(dtype.substr(0, cut)), cache = one(dtype.substr(cut + 1));
    return q < 0 || q > 1 || cache < 2 ? -1 : q + 4 * cache;
}
inline int dtype_code(at::ScalarType dtype) {
    return dtype == at::kHalf            ? 0
           : dtype == at::kBFloat16      ? 1
           : dtype == at::kFloat8_e4m3fn ? 2
           : dtype == at::kFloat8_e5m2   ? 3
                                         : -1;
}
// q's dtype over a cache of `cache`'s (dtype_code of "bf16_e4m3").
inline int dtype_code(at::ScalarType q, at::ScalarType cache) {
    const int qc = dtype_code(q), cc = dtype_code(cache);
    if (q == cache)
        return qc;
    return qc < 0 || qc > 1 || cc < 2 ? -1 : qc + 4 * cc;
}

// local: a sliding window bounded on the left (window_left != -1 after canonical_window); such
// rows may name another Hopper kernel than the masked ones (flash_attention.dispatch).
inline uint64_t choice_key(int dtype, int64_t d_head, int64_t bucket, bool mask, bool local,
                           bool softcap) {
    return (uint64_t(dtype) << 40) | (uint64_t(d_head) << 24) | (uint64_t(bucket) << 3) |
           (uint64_t(mask) << 2) | (uint64_t(local && mask) << 1) | uint64_t(softcap);
}

// A row's kernel and its fallback: an sm80-family kernel that runs wherever the kernel (a Hopper
// one) cannot; the same entry when the kernel is an sm80 one; nullptr when the build has none.
// varlen: the Hopper kernel of the row's varlen calls (the forward's flag j), nullptr when none
// is built (they run the kernel, or the fallback where it is a Hopper one). one_wave: Hopper
// kernels, in tier order, for a fixed-length call whose tiles fit in one wave (one_wave());
// key_pad: a Hopper kernel for one whose keys it pads less (fewer_padded_keys()).
template <class Entry>
struct Choice {
    static constexpr int kOneWaveTiers = 2;
    const Entry* kernel;
    const Entry* fallback;
    const Entry* varlen = nullptr;
    const Entry* one_wave[kOneWaveTiers] = {};
    const Entry* key_pad = nullptr;
};

// The first of a row's one-wave kernels whose tiles (batch x heads x query blocks of its B_r)
// fit in one wave on `sms` SMs (one CTA per SM), or nullptr: a small call (a ViT encoder at
// batch 1) runs more, smaller tiles, or one tile per SM without a persistent grid
// (flash_attention.kernels.fwd_sm90.ONE_WAVE_ROWS).
template <class Entry>
const Entry* one_wave(const Choice<Entry>& c, int64_t batch, int64_t heads, int64_t seqlen_q,
                      int sms) {
    for (const Entry* e : c.one_wave)
        if (e != nullptr && batch * heads * ((seqlen_q + e->block_r - 1) / e->block_r) <= sms)
            return e;
    return nullptr;
}

// The row's fewer-padded-keys kernel where its B_c pads the call's seqlen_k keys at least 1/8
// less than `pick`'s B_c does (257 keys: B_c 96 pads to 288, B_c 128 to 384), or nullptr
// (flash_attention.kernels.fwd_sm90.KEY_PAD_ROWS).
template <class Entry>
const Entry* fewer_padded_keys(const Choice<Entry>& c, const Entry& pick, int64_t seqlen_k) {
    const auto padded = [seqlen_k](const Entry& e) {
        return (seqlen_k + e.block_c - 1) / e.block_c * e.block_c;
    };
    if (c.key_pad == nullptr || 8 * padded(*c.key_pad) > 7 * padded(pick))
        return nullptr;
    return c.key_pad;
}

template <class Entry>
struct DispatchTable {
    std::mutex mutex;
    std::unordered_map<uint64_t, Choice<Entry>> choices;
};

template <class Entry>
DispatchTable<Entry>& dispatch_table() {
    static DispatchTable<Entry> table;
    return table;
}

// (dtype, d_head, bucket, mask, local, softcap, kernel name, fallback name, varlen kernel name,
// one-wave kernel names (comma-separated, in tier order), fewer-padded-keys kernel name; "" for
// none)
using DispatchRow = std::tuple<std::string, int64_t, int64_t, bool, bool, bool, std::string,
                               std::string, std::string, std::string, std::string>;

template <class Entry>
void set_rows(const std::vector<DispatchRow>& rows) {
    std::unordered_map<uint64_t, Choice<Entry>> choices;
    const auto& by_name = entries_by_name<Entry>();
    const auto entry = [&by_name](const std::string& name) -> const Entry* {
        if (name.empty())
            return nullptr;
        const auto it = by_name.find(name);
        FA_CHECK(it != by_name.end(), "dispatch table names kernel ", name,
                 ", which is not in this build");
        return it->second;
    };
    for (const auto& [dtype, d_head, bucket, mask, local, softcap, name, fallback, varlen, waves,
                      key_pad] : rows) {
        Choice<Entry> c{entry(name), entry(fallback), entry(varlen)};
        c.key_pad = entry(key_pad);
        FA_CHECK(c.key_pad == nullptr || (c.key_pad->arch == 90 && !c.key_pad->varlen_only),
                 "dispatch table: fewer-padded-keys kernel ", key_pad,
                 " is not a fixed-length Hopper kernel");
        int tier = 0;
        for (size_t at = 0; at < waves.size();) {
            const size_t end = std::min(waves.find(',', at), waves.size());
            FA_CHECK(tier < Choice<Entry>::kOneWaveTiers, "dispatch table: more than ",
                     Choice<Entry>::kOneWaveTiers, " one-wave kernels: ", waves);
            const Entry* e = entry(waves.substr(at, end - at));
            // the decode table's: a kernel for calls whose tiles fill one CTA per SM (deep)
            FA_CHECK(e != nullptr && (std::is_same_v<Entry, flash::DecKernelEntry> ||
                                      (e->arch == 90 && !e->varlen_only)),
                     "dispatch table: one-wave kernel ", waves.substr(at, end - at),
                     " is not a fixed-length Hopper kernel");
            c.one_wave[tier++] = e;
            at = end + 1;
        }
        FA_CHECK(c.fallback == nullptr || c.fallback->arch == 80, "dispatch table: fallback ",
                 fallback, " is not an sm80-family kernel");
        FA_CHECK(c.varlen == nullptr || c.varlen->varlen_only, "dispatch table: varlen kernel ",
                 varlen, " does not take varlen calls alone");
        FA_CHECK(dtype_code(dtype) >= 0, "dispatch table: dtype ", dtype);
        choices[choice_key(dtype_code(dtype), d_head, bucket, mask, local, softcap)] = c;
    }
    DispatchTable<Entry>& table = dispatch_table<Entry>();
    const std::lock_guard<std::mutex> lock(table.mutex);
    table.choices = std::move(choices);
}

// Replaces a direction's table ("fwd", "bwd" or "dec").
inline void set_dispatch(const std::string& direction, const std::vector<DispatchRow>& rows) {
    FA_CHECK_VALUE(direction == "fwd" || direction == "bwd" || direction == "dec",
                   "set_dispatch: direction must be fwd, bwd or dec, got ", direction);
    if (direction == "fwd")
        set_rows<flash::FwdKernelEntry>(rows);
    else if (direction == "bwd")
        set_rows<flash::BwdKernelEntry>(rows);
    else
        set_rows<flash::DecKernelEntry>(rows);
}

// The d_head variant that serves d_head (kernels.fwd_sm80.variant_for): variants are the
// multiples of 32, and a variant serves the multiples of 8 down to the variant below it.
inline int64_t d_head_variant(int64_t d_head) {
    return (d_head + 31) / 32 * 32;
}

// The table's row of this bucket, {nullptr, nullptr} when it has none (keyed by variant). The
// forward's and backward's buckets are seq_bucket's; the decode table's are its tiles' packed
// rows (16, 32).
template <class Entry>
Choice<Entry> lookup_bucket(int dtype, int64_t d_head, int64_t bucket, bool mask, bool local,
                            bool softcap) {
    if (d_head <= 0 || d_head % 8 != 0 || dtype < 0)
        return Choice<Entry>{nullptr, nullptr};
    DispatchTable<Entry>& table = dispatch_table<Entry>();
    const std::lock_guard<std::mutex> lock(table.mutex);
    const auto it =
        table.choices.find(choice_key(dtype, d_head_variant(d_head), bucket, mask, local, softcap));
    return it == table.choices.end() ? Choice<Entry>{nullptr, nullptr} : it->second;
}

// The table's choice for a call of seqlen_q query rows.
template <class Entry>
Choice<Entry> lookup(int dtype, int64_t d_head, int64_t seqlen_q, bool mask, bool local,
                     bool softcap) {
    return lookup_bucket<Entry>(dtype, d_head, seq_bucket(seqlen_q), mask, local, softcap);
}

// The forward table's kernel for a call ('' if none), before the run-time fallback.
inline std::string choice(const std::string& dtype, int64_t d_head, int64_t seqlen_q, bool mask,
                          bool softcap, bool local) {
    const flash::FwdKernelEntry* e =
        lookup<flash::FwdKernelEntry>(dtype_code(dtype), d_head, seqlen_q, mask, local, softcap)
            .kernel;
    return e == nullptr ? "" : e->name;
}

// The kernel for a call: `name` (refused when not built), or with "" the table's choice (with
// its fallback; refused when the table has none). `what` names the direction in errors.
template <class Entry>
Choice<Entry> choose_kernel(c10::string_view name, at::ScalarType dtype, int64_t d_head,
                            int64_t seqlen_q, bool mask, bool local, bool softcap,
                            const char* what) {
    if (name.empty()) {
        const Choice<Entry> chosen =
            lookup<Entry>(dtype_code(dtype), d_head, seqlen_q, mask, local, softcap);
        FA_CHECK(chosen.kernel != nullptr, "this build has no ", what, "kernel for ", dtype,
                 " with d_head=", d_head, mask ? " with masks" : "",
                 softcap ? " with a softcap" : "",
                 " (or flash_attention has not set its dispatch table); rebuild with "
                 "FLASH_ATTENTION_KERNELS=default");
        return chosen;
    }
    const auto& table = entries_by_name<Entry>();
    const auto it = table.find(std::string(name));
    FA_CHECK(it != table.end(), what, "kernel ", name,
             " is not in this build; rebuild with FLASH_ATTENTION_KERNELS=default,", name);
    return Choice<Entry>{it->second, nullptr, nullptr};
}

}  // namespace flash::binding
