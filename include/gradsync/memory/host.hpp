// HostMemory: the memory policy for gradients in host memory. Bucket buffers are aligned host
// allocations, and every pass over gradient memory runs on the calling thread.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/host_passes.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/dtype.hpp>

#include <cmath>  // for std::isfinite
#include <cstddef>
#include <cstring>  // for std::memcpy, std::memset
#include <limits>   // for std::numeric_limits
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

// Every pass DataParallel makes over gradient memory goes through its memory policy, bucket by
// bucket: pack into a bucket buffer, unpack, finalize (scale, and measure the sum of squares),
// zero, scale. HostMemory does them on the calling thread; CudaMemory (cuda/memory.cuh) queues
// them on a stream. A policy object lives in each DataParallel.
//
// Measurements land in numbered result slots (one per bucket) and are read together by
// results(), so that a device reads them back once per step, not once per bucket.
struct HostMemory {
    using policy_category = policy_category::memory;
    using Storage = detail::AlignedBytes;
    static constexpr bool on_device = false;
    [[nodiscard]] std::string settings() const { return "host"; }

    // A bucket's gradients, in bucket order, as the passes take them.
    struct Table {
        std::vector<Segment> segments;
        DType dtype = DType::float32;
    };

    // Allocated and touched once, never per step.
    Storage allocate(Bytes size) const { return Storage(size.count()); }
    static std::byte* data(const Storage& s) { return s.data(); }
    Table table(std::span<const Segment> segments, DType t) const {
        return Table{{segments.begin(), segments.end()}, t};
    }

    // Copies between the memory this policy describes and the host, for checkpoints: done when
    // they return.
    void to_host(std::span<std::byte> host, const std::byte* from) const {
        if (!host.empty()) std::memcpy(host.data(), from, host.size());
    }
    void from_host(std::byte* to, std::span<const std::byte> host) const {
        if (!host.empty()) std::memcpy(to, host.data(), host.size());
    }

    // Copies the segments one after another into `dst`.
    void pack(const Table& t, std::byte* dst) const {
        const std::size_t elem = size_of(t.dtype);
        for (const auto& s : t.segments) {
            std::memcpy(dst, s.data, s.count * elem);
            dst += s.count * elem;
        }
    }
    // Copies consecutive bytes of `src` back into the segments.
    void unpack(const Table& t, const std::byte* src) const {
        const std::size_t elem = size_of(t.dtype);
        for (const auto& s : t.segments) {
            std::memcpy(s.data, src, s.count * elem);
            src += s.count * elem;
        }
    }
    // Packs the gradients into `dst` as `wire` values, each multiplied by `factor`: float32 ones
    // narrowed (wire compression), float16 and bfloat16 ones widened to float32 (for a hook).
    void compress(const Table& t, std::byte* dst, DType wire, double factor) const {
        const auto copy = [&]<class G, class W>(W* out) {
            for (const auto& s : t.segments) {
                detail::scale_copy(static_cast<const G*>(s.data), out, s.count, factor);
                out += s.count;
            }
        };
        if (t.dtype == DType::float32)
            return detail::visit_float_dtype(wire, [&]<class W>(detail::type_tag<W>) {
                copy.template operator()<float>(reinterpret_cast<W*>(dst));
            });
        if (wire != DType::float32)
            throw Error("gradsync: internal error: " + to_string(t.dtype) + " gradients packed as " + to_string(wire));
        detail::visit_float_dtype(
            t.dtype, [&]<class G>(detail::type_tag<G>) { copy.template operator()<G>(reinterpret_cast<float*>(dst)); });
    }

    // Room for `slots` results, before any finalize (once per bucket plan).
    void prepare_results(std::size_t slots) { results_.assign(slots, 0.0); }

    // The finalize pass: gradients = `src` (a reduced bucket of `src_type`; null: the gradients
    // themselves) times `factor`, and the sum of the squares of what was written into result slot
    // `slot`. With nothing to scale in place, only measures.
    // A `src_type` other than the gradients' is a wire dtype, and one of the two is float32: a
    // narrower wire of float32 gradients, or the float32 a hook left for 16-bit gradients.
    // A float16 wire holding an infinity or NaN (a sum that overflowed float16) writes nothing:
    // the gradients stay as they were, and the slot's result is NaN.
    void finalize(const Table& t, const std::byte* src, DType src_type, double factor, std::size_t slot) {
        if (src != nullptr && src_type != t.dtype && src_type == DType::float16 &&
            !detail::all_finite(reinterpret_cast<const float16*>(src), detail::total_count(t.segments))) {
            results_.at(slot) = std::numeric_limits<double>::quiet_NaN();
            return;
        }
        double total = 0;
        const auto unpack_measuring = [&]<class W, class T>(const W* in) {
            for (const auto& s : t.segments) {
                detail::SquareSum sums;
                detail::scale_copy_square_sum(in, static_cast<T*>(s.data), s.count, factor, sums);
                total += sums.total();
                in += s.count;
            }
        };
        if (src == nullptr) {
            detail::visit_float_dtype(t.dtype, [&]<class T>(detail::type_tag<T>) {
                for (const auto& s : t.segments) {
                    detail::SquareSum sums;
                    if (factor == 1.0)
                        detail::square_sum(static_cast<const T*>(s.data), s.count, sums);
                    else
                        detail::scale_square_sum(static_cast<T*>(s.data), s.count, factor, sums);
                    total += sums.total();
                }
            });
        } else if (src_type == t.dtype) {
            detail::visit_float_dtype(t.dtype, [&]<class T>(detail::type_tag<T>) {
                unpack_measuring.template operator()<T, T>(reinterpret_cast<const T*>(src));
            });
        } else if (t.dtype == DType::float32) {
            detail::visit_float_dtype(src_type, [&]<class W>(detail::type_tag<W>) {
                unpack_measuring.template operator()<W, float>(reinterpret_cast<const W*>(src));
            });
        } else {
            if (src_type != DType::float32)
                throw Error("gradsync: internal error: a " + to_string(src_type) + " wire for " + to_string(t.dtype) +
                            " gradients");
            detail::visit_float_dtype(t.dtype, [&]<class T>(detail::type_tag<T>) {
                unpack_measuring.template operator()<float, T>(reinterpret_cast<const float*>(src));
            });
        }
        results_.at(slot) = total;
    }
    // The result slots as the last finalize of each left them.
    std::span<const double> results() { return results_; }
    // Every slot combined, in slot order, where the policy keeps it.
    const StepVerdict* verdict() {
        double sum = 0;
        for (double r : results_) sum += r;
        verdict_ = StepVerdict{sum, std::isfinite(sum) ? 1 : 0};
        return &verdict_;
    }
    // The sum of squares of each segment as it is now (to name those that are not finite).
    std::vector<double> segment_sums(const Table& t) const {
        std::vector<double> out;
        detail::visit_float_dtype(t.dtype, [&]<class T>(detail::type_tag<T>) {
            for (const auto& s : t.segments) {
                detail::SquareSum sums;
                detail::square_sum(static_cast<const T*>(s.data), s.count, sums);
                out.push_back(sums.total());
            }
        });
        return out;
    }
    // Multiplies every gradient of the bucket by `factor` (clipping's second pass).
    void scale(const Table& t, double factor) const {
        detail::visit_float_dtype(t.dtype, [&]<class T>(detail::type_tag<T>) {
            for (const auto& s : t.segments) detail::scale_only(static_cast<T*>(s.data), s.count, factor);
        });
    }
    void zero(Segment s, DType t) const { std::memset(s.data, 0, s.count * size_of(t)); }

private:
    std::vector<double> results_;
    StepVerdict verdict_;
};

}  // namespace gradsync::inline v0
