// The host references of gradsync's kernels, for the stand-in CUDA runtime: what each launch
// writes, computed on the stream's thread. Values are what the kernels write, bit for bit (the same
// conversions, rounding to nearest even); sums of squares are added in element order, where the
// kernels add in a fixed tree of blocks, so they agree with the GPU's to rounding only.
#include "kernels.hpp"

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/memory/cuda.cuh>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace {

namespace gc = gradsync::cuda;
using gc::Segment;
using gc::detail::device_accumulator_t;

template <class T>
device_accumulator_t<T> widen(T v) {
    return static_cast<device_accumulator_t<T>>(v);
}

template <class T>
T narrow(device_accumulator_t<T> v) {
    return static_cast<T>(v);
}

double square(double v) { return v * v; }

template <class T, bool to_bucket>
void copy_bucket(const std::string& name) {
    standin::on_kernel(&gc::detail::copy_bucket<T, to_bucket>, name,
                       [](dim3, dim3, const Segment* table, std::size_t segments, T* bucket, std::uint64_t) {
                           for (std::size_t s = 0; s < segments; ++s) {
                               T* tensor = static_cast<T*>(table[s].data);
                               T* packed = bucket + table[s].offset;
                               if constexpr (to_bucket)
                                   std::memcpy(packed, tensor, table[s].count * sizeof(T));
                               else
                                   std::memcpy(tensor, packed, table[s].count * sizeof(T));
                           }
                       });
}

template <class T>
void finalize(const std::string& name) {
    standin::on_kernel(
        &gc::detail::finalize_kernel<T>, name,
        [](dim3, dim3, T* data, std::uint64_t n, device_accumulator_t<T> factor, double*, unsigned*, double* sum) {
            double squares = 0;
            for (std::uint64_t i = 0; i < n; ++i) {
                data[i] = narrow<T>(widen(data[i]) * factor);
                squares += square(static_cast<double>(widen(data[i])));
            }
            *sum = squares;
        });
}

template <class S, class T>
void table_finalize(const std::string& name) {
    standin::on_kernel(
        &gc::detail::table_finalize_kernel<S, T>, name,
        [](dim3, dim3, const Segment* table, std::size_t segments, const S* bucket, std::uint64_t,
           device_accumulator_t<T> factor, bool write, const unsigned* skip, double*, unsigned*, double* sum) {
            if (skip != nullptr && *skip != 0) {
                *sum = std::numeric_limits<double>::quiet_NaN();
                return;
            }
            double squares = 0;
            for (std::size_t s = 0; s < segments; ++s) {
                T* tensor = static_cast<T*>(table[s].data);
                for (std::uint64_t i = 0; i < table[s].count; ++i) {
                    T value{};
                    if constexpr (std::is_same_v<S, T>) {
                        const T in = bucket != nullptr ? bucket[table[s].offset + i] : tensor[i];
                        value = write ? narrow<T>(widen(in) * factor) : in;
                    } else {
                        value = narrow<T>(widen(bucket[table[s].offset + i]) * factor);
                    }
                    if (write) tensor[i] = value;
                    squares += square(static_cast<double>(widen(value)));
                }
            }
            *sum = squares;
        });
}

template <class T, class W>
void table_compress(const std::string& name) {
    standin::on_kernel(
        &gc::detail::table_compress_kernel<T, W>, name,
        [](dim3, dim3, const Segment* table, std::size_t segments, W* bucket, std::uint64_t, float factor) {
            for (std::size_t s = 0; s < segments; ++s) {
                const auto* tensor = static_cast<const T*>(table[s].data);
                for (std::uint64_t i = 0; i < table[s].count; ++i) {
                    const float value = static_cast<float>(widen(tensor[i])) * factor;
                    if constexpr (std::is_same_v<W, float>)
                        bucket[table[s].offset + i] = value;
                    else
                        bucket[table[s].offset + i] = narrow<W>(value);
                }
            }
        });
}

template <class T>
void segment_squares(const std::string& name) {
    standin::on_kernel(&gc::detail::segment_squares_kernel<T>, name,
                       [](dim3 grid, dim3, const Segment* table, double* sums) {
                           for (unsigned s = 0; s < grid.x; ++s) {
                               double squares = 0;
                               const T* data = static_cast<const T*>(table[s].data);
                               for (std::uint64_t i = 0; i < table[s].count; ++i)
                                   squares += square(static_cast<double>(widen(data[i])));
                               sums[s] = squares;
                           }
                       });
}

template <class T>
void reduce_ranks(const std::string& name) {
    standin::on_kernel(&gc::detail::reduce_ranks_kernel<T>, name,
                       [](dim3, dim3, gc::detail::RankPointers ptrs, int ranks, std::uint64_t n, bool scaled,
                          device_accumulator_t<T> factor, bool owner_only) {
                           for (std::uint64_t i = 0; i < n; ++i) {
                               auto sum = widen(static_cast<const T*>(ptrs.at[0])[i]);
                               for (int r = 1; r < ranks; ++r) sum += widen(static_cast<const T*>(ptrs.at[r])[i]);
                               const T out = narrow<T>(scaled ? sum * factor : sum);
                               for (int r = 0; r < ranks; ++r) {
                                   const auto mine = gradsync::shard_of(n, ranks, r);
                                   if (!owner_only || (i >= mine.offset && i < mine.offset + mine.count))
                                       static_cast<T*>(ptrs.at[r])[i] = out;
                               }
                           }
                       });
}

// Every kernel of gradsync's device path, each instantiation it launches.
[[maybe_unused]] const bool registered = [] {
    using gradsync::bfloat16;
    using gradsync::float16;
    copy_bucket<std::uint16_t, true>("copy_bucket<uint16_t, true>");
    copy_bucket<std::uint16_t, false>("copy_bucket<uint16_t, false>");
    copy_bucket<float, true>("copy_bucket<float, true>");
    copy_bucket<float, false>("copy_bucket<float, false>");
    copy_bucket<double, true>("copy_bucket<double, true>");
    copy_bucket<double, false>("copy_bucket<double, false>");
    finalize<float>("finalize_kernel<float>");
    finalize<double>("finalize_kernel<double>");
    finalize<float16>("finalize_kernel<float16>");
    finalize<bfloat16>("finalize_kernel<bfloat16>");
    table_finalize<float, float>("table_finalize_kernel<float, float>");
    table_finalize<double, double>("table_finalize_kernel<double, double>");
    table_finalize<float16, float16>("table_finalize_kernel<float16, float16>");
    table_finalize<bfloat16, bfloat16>("table_finalize_kernel<bfloat16, bfloat16>");
    table_finalize<float16, float>("table_finalize_kernel<float16, float>");
    table_finalize<bfloat16, float>("table_finalize_kernel<bfloat16, float>");
    table_finalize<float, float16>("table_finalize_kernel<float, float16>");
    table_finalize<float, bfloat16>("table_finalize_kernel<float, bfloat16>");
    table_compress<float, float16>("table_compress_kernel<float, float16>");
    table_compress<float, bfloat16>("table_compress_kernel<float, bfloat16>");
    table_compress<float16, float>("table_compress_kernel<float16, float>");
    table_compress<bfloat16, float>("table_compress_kernel<bfloat16, float>");
    segment_squares<float>("segment_squares_kernel<float>");
    segment_squares<double>("segment_squares_kernel<double>");
    segment_squares<float16>("segment_squares_kernel<float16>");
    segment_squares<bfloat16>("segment_squares_kernel<bfloat16>");
    reduce_ranks<float>("reduce_ranks_kernel<float>");
    reduce_ranks<double>("reduce_ranks_kernel<double>");
    reduce_ranks<float16>("reduce_ranks_kernel<float16>");
    reduce_ranks<bfloat16>("reduce_ranks_kernel<bfloat16>");
    standin::on_kernel(&gc::detail::nonfinite_float16_kernel<void>, "nonfinite_float16_kernel",
                       [](dim3, dim3, const float16* data, std::uint64_t n, unsigned* flag) {
                           for (std::uint64_t i = 0; i < n; ++i)
                               if ((data[i].bits & 0x7c00u) == 0x7c00u) *flag = 1;
                       });
    standin::on_kernel(&gc::detail::verdict_kernel<void>, "verdict_kernel",
                       [](dim3, dim3, const double* slots, std::size_t n, gradsync::StepVerdict* verdict) {
                           double sum = 0;
                           for (std::size_t i = 0; i < n; ++i) sum += slots[i];
                           verdict->sum_squares = sum;
                           verdict->finite = std::isfinite(sum) ? 1 : 0;
                       });
    return true;
}();

}  // namespace
