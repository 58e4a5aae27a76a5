// The contract of a memory policy: every pass DataParallel makes over gradient memory goes
// through one, bucket by bucket (pack, unpack, compress, finalize, zero, scale), and it says
// where bucket buffers live. HostMemory (memory/host.hpp) runs the passes on the calling thread;
// CudaMemory (memory/cuda.cuh) queues them on a stream. The MemoryPolicy concept, and a check
// that names the first missing member.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>

#include <concepts>  // for std::same_as, std::convertible_to
#include <cstddef>
#include <span>
#include <vector>

namespace gradsync::inline v0 {

// What the finalize pass found over all buckets of a step, where the memory policy keeps it (in
// device memory for CudaMemory): read by an optimizer's kernels under step_on_device().
struct StepVerdict {
    double sum_squares = 0;  // of the unscaled averaged gradients
    int finite = 1;          // 0: some gradient is an infinity or NaN; the step must change nothing
};

template <class M>
concept MemoryPolicy = detail::has_settings<M> &&
    requires(M& m, const M& cm, std::span<const Segment> segs, DType t, Bytes size, std::byte* bytes, double factor,
             std::size_t slot) {
    typename M::Storage;
    typename M::Table;
    { M::on_device } -> std::convertible_to<bool>;
    { cm.allocate(size) } -> std::same_as<typename M::Storage>;
    { M::data(std::declval<const typename M::Storage&>()) } -> std::same_as<std::byte*>;
    { cm.table(segs, t) } -> std::same_as<typename M::Table>;
    cm.pack(std::declval<const typename M::Table&>(), bytes);
    cm.unpack(std::declval<const typename M::Table&>(), bytes);
    cm.compress(std::declval<const typename M::Table&>(), bytes, t, factor);
    m.prepare_results(slot);
    m.finalize(std::declval<const typename M::Table&>(), bytes, t, factor, slot);
    { m.results() } -> std::convertible_to<std::span<const double>>;
    { m.verdict() } -> std::convertible_to<const StepVerdict*>;
    { cm.segment_sums(std::declval<const typename M::Table&>()) } -> std::convertible_to<std::vector<double>>;
    cm.scale(std::declval<const typename M::Table&>(), factor);
    cm.zero(Segment{}, t);
    cm.to_host(std::span<std::byte>{}, static_cast<const std::byte*>(bytes));
    cm.from_host(bytes, std::span<const std::byte>{});
};

// A memory policy whose passes run on a stream (CudaMemory): the backend's collectives must be
// ordered on the same one.
template <class M>
concept StreamMemory = MemoryPolicy<M> && requires(const M& m) {
    m.stream();
};

namespace detail {

template <class M>
constexpr bool check_memory_policy() {
    if constexpr (!MemoryPolicy<M>) {
        static_assert(
            requires {
                typename M::Storage;
                typename M::Table;
            },
            "gradsync: a memory policy needs member types `Storage` (a bucket buffer) and `Table` (a "
            "bucket's gradients as its passes take them)");
        static_assert(
            requires { M::on_device; }, "gradsync: a memory policy needs `static constexpr bool on_device`");
        static_assert(
            requires(const M& m, Bytes size) { m.allocate(size); },
            "gradsync: a memory policy needs `Storage allocate(gradsync::Bytes) const`");
        static_assert(
            requires(const M& m, std::span<const Segment> segs, DType t) { m.table(segs, t); },
            "gradsync: a memory policy needs `Table table(std::span<const gradsync::Segment>, "
            "gradsync::DType) const`");
        static_assert(
            requires(M & m, const typename M::Table& t, std::byte* b, DType d, double f, std::size_t s) {
                m.finalize(t, b, d, f, s);
                m.results();
                m.verdict();
            },
            "gradsync: a memory policy needs the finalize pass: `void finalize(const Table&, const std::byte* "
            "src, gradsync::DType, double factor, std::size_t slot)`, `std::span<const double> results()` and "
            "`const gradsync::StepVerdict* verdict()`");
        static_assert(dependent_false<M>,
                      "gradsync: a memory policy needs pack, unpack, compress, prepare_results, segment_sums, "
                      "scale, zero, to_host and from_host as HostMemory has them (memory/host.hpp)");
    }
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
