// A model of bfloat16, float16 and float32 tensors whose gradients differ by rank and step, and
// the check of what a reduction in float32 leaves in them: the average over the ranks rounded
// once into the tensor's dtype. Every value has 8 significant bits and a magnitude in [0.5, 2),
// so it is exact in all three dtypes and the sum over a few ranks is exact in float32 in any
// order, while a bfloat16 sum rounds at its steps (it keeps 8 bits and such a sum needs up to 11).
#pragma once

#include <gradsync/half.hpp>
#include <gradsync/model/model.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace testing_support {

struct HalfGradients {
    static constexpr std::size_t n = 301;
    std::vector<gradsync::bfloat16> wa = std::vector<gradsync::bfloat16>(n), ga = wa, wb = wa, gb = wa;
    std::vector<gradsync::float16> wc = std::vector<gradsync::float16>(n), gc = wc;
    std::vector<float> wd = std::vector<float>(n), gd = wd;

    // Two bfloat16 matrices apart in memory (one bucket, packed), a float16 and a float32 vector.
    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("a", wa, ga, {7, 43}), gradsync::parameter("b", wb, gb, {43, 7}),
                gradsync::parameter("c", wc, gc), gradsync::parameter("d", wd, gd)};
    }

    // ±[0.5, 2) with 8 significant bits, from the key.
    static float value(std::uint64_t key) {
        std::uint64_t z = key * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e5a5ull;
        z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
        z ^= z >> 29;
        const float mantissa = 1.0f + static_cast<float>(z & 127u) / 128.0f;
        const float magnitude = (z >> 7) & 1u ? mantissa : mantissa / 2;
        return (z >> 8) & 1u ? -magnitude : magnitude;
    }
    static float value(int rank, int step, int tensor, std::size_t i) {
        return value(static_cast<std::uint64_t>(rank) * 1000003u + static_cast<std::uint64_t>(step) * 7919u +
                     static_cast<std::uint64_t>(tensor) * 104729u + i);
    }

    // This rank's gradients of `step`, times `scale` (a power of two: the loss scale they carry).
    void fill(int rank, int step, float scale = 1.0f) {
        for (std::size_t i = 0; i < n; ++i) {
            ga[i] = gradsync::bfloat16(value(rank, step, 0, i) * scale);
            gb[i] = gradsync::bfloat16(value(rank, step, 1, i) * scale);
            gc[i] = gradsync::float16(value(rank, step, 2, i) * scale);
            gd[i] = value(rank, step, 3, i) * scale;
        }
    }

    // Of tensor `tensor`, the elements that are not the average over `world` ranks of fill(r,
    // step) rounded once to the dtype's `bits` significant bits: off by more than half a unit in
    // the last place (and float32's rounding of the division by the world size).
    template <class T>
    static std::size_t not_rounded_once(const std::vector<T>& got, int world, int step, int tensor, int bits) {
        std::size_t off = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
            double exact = 0;
            for (int r = 0; r < world; ++r) exact += value(r, step, tensor, i);
            exact /= world;
            const double g = static_cast<double>(static_cast<float>(got[i]));
            if (exact == 0) {
                off += g != 0;
                continue;
            }
            const double ulp = std::ldexp(1.0, std::ilogb(exact) - (bits - 1));
            off += std::fabs(g - exact) > ulp / 2 + std::fabs(exact) * 0x1p-21;
        }
        return off;
    }
    // Every tensor's elements that are not their average rounded once.
    std::size_t not_rounded_once(int world, int step) const {
        return not_rounded_once(ga, world, step, 0, 8) + not_rounded_once(gb, world, step, 1, 8) +
               not_rounded_once(gc, world, step, 2, 11) + not_rounded_once(gd, world, step, 3, 24);
    }
    // Of tensor `tensor`, the elements more than one unit in the last place of `bits` significant
    // bits from the average over `world` ranks of fill(r, step): a rounding of a float32 value
    // that is close to the average but not exact.
    template <class T>
    static std::size_t off_by_more_than_an_ulp(const std::vector<T>& got, int world, int step, int tensor, int bits) {
        std::size_t off = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
            double exact = 0;
            for (int r = 0; r < world; ++r) exact += value(r, step, tensor, i);
            exact /= world;
            const double g = static_cast<double>(static_cast<float>(got[i]));
            const double ulp = exact == 0 ? 0x1p-30 : std::ldexp(1.0, std::ilogb(exact) - (bits - 1));
            off += std::fabs(g - exact) > ulp;
        }
        return off;
    }
    // Of a float32 copy of tensor `tensor`, the elements that are not `factor` times the average
    // over `world` ranks of fill(r, step) (to float32's rounding).
    static std::size_t not_the_average(std::span<const float> got, int world, int step, int tensor,
                                       double factor = 1.0) {
        std::size_t off = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
            double exact = 0;
            for (int r = 0; r < world; ++r) exact += value(r, step, tensor, i);
            exact = exact / world * factor;
            off += std::fabs(static_cast<double>(got[i]) - exact) > std::fabs(exact) * 0x1p-20;
        }
        return off;
    }
    // The bfloat16 tensors' elements only.
    std::size_t bfloat16_not_rounded_once(int world, int step) const {
        return not_rounded_once(ga, world, step, 0, 8) + not_rounded_once(gb, world, step, 1, 8);
    }
};

}  // namespace testing_support
