// The host references of CudaPowerSGD's kernels (reduction/cuda/powersgd_kernels.cuh), for the
// stand-in CUDA runtime: what each launch writes, on the stream's thread. The warp's dot products
// and the column sums (by chunks of rows, then the chunks) are added in the kernels' order; the orthonormalization's
// dot products in element order, where the kernel adds in a block's tree (rounding apart only).
#include "kernels.hpp"

#include <gradsync/reduction/cuda/powersgd_kernels.cuh>

#include <algorithm>  // for std::min
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

namespace gc = gradsync::cuda;
using gc::ExactRange;
using gc::LowRankMatrix;

// The sum of row[j] q[j] as a warp of 32 lanes adds it: lane l over j = l, l + 32, ..., then the
// butterfly of __shfl_xor_sync (offsets 16, 8, 4, 2, 1); lane 0's value.
float warp_dot(const float* row, const float* q, std::uint64_t m) {
    float lane[32] = {};
    for (std::uint64_t j = 0; j < m; ++j) lane[j % 32] += row[j] * q[j];
    for (unsigned offset = 16; offset > 0; offset /= 2) {
        float next[32];
        for (unsigned l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ offset];
        for (unsigned l = 0; l < 32; ++l) lane[l] = next[l];
    }
    return lane[0];
}

template <bool to_array>
void exact(const std::string& name) {
    standin::on_kernel(&gc::detail::lowrank_exact_kernel<to_array>, name,
                       [](dim3 grid, dim3, const ExactRange* ranges, float* values, float* array) {
                           for (unsigned y = 0; y < grid.y; ++y)
                               for (std::uint64_t i = 0; i < ranges[y].count; ++i) {
                                   if constexpr (to_array)
                                       array[ranges[y].to + i] = values[ranges[y].from + i];
                                   else
                                       values[ranges[y].from + i] = array[ranges[y].to + i];
                               }
                       });
}

[[maybe_unused]] const bool registered = [] {
    standin::on_kernel(&gc::detail::lowrank_draw_kernel<void>, "lowrank_draw_kernel",
                       [](dim3, dim3, float* q, std::uint64_t count, std::uint64_t key) {
                           for (std::uint64_t i = 0; i < count; ++i) q[i] = gradsync::detail::powersgd_uniform(key, i);
                       });
    exact<true>("lowrank_exact_kernel<true>");
    exact<false>("lowrank_exact_kernel<false>");
    standin::on_kernel(&gc::detail::lowrank_begin_kernel<void>, "lowrank_begin_kernel",
                       [](dim3 grid, dim3, const LowRankMatrix* table, float* values, float* ps, float loss_scale) {
                           for (unsigned y = 0; y < grid.y; ++y) {
                               const LowRankMatrix& mx = table[y];
                               for (std::uint64_t i = 0; i < mx.n; ++i) {
                                   float* row = values + mx.offset + i * mx.m;
                                   if (mx.error != nullptr)
                                       for (std::uint64_t j = 0; j < mx.m; ++j)
                                           row[j] += loss_scale * mx.error[i * mx.m + j];
                                   for (std::uint64_t k = 0; k < mx.r; ++k)
                                       ps[mx.p_at + k * mx.n + i] = warp_dot(row, mx.q + k * mx.m, mx.m);
                               }
                           }
                       });
    standin::on_kernel(&gc::detail::lowrank_orthonormalize_kernel<void>, "lowrank_orthonormalize_kernel",
                       [](dim3 grid, dim3, const LowRankMatrix* table, float* ps, unsigned* nonfinite) {
                           for (unsigned b = 0; b < grid.x; ++b) {
                               const LowRankMatrix& mx = table[b];
                               float* pt = ps + mx.p_at;
                               bool bad = false;
                               for (std::uint64_t i = 0; i < mx.n * mx.r; ++i) bad = bad || !std::isfinite(pt[i]);
                               if (bad) {
                                   *nonfinite = 1;
                                   continue;
                               }
                               for (std::uint64_t k = 0; k < mx.r; ++k) {
                                   float* col = pt + k * mx.n;
                                   for (int pass = 0; pass < 2; ++pass)
                                       for (std::uint64_t c = 0; c < k; ++c) {
                                           const float* other = pt + c * mx.n;
                                           double dot = 0;
                                           for (std::uint64_t i = 0; i < mx.n; ++i) dot += double(col[i]) * other[i];
                                           for (std::uint64_t i = 0; i < mx.n; ++i)
                                               col[i] = float(double(col[i]) - dot * other[i]);
                                       }
                                   double norm = 0;
                                   for (std::uint64_t i = 0; i < mx.n; ++i) norm += double(col[i]) * col[i];
                                   norm = std::sqrt(norm);
                                   for (std::uint64_t i = 0; i < mx.n; ++i)
                                       col[i] = norm > 0 ? float(col[i] / norm) : 0.0f;
                               }
                           }
                       });
    standin::on_kernel(
        &gc::detail::lowrank_project_kernel<void>, "lowrank_project_kernel",
        [](dim3 grid, dim3, const LowRankMatrix* table, const float* values, const float* ps, float* partials) {
            for (unsigned z = 0; z < grid.z; ++z) {
                const LowRankMatrix& mx = table[z];
                for (std::uint64_t c = 0; c < gc::detail::lowrank_chunks(mx.n); ++c) {
                    const std::uint64_t first = c * gc::detail::lowrank_rows_per_chunk;
                    const std::uint64_t last =
                        std::min(first + gc::detail::lowrank_rows_per_chunk, std::uint64_t(mx.n));
                    for (std::uint64_t j = 0; j < mx.m; ++j)
                        for (std::uint64_t k = 0; k < mx.r; ++k) {
                            float sum = 0;
                            for (std::uint64_t i = first; i < last; ++i)
                                sum += values[mx.offset + i * mx.m + j] * ps[mx.p_at + k * mx.n + i];
                            partials[mx.partial_at + (c * mx.r + k) * mx.m + j] = sum;
                        }
                }
            }
        });
    standin::on_kernel(&gc::detail::lowrank_sum_chunks_kernel<void>, "lowrank_sum_chunks_kernel",
                       [](dim3 grid, dim3, const LowRankMatrix* table, const float* partials, float* qs) {
                           for (unsigned y = 0; y < grid.y; ++y) {
                               const LowRankMatrix& mx = table[y];
                               const std::uint64_t count = mx.r * mx.m;
                               for (std::uint64_t e = 0; e < count; ++e) {
                                   float sum = 0;
                                   for (std::uint64_t c = 0; c < gc::detail::lowrank_chunks(mx.n); ++c)
                                       sum += partials[mx.partial_at + c * count + e];
                                   qs[mx.q_at + e] = sum;
                               }
                           }
                       });
    standin::on_kernel(&gc::detail::lowrank_nonfinite_kernel<void>, "lowrank_nonfinite_kernel",
                       [](dim3, dim3, const float* data, std::uint64_t n, unsigned* nonfinite) {
                           for (std::uint64_t i = 0; i < n; ++i)
                               if (!std::isfinite(data[i])) *nonfinite = 1;
                       });
    standin::on_kernel(&gc::detail::lowrank_approximate_kernel<void>, "lowrank_approximate_kernel",
                       [](dim3 grid, dim3, const LowRankMatrix* table, float* values, const float* ps, const float* qs,
                          float share, float unscale, bool warm_start, const unsigned* nonfinite) {
                           for (unsigned y = 0; y < grid.y; ++y) {
                               const LowRankMatrix& mx = table[y];
                               float* M = values + mx.offset;
                               for (std::uint64_t e = 0; e < mx.n * mx.m; ++e) {
                                   if (*nonfinite != 0) {
                                       M[e] = std::numeric_limits<float>::quiet_NaN();
                                       continue;
                                   }
                                   const std::uint64_t i = e / mx.m, j = e % mx.m;
                                   float approx = 0;
                                   for (std::uint64_t k = 0; k < mx.r; ++k)
                                       approx += (ps[mx.p_at + k * mx.n + i] * share) * qs[mx.q_at + k * mx.m + j];
                                   if (mx.error != nullptr) mx.error[e] = (M[e] - approx) * unscale;
                                   M[e] = approx;
                               }
                               if (*nonfinite == 0 && warm_start)
                                   for (std::uint64_t e = 0; e < mx.r * mx.m; ++e) mx.q[e] = qs[mx.q_at + e];
                           }
                       });
    return true;
}();

}  // namespace
