// Gradient storage that moves between steps (a framework that frees gradients after the optimizer
// and allocates new ones in backward) is followed before every bucket's collective, with and
// without overlap; a model whose layout changes instead is an error naming the parameter. Under
// AddressSanitizer a read of the freed storage would fail these tests.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using gradsync::LocalBackend;

namespace {

// Three tensors whose gradients are freed after each step and allocated anew in backward.
struct Reallocating {
    std::vector<std::size_t> sizes;
    std::vector<std::string> names{"t0", "t1", "t2"};
    std::vector<std::vector<float>> w;
    std::vector<std::unique_ptr<float[]>> g;
    bool move = true;
    std::size_t grow = 0;  // extra elements for tensor 1 (a layout change)

    explicit Reallocating(std::vector<std::size_t> tensor_sizes = {300, 7, 1000}) : sizes(std::move(tensor_sizes)) {
        for (auto n : sizes) {
            w.emplace_back(n, 1.0f);
            g.emplace_back(new float[n]());
        }
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t k = 0; k < sizes.size(); ++k)
            out.push_back(gradsync::parameter(names[k], w[k].data(), g[k].get(), k == 1 ? sizes[k] + grow : sizes[k]));
        return out;
    }
    // Backward: new storage for each gradient (the old freed), filled with small integers.
    void backward(int rank, int step, std::size_t k) {
        if (move) g[k].reset(new float[sizes[k] + (k == 1 ? grow : 0)]);
        for (std::size_t i = 0; i < sizes[k]; ++i)
            g[k][i] = static_cast<float>((rank + 1) * (step + 1) + static_cast<int>((i + k) % 5));
    }
    void sgd() {
        for (std::size_t k = 0; k < sizes.size(); ++k)
            for (std::size_t i = 0; i < sizes[k]; ++i) w[k][i] -= 0.125f * g[k][i];
    }
};

template <class... Policies>
std::vector<std::vector<float>> train(int world, bool move, bool overlap, Policies... policies) {
    std::vector<std::vector<float>> weights(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        Reallocating m;
        m.move = move;
        gradsync::DataParallel dp(
            m, b, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{1200}, .first_cap = gradsync::Bytes{1200}},
            policies...);
        for (int s = 0; s < 5; ++s) {
            for (std::size_t k = m.sizes.size(); k-- > 0;) {  // backward: last tensor first
                m.backward(b.rank(), s, k);
                if (overlap) dp.grad_ready(k);
            }
            dp.synchronize();
            m.sgd();
        }
        std::vector<float> all;
        for (const auto& w : m.w) all.insert(all.end(), w.begin(), w.end());
        weights[static_cast<std::size_t>(b.rank())] = all;
    });
    return weights;
}

}  // namespace

TEST_CASE("moved storage: gradients allocated anew every step are followed, bitwise as fixed storage") {
    for (const bool overlap : {false, true}) {
        CAPTURE(overlap);
        const auto fixed = train(3, false, overlap);
        const auto moved = train(3, true, overlap);
        const auto packed = train(3, true, overlap, gradsync::PackedBuckets{});
        const auto in_place = train(3, true, overlap, gradsync::InPlaceBuckets{});
        const auto alone = train(1, true, overlap);
        for (int r = 0; r < 3; ++r) {
            CHECK(moved[static_cast<std::size_t>(r)] == fixed[0]);
            CHECK(packed[static_cast<std::size_t>(r)] == fixed[0]);
            CHECK(in_place[static_cast<std::size_t>(r)] == fixed[0]);
        }
        CHECK(fixed[0] != alone[0]);  // the average of three ranks is not one rank's gradient
    }
}

TEST_CASE("moved storage: a parameter that changes size, or a gradient that is gone, is an error naming it") {
    auto failures = [](auto change) {
        std::vector<std::string> out(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Reallocating m;
            gradsync::DataParallel dp(m, b);
            try {
                for (int s = 0; s < 2; ++s) {
                    for (std::size_t k = 0; k < 3; ++k) m.backward(b.rank(), s, k);
                    if (s == 1 && b.rank() == 1) change(m);
                    dp.synchronize();
                }
            } catch (const gradsync::Error& e) {
                out[static_cast<std::size_t>(b.rank())] = e.what();
            }
        });
        return out;
    };
    const auto grown = failures([](Reallocating& m) {
        m.grow = 2;
        m.g[1].reset(new float[9]());
    });
    CHECK(grown[1].find("gradsync: rank 1, step 2: parameter 't1' was 7 x float32 and is now 9 x float32") !=
          std::string::npos);
    CHECK(grown[0].find("rank 1") != std::string::npos);  // the peer learns of it, not a hang
    const auto gone = failures([](Reallocating& m) { m.g[2].reset(); });
    CHECK(gone[1].find("gradsync: rank 1, step 2: parameter 't2' has no gradient now") != std::string::npos);
    CHECK_FALSE(gone[0].empty());
}

TEST_CASE(
    "moved storage: a list read again with tensors renamed, reordered or replaced on one rank is refused on every "
    "rank") {
    for (const int change : {0, 1, 2}) {  // renamed; two tensors in each other's place; values replaced
        CAPTURE(change);
        std::vector<std::string> out(2);
        std::vector<std::uint64_t> steps(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Reallocating m;
            gradsync::DataParallel dp(m, b);
            try {
                for (int s = 0; s < 2; ++s) {
                    for (std::size_t k = 0; k < 3; ++k) m.backward(b.rank(), s, k);
                    if (s == 1 && b.rank() == 1) {
                        if (change == 0) m.names[1] = "t1.renamed";
                        if (change == 1) std::swap(m.names[0], m.names[2]);
                        if (change == 2) m.w[0] = std::vector<float>(m.sizes[0], 2.0f);  // new storage
                    }
                    dp.synchronize();
                }
            } catch (const gradsync::Error& e) {
                out[static_cast<std::size_t>(b.rank())] = e.what();
            }
            steps[static_cast<std::size_t>(b.rank())] = dp.steps();
        });
        const std::string said =
            change == 0   ? "parameter 1 was 't1' when the DataParallel was made and is listed as 't1.renamed' now"
            : change == 1 ? "parameter 2 was 't2' when the DataParallel was made and is listed as 't0' now"
                          : "the values of parameter 't0' lie in other memory now, and may differ from the other "
                            "ranks'";
        CHECK_MESSAGE(out[1].find("gradsync: rank 1, step 2: " + said) != std::string::npos, out[1]);
        CHECK(out[0].find("rank 1") != std::string::npos);  // the peer fails too, not averaging crosswise
        CHECK(steps[0] <= 1);                               // (rank 0 may learn of it while it ends step 1)
        CHECK(steps[1] == 1);
    }
}

TEST_CASE("moved storage: a parameter empty when wrapped that gets elements later is refused, not left unaveraged") {
    // A framework that makes some parameters at the first forward: wrapped before it, tensor 1
    // had no elements and would never be in a bucket.
    std::vector<std::string> out(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        Reallocating m({300, 0, 1000});
        gradsync::DataParallel dp(m, b);
        try {
            for (int s = 0; s < 3; ++s) {
                if (s == 1) {  // made now, on every rank
                    m.grow = 5;
                    m.w[1].assign(5, 1.0f);
                }
                for (std::size_t k = 0; k < 3; ++k) m.backward(b.rank(), s, k);
                dp.synchronize();
            }
        } catch (const gradsync::Error& e) {
            out[static_cast<std::size_t>(b.rank())] = e.what();
        }
        CHECK(dp.steps() <= 1);  // (a rank may learn of its peer's failure while it ends step 1)
    });
    for (const auto& e : out)
        CHECK_MESSAGE(e.find("step 2: parameter 't1' had no elements when the DataParallel was made and has 5 now "
                             "(made at the first forward?)") != std::string::npos,
                      e);
}

TEST_CASE("moved storage: one listing per plain step, one per bucket launched in backward, none when told") {
    struct Counting : Reallocating {
        int listings = 0;
        std::vector<gradsync::Parameter> parameters() {
            ++listings;
            return Reallocating::parameters();
        }
    };
    for (const int mode : {0, 1, 2}) {  // plain, overlapped, storage_may_move = false
        CAPTURE(mode);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Counting m;
            m.move = false;
            gradsync::DataParallel dp(
                m, b, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{1200}, .first_cap = gradsync::Bytes{1200}},
                gradsync::Options{.storage_may_move = mode != 2});
            const int buckets = static_cast<int>(dp.plan().buckets.size());
            REQUIRE(buckets == 3);
            const int at_start = m.listings;
            for (int s = 0; s < 4; ++s) {
                for (std::size_t k = 3; k-- > 0;) {
                    m.backward(b.rank(), s, k);
                    if (mode == 1) dp.grad_ready(k);
                }
                dp.synchronize();
            }
            CHECK(m.listings - at_start == (mode == 0 ? 4 : mode == 1 ? 4 * buckets : 0));
        });
    }
}

TEST_CASE("moved storage: in backward, a lister the model keeps for the step lists it for every bucket") {
    // Lists through what it kept for the step; counts how often each way is taken.
    struct Keeping : Reallocating {
        int listings = 0, kept = 0, relisted = 0;
        std::vector<gradsync::Parameter> parameters() {
            ++listings;
            return Reallocating::parameters();
        }
        struct Lister {
            Keeping* model;
            std::vector<gradsync::Parameter> parameters_now() {
                ++model->relisted;
                return model->Reallocating::parameters();
            }
        };
        Lister lister_for_step() {
            ++kept;
            return {this};
        }
    };
    constexpr int world = 3, steps = 5;
    const auto fixed = train(world, false, true);
    std::vector<std::vector<float>> weights(world);
    gradsync::spawn(world, [&](LocalBackend& b) {
        Keeping m;  // gradients allocated anew in every backward, after the step's lister was made
        gradsync::DataParallel dp(
            m, b, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{1200}, .first_cap = gradsync::Bytes{1200}},
            gradsync::Options{.autotune_buckets = false});  // three buckets in every step
        REQUIRE(dp.plan().buckets.size() == 3);
        const int at_start = m.listings;
        for (int s = 0; s < steps; ++s) {
            for (std::size_t k = m.sizes.size(); k-- > 0;) {
                m.backward(b.rank(), s, k);
                dp.grad_ready(k);
            }
            dp.synchronize();
            m.sgd();
        }
        CHECK(m.kept == steps);          // one lister per step
        CHECK(m.relisted == 3 * steps);  // asked for every bucket
        CHECK(m.listings == at_start);   // never the full listing
        std::vector<float> all;
        for (const auto& w : m.w) all.insert(all.end(), w.begin(), w.end());
        weights[static_cast<std::size_t>(b.rank())] = all;
    });
    for (int r = 0; r < world; ++r) CHECK(weights[static_cast<std::size_t>(r)] == fixed[0]);
}
