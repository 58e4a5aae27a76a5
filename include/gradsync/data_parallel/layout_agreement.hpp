// Construction-time agreement between ranks: each rank checks its own parameter list, then all
// ranks compare layouts and bucket plans by hash and, only on a difference, exchange the
// details, so that every rank throws the same message naming the first differing parameter.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/rank_table.hpp>
#include <gradsync/data_parallel/settings.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::sort
#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// A stated shape that does not hold `count` elements, as `who` ("parameter 'w'") is told; else empty.
inline std::string shape_problem(const std::string& who, const std::vector<std::size_t>& shape, std::size_t count) {
    if (shape.empty() || shape_elements(shape) == count) return {};
    return who + " has " + std::to_string(count) + " elements but its shape " + shape_text(shape) + " holds " +
           std::to_string(shape_elements(shape)) + "; state the shape of its elements, or none";
}

// The first problem with this rank's parameters and buffers, or "" when there is none. With
// `gradients_later`, a gradient may not exist yet (a framework that allocates it in the first
// backward); it is bound at the latest in the first synchronize().
template <class B>
std::string find_model_problem(std::span<const Parameter> params, std::span<const ModelBuffer> buffers,
                               const B& backend, bool gradients_later) {
    for (const auto& b : buffers) {
        const std::string who = "buffer '" + b.name + "'";
        if (!is_known(b.dtype))
            return who + " has an unknown dtype (code " + std::to_string(static_cast<unsigned>(b.dtype)) + ")";
        if (b.data == nullptr && b.count != 0) return who + " has a null data pointer";
        if (auto problem = shape_problem(who, b.shape, b.count); !problem.empty()) return problem;
    }
    for (const auto& p : params) {
        const std::string who = "parameter '" + p.name + "'";
        if (!is_known(p.dtype))
            return who + " has an unknown dtype (code " + std::to_string(static_cast<unsigned>(p.dtype)) + ")";
        if (!backend.supports(p.dtype)) return who + " is " + to_string(p.dtype) + ", which this backend cannot reduce";
        if (p.data == nullptr) return who + " has a null data pointer";
        if (auto problem = shape_problem(who, p.shape, p.count); !problem.empty()) return problem;
        if (p.grad == nullptr && !gradients_later)
            return who + " has a null gradient pointer (with device memory, or Options::storage_may_move off, " +
                   "every gradient must exist when the DataParallel is made)";
    }
    struct Range {
        std::uintptr_t begin, end;
        const Parameter* param;
    };
    std::vector<Range> ranges;
    ranges.reserve(params.size());
    for (const auto& p : params) {
        if (p.grad == nullptr) continue;  // not made yet
        auto begin = reinterpret_cast<std::uintptr_t>(p.grad);
        ranges.push_back({begin, begin + p.bytes().count(), &p});
    }
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
    for (std::size_t i = 1; i < ranges.size(); ++i) {
        if (ranges[i].begin < ranges[i - 1].end) {
            return "parameters '" + ranges[i - 1].param->name + "' and '" + ranges[i].param->name +
                   "' share gradient memory; give each parameter a gradient buffer of its own";
        }
    }
    return {};
}

// A model with no parameter that has elements would have nothing averaged, and its ranks would
// drift apart without a word: "" when it has one, else what to do. `listed`: how many the model
// listed, empty ones included.
inline std::string no_parameters_problem(std::span<const Parameter> params, std::size_t listed) {
    if (!params.empty()) return {};
    return "the model lists no parameter with elements (" + std::to_string(listed) +
           " listed, all empty), so nothing would be averaged. A framework that makes its parameters at the first "
           "forward (lazy modules) must run one forward before the model is wrapped";
}

// One tensor of the layout that must agree across ranks: a parameter or a buffer.
struct LayoutEntry {
    bool is_buffer = false;
    std::size_t index = 0;  // among the parameters, or among the buffers
    std::string name;
    std::uint64_t count = 0;
    DType dtype = DType::float32;
    std::vector<std::size_t> shape;  // where the model states it
};

inline std::vector<LayoutEntry> layout_of(std::span<const Parameter> params, std::span<const ModelBuffer> buffers) {
    std::vector<LayoutEntry> out;
    for (std::size_t i = 0; i < params.size(); ++i)
        out.push_back({false, i, params[i].name, params[i].count, params[i].dtype, params[i].shape});
    for (std::size_t i = 0; i < buffers.size(); ++i)
        out.push_back({true, i, buffers[i].name, buffers[i].count, buffers[i].dtype, buffers[i].shape});
    return out;
}

// What must agree: the kind, name, element count, dtype and shape of every tensor, in order. Names too:
// two tensors of one size registered in another order would be averaged into each other's place.
inline std::uint64_t layout_hash(const std::vector<LayoutEntry>& layout) {
    Fnv1a h;
    h.add(layout.size());
    for (const auto& e : layout) {
        h.add(e.is_buffer ? 1 : 0).add(e.count).add(static_cast<std::uint64_t>(e.dtype)).add(e.name.size());
        for (unsigned char c : e.name) h.add(c);
        h.add(e.shape.size());
        for (auto d : e.shape) h.add(d);
    }
    return h.value();
}

// The settings as one text: "name\0value\0" for each.
inline std::string serialize_settings(std::span<const Setting> settings) {
    std::string out;
    for (const auto& s : settings) {
        out += s.name;
        out += '\0';
        out += s.value;
        out += '\0';
    }
    return out;
}

inline std::vector<Setting> parse_settings(const std::string& text) {
    std::vector<Setting> out;
    std::size_t at = 0;
    while (at < text.size()) {
        const auto name_end = text.find('\0', at);
        const auto value_end = name_end == std::string::npos ? std::string::npos : text.find('\0', name_end + 1);
        if (value_end == std::string::npos) throw Error("gradsync: internal error: truncated settings record");
        out.push_back({text.substr(at, name_end - at), text.substr(name_end + 1, value_end - name_end - 1)});
        at = value_end + 1;
    }
    return out;
}

// Names the first setting where rank a's and rank b's differ.
inline std::string describe_settings_difference(int a, const std::vector<Setting>& sa, int b,
                                                const std::vector<Setting>& sb) {
    std::string what = "a setting";
    for (std::size_t i = 0; i < sa.size() && i < sb.size(); ++i) {
        if (sa[i].name == sb[i].name && sa[i].value == sb[i].value) continue;
        what = sa[i].name + " is '" + sa[i].value + "' on rank " + std::to_string(a) + " but '" + sb[i].value +
               "' on rank " + std::to_string(b);
        break;
    }
    return "gradsync: the ranks' settings differ: " + what +
           ". Every rank must construct its DataParallel or ShardedDataParallel with the same policies and the same "
           "options";
}

inline void put(std::vector<std::byte>& out, const void* p, std::size_t n) {
    auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
}

inline std::vector<std::byte> serialize_layout(const std::vector<LayoutEntry>& layout) {
    std::vector<std::byte> out;
    for (const auto& e : layout) {
        std::uint8_t kind = e.is_buffer ? 1 : 0;
        std::uint64_t index = e.index, count = e.count, name_size = e.name.size();
        auto dtype = static_cast<std::uint8_t>(e.dtype);
        put(out, &kind, sizeof kind);
        put(out, &index, sizeof index);
        put(out, &count, sizeof count);
        put(out, &dtype, sizeof dtype);
        put(out, &name_size, sizeof name_size);
        put(out, e.name.data(), e.name.size());
        std::uint64_t dims = e.shape.size();
        put(out, &dims, sizeof dims);
        for (std::uint64_t d : e.shape) put(out, &d, sizeof d);
    }
    return out;
}

inline std::vector<LayoutEntry> parse_layout(std::span<const std::byte> bytes) {
    std::vector<LayoutEntry> out;
    std::size_t pos = 0;
    auto get = [&](void* dst, std::size_t n) {
        if (pos + n > bytes.size()) throw Error("gradsync: internal error: truncated layout record");
        std::memcpy(dst, bytes.data() + pos, n);
        pos += n;
    };
    while (pos < bytes.size()) {
        LayoutEntry e;
        std::uint8_t kind = 0, dtype = 0;
        std::uint64_t index = 0, name_size = 0;
        get(&kind, sizeof kind);
        get(&index, sizeof index);
        get(&e.count, sizeof e.count);
        get(&dtype, sizeof dtype);
        get(&name_size, sizeof name_size);
        e.is_buffer = kind != 0;
        e.index = static_cast<std::size_t>(index);
        e.dtype = static_cast<DType>(dtype);
        e.name.resize(name_size);
        get(e.name.data(), name_size);
        std::uint64_t dims = 0;
        get(&dims, sizeof dims);
        if (dims > bytes.size()) throw Error("gradsync: internal error: truncated layout record");
        for (std::uint64_t k = 0; k < dims; ++k) {
            std::uint64_t d = 0;
            get(&d, sizeof d);
            e.shape.push_back(static_cast<std::size_t>(d));
        }
        out.push_back(std::move(e));
    }
    return out;
}

inline std::string describe_entry(const LayoutEntry& e) {
    return std::string(e.is_buffer ? "buffer #" : "parameter #") + std::to_string(e.index) + " '" + e.name + "' (" +
           std::to_string(e.count) + " x " + to_string(e.dtype) +
           (e.shape.empty() ? "" : ", shape " + shape_text(e.shape)) + ")";
}

// Names the first tensor where rank a's and rank b's layouts differ.
inline std::string describe_layout_difference(int a, const std::vector<LayoutEntry>& la, int b,
                                              const std::vector<LayoutEntry>& lb) {
    std::string prefix = "gradsync: the model's layout differs across ranks: ";
    std::string suffix =
        ". Every rank must register the same parameters and buffers, in the same order, with the same names, sizes, "
        "dtypes and shapes (zero-sized parameters are skipped and not compared)";
    std::size_t n = std::min(la.size(), lb.size());
    for (std::size_t i = 0; i < n; ++i) {
        if (la[i].is_buffer != lb[i].is_buffer || la[i].count != lb[i].count || la[i].dtype != lb[i].dtype ||
            la[i].name != lb[i].name || la[i].shape != lb[i].shape) {
            return prefix + "rank " + std::to_string(a) + " has " + describe_entry(la[i]) + " where rank " +
                   std::to_string(b) + " has " + describe_entry(lb[i]) + suffix;
        }
    }
    const auto& longer = la.size() > lb.size() ? la : lb;
    int longer_rank = la.size() > lb.size() ? a : b;
    return prefix + "rank " + std::to_string(a) + " has " + std::to_string(la.size()) + " tensors and rank " +
           std::to_string(b) + " has " + std::to_string(lb.size()) + "; " + describe_entry(longer[n]) +
           " exists only on rank " + std::to_string(longer_rank) + suffix;
}

// What a rank found wrong with its own set-up before the agreement: the whole message.
struct LocalProblem {
    enum class Kind : std::uint8_t { none, model, configuration };
    Kind kind = Kind::none;
    std::string what;
};

// Every rank calls this with its own parameters, plan, settings and problem, if any. Returns
// when all ranks agree; otherwise throws the same exception, with the same message, on every
// rank: the first rank's problem, else the first differing setting, tensor, or the plans.
template <class B>
void agree_on_layout(B& backend, std::span<const Parameter> params, std::span<const ModelBuffer> buffers,
                     const BucketPlan& plan, std::span<const Setting> settings, const LocalProblem& problem) {
    const int world = backend.size();
    const int me = backend.rank();
    const auto entries = layout_of(params, buffers);
    auto layout = serialize_layout(entries);
    const auto settings_text = serialize_settings(settings);

    enum : std::size_t {
        layout_hash_column,
        plan_hash,
        settings_hash,
        problem_kind,
        problem_size,
        layout_size,
        settings_size,
        columns
    };
    RankTable table(world, me, columns);
    Fnv1a settings_fnv;
    for (unsigned char c : settings_text) settings_fnv.add(c);
    table.set(layout_hash_column, layout_hash(entries));
    table.set(plan_hash, plan.hash());
    table.set(settings_hash, settings_fnv.value());
    table.set(problem_kind, static_cast<std::uint64_t>(problem.kind));
    table.set(problem_size, problem.what.size());
    table.set(layout_size, layout.size());
    table.set(settings_size, settings_text.size());
    table.gather(backend);
    auto at = [&](int r, std::size_t column) { return table.at(r, column); };

    // Fetches rank r's bytes of the given size: its own copy on r, the broadcast elsewhere.
    auto fetch = [&](int r, std::size_t size, const void* own) {
        std::vector<std::byte> bytes(size);
        if (r == me && size != 0) std::memcpy(bytes.data(), own, size);
        backend.broadcast(std::span<std::byte>(bytes), r);
        return bytes;
    };
    auto fetch_text = [&](int r, std::size_t size_field, const std::string& own) {
        const auto bytes = fetch(r, static_cast<std::size_t>(at(r, size_field)), own.data());
        return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    };

    for (int r = 0; r < world; ++r) {
        if (at(r, problem_kind) == 0) continue;
        const auto what = fetch_text(r, problem_size, problem.what);
        if (at(r, problem_kind) == static_cast<std::uint64_t>(LocalProblem::Kind::configuration))
            throw ConfigurationError(what);
        throw InvalidModel(what);
    }
    for (int r = 1; r < world; ++r) {
        if (table.same_as_rank0(r, settings_hash)) continue;
        const auto s0 = parse_settings(fetch_text(0, settings_size, settings_text));
        const auto sr = parse_settings(fetch_text(r, settings_size, settings_text));
        throw ConfigurationError(describe_settings_difference(0, s0, r, sr));
    }
    for (int r = 1; r < world; ++r) {
        if (table.same_as_rank0(r, layout_hash_column)) continue;
        auto l0 = parse_layout(fetch(0, static_cast<std::size_t>(at(0, layout_size)), layout.data()));
        auto lr = parse_layout(fetch(r, static_cast<std::size_t>(at(r, layout_size)), layout.data()));
        throw LayoutMismatch(describe_layout_difference(0, l0, r, lr));
    }
    for (int r = 1; r < world; ++r) {
        if (table.same_as_rank0(r, plan_hash)) continue;
        throw LayoutMismatch("gradsync: the bucket plans of rank 0 and rank " + std::to_string(r) +
                             " differ although their parameters agree; pass the same bucketer, with the same "
                             "caps, on every rank");
    }
}

// Copies rank 0's parameter values into every rank's parameters (collective).
template <class B>
void broadcast_parameters(B& backend, std::span<const Parameter> params) {
    if (backend.size() == 1) return;
    for (const auto& p : params) backend.broadcast(std::span(static_cast<std::byte*>(p.data), p.bytes().count()), 0);
}

}  // namespace gradsync::inline v0::detail
