// What the ranks agree on at construction, beyond sizes and dtypes: the names and order of the
// tensors, and every setting that changes what is summed or how it is applied. A difference,
// or a setting that cannot work, is refused on every rank alike, naming the ranks and the setting.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/toy_model.hpp"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::Toy;

namespace {

// What each rank's construction threw (empty: nothing).
template <class Fn>
std::vector<std::string> construct(int world, Fn fn) {
    std::vector<std::string> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        try {
            fn(b);
        } catch (const gradsync::ConfigurationError& e) {
            out[static_cast<std::size_t>(b.rank())] = std::string("configuration: ") + e.what();
        } catch (const gradsync::LayoutMismatch& e) {
            out[static_cast<std::size_t>(b.rank())] = std::string("layout: ") + e.what();
        }
    });
    return out;
}

// Two tensors of one size, named "a" and "b", listed in the order given.
struct TwoOfOneSize {
    std::vector<float> wa = std::vector<float>(10), ga = std::vector<float>(10);
    std::vector<float> wb = std::vector<float>(10), gb = std::vector<float>(10);
    bool swapped = false;
    std::vector<gradsync::Parameter> parameters() {
        auto a = gradsync::parameter("a", wa, ga), b = gradsync::parameter("b", wb, gb);
        if (swapped) return {b, a};
        return {a, b};
    }
};

void all_alike(const std::vector<std::string>& messages, const std::string& expected) {
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m == messages[0]);
        CHECK(m.find(expected) != std::string::npos);
    }
}

}  // namespace

TEST_CASE("agreement: two tensors of one size in another order are refused, naming both ranks and names") {
    const auto got = construct(3, [](LocalBackend& b) {
        TwoOfOneSize m;
        m.swapped = b.rank() == 2;
        DataParallel dp(m, b);
    });
    all_alike(got,
              "layout: gradsync: the model's layout differs across ranks: rank 0 has parameter #0 'a' (10 x "
              "float32) where rank 2 has parameter #0 'b' (10 x float32)");
}

TEST_CASE("agreement: a policy or an Option that changes the sums, different on one rank, is refused by name") {
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            if (b.rank() == 0) {
                                DataParallel dp(m, b, gradsync::StaticLossScale{.value = 1024});
                            } else {
                                DataParallel dp(m, b);
                            }
                        }),
              "configuration: gradsync: the ranks' settings differ: loss scaler is 'static 1024' on rank 0 "
              "but 'none' on rank 1. Every rank must construct its DataParallel or ShardedDataParallel with the "
              "same policies and the same options");
    all_alike(construct(3,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(m, b, gradsync::Options{.clip_norm = b.rank() == 2 ? 1.0 : 5.0});
                        }),
              "Options::clip_norm is '5' on rank 0 but '1' on rank 2");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            if (b.rank() == 0) {
                                DataParallel dp(m, b, gradsync::Bf16Compression{});
                            } else {
                                DataParallel dp(m, b);
                            }
                        }),
              "compression is 'bfloat16 on the wire' on rank 0 but 'float32 on the wire' on rank 1");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(
                                m, b, gradsync::LinearLr{.base_lr = 0.1, .micro_batch = b.rank() == 0 ? 8u : 16u});
                        }),
              "LR rule is 'linear, base 0.1, micro batch 8,");
    // Numbers are agreed exactly: settings that differ only past the sixth decimal place differ.
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(m, b, gradsync::Options{.clip_norm = b.rank() == 0 ? 1e-7 : 2e-7},
                                            gradsync::LinearLr{.base_lr = 3e-4, .micro_batch = 8});
                        }),
              "Options::clip_norm is '1e-07' on rank 0 but '2e-07' on rank 1");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(m, b, gradsync::LinearLr{.base_lr = b.rank() == 0 ? 3e-4 : 3.0000001e-4});
                        }),
              "LR rule is 'linear, base 3e-04, micro batch 1, reference batch 0, accumulation 1, warm-up 0' on "
              "rank 0 but 'linear, base 0.00030000001,");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(
                                m, b, gradsync::DynamicLossScale{.init_scale = b.rank() == 0 ? 65536.0f : 65536.01f});
                        }),
              "loss scaler is 'dynamic, init 65536, x2 every");
    // Settings that do not change the sums may differ: the timeout, the timeline.
    const auto fine = construct(2, [](LocalBackend& b) {
        Toy m({100, 20}, 0.0f);
        DataParallel dp(m, b, gradsync::Options{.timeout = std::chrono::seconds(b.rank() == 0 ? 30 : 60)});
    });
    CHECK(fine == std::vector<std::string>(2));
}

TEST_CASE("agreement: a setting that cannot work is refused at construction, on every rank, naming the rank") {
    all_alike(construct(3,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(
                                m, b,
                                gradsync::Options{.timeout = std::chrono::milliseconds(b.rank() == 1 ? 0 : 1000)});
                        }),
              "configuration: gradsync: invalid configuration on rank 1: Options::timeout is 0 ms; it must be above 0");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(m, b, gradsync::DynamicLossScale{.backoff_factor = 2.0f});
                        }),
              "invalid configuration on rank 0: DynamicLossScale needs 0 < min_scale <= max_scale");
    all_alike(construct(2,
                        [](LocalBackend& b) {
                            Toy m({100, 20}, 0.0f);
                            DataParallel dp(m, b, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{0}});
                        }),
              "invalid configuration on rank 0: SizeCappedBuckets needs a cap and a first_cap above 0 bytes");
    gradsync::spawn(1, [](LocalBackend& b) {
        Toy m({10}, 0.0f);
        CHECK_THROWS_WITH_AS(DataParallel(m, b, gradsync::Options{.clip_norm = -1.0}),
                             doctest::Contains("invalid configuration on rank 0: Options::clip_norm is -1;"),
                             gradsync::ConfigurationError);
        CHECK_THROWS_WITH_AS(DataParallel(m, b, gradsync::LinearLr{.base_lr = 0.1, .micro_batch = 0}),
                             doctest::Contains("an LR rule needs"), gradsync::ConfigurationError);
    });
}

TEST_CASE("RankTable: every rank's 64-bit numbers reach every rank exactly, whatever their bits") {
    std::vector<int> wrong(4, -1);
    gradsync::spawn(4, [&](LocalBackend& b) {
        const auto value = [](int rank, std::size_t column) -> std::uint64_t {
            if (column == 0) return ~std::uint64_t{0} - std::uint64_t(rank);  // all bits set
            if (column == 1) return (std::uint64_t{1} << 63) | std::uint64_t(rank);
            return std::uint64_t(rank) * 0x9e3779b97f4a7c15u;  // bits everywhere
        };
        gradsync::detail::RankTable table(b.size(), b.rank(), 3);
        for (std::size_t c = 0; c < 3; ++c) table.set(c, value(b.rank(), c));
        table.gather(b);
        int mismatches = 0;
        for (int r = 0; r < b.size(); ++r)
            for (std::size_t c = 0; c < 3; ++c) mismatches += table.at(r, c) != value(r, c);
        mismatches += table.same_as_rank0(1, 0) || !table.same_as_rank0(0, 2);
        wrong[static_cast<std::size_t>(b.rank())] = mismatches;
    });
    CHECK(wrong == std::vector<int>(4, 0));
}
