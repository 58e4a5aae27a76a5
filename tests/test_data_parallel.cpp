// DataParallel on LocalBackend: construction (broadcast, layout agreement, input checks) and
// synchronize() (averaging, bucket order, packing), with errors raised on every rank alike.
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/recording_backend.hpp"
#include "support/toy_model.hpp"

#include <unistd.h>  // for getpid

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

using namespace gradsync::literals;
using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::expected_average;
using testing_support::RecordingBackend;
using testing_support::Toy;

namespace {

// Runs `fn` on each of `world` ranks and returns what each rank's exception said ("" if none).
template <class Fn>
std::vector<std::string> messages_of(int world, Fn fn) {
    std::vector<std::string> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        try {
            fn(b);
        } catch (const gradsync::Error& e) {
            out[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    return out;
}

void check_same_on_every_rank(const std::vector<std::string>& messages, const std::string& needle) {
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m == messages[0]);
        CHECK(m.find(needle) != std::string::npos);
    }
}

template <class... Policies>
void check_average(int world, Policies... policies) {
    const std::vector<std::size_t> sizes{5, 3000, 1, 40000, 17, 0, 256};
    std::vector<std::vector<float>> results(static_cast<std::size_t>(world));
    std::atomic<int> wrong{0};
    gradsync::spawn(world, [&](LocalBackend& b) {
        Toy model(sizes, float(b.rank()), 2);
        DataParallel dp(model, b, policies...);
        model.fill_grads(b.rank());
        dp.synchronize();
        std::vector<float> flat;
        for (std::size_t k = 0; k < model.tensors.size(); ++k)
            for (std::size_t i = 0; i < model.tensors[k].g.size(); ++i) {
                if (model.tensors[k].g[i] != expected_average<float>(world, k, i)) ++wrong;
                flat.push_back(model.tensors[k].g[i]);
            }
        for (std::size_t k = 0; k < model.doubles.size(); ++k)
            for (std::size_t i = 0; i < model.doubles[k].g.size(); ++i)
                if (model.doubles[k].g[i] != expected_average<double>(world, k, i)) ++wrong;
        results[static_cast<std::size_t>(b.rank())] = flat;
    });
    CHECK(wrong.load() == 0);
    for (const auto& r : results) CHECK(std::memcmp(r.data(), results[0].data(), r.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("synchronize leaves every rank with the average gradient, for every bucketer and packing") {
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        check_average(world);
        check_average(world, gradsync::SingleBucket{});
        check_average(world, gradsync::PerParameterBuckets{});
        check_average(world, gradsync::SizeCappedBuckets{16_KiB, 1_KiB});
        check_average(world, gradsync::PackedBuckets{});
        check_average(world, gradsync::SizeCappedBuckets{16_KiB, 1_KiB}, gradsync::PackedBuckets{});
        check_average(world, gradsync::InPlaceBuckets{}, gradsync::PerParameterBuckets{});
    }
}

TEST_CASE("construction copies rank 0's parameters to every rank") {
    std::atomic<int> wrong{0};
    gradsync::spawn(3, [&](LocalBackend& b) {
        Toy model({10, 20000, 3}, float(b.rank() + 1), 1);
        DataParallel dp(model, b);
        for (const auto& t : model.tensors)
            for (float x : t.w) wrong += x != 1.0f;
        for (const auto& t : model.doubles)
            for (double x : t.w) wrong += x != 1.0;
    });
    CHECK(wrong.load() == 0);
}

TEST_CASE("world size 1 communicates nothing") {
    auto ranks = LocalBackend::create_group(1);
    RecordingBackend rec(ranks[0]);
    Toy model({100, 200}, 1.0f);
    DataParallel dp(model, rec);
    model.fill_grads(0);
    dp.synchronize();
    dp.synchronize();
    CHECK(rec.log.empty());
    CHECK(dp.steps() == 2);
    CHECK(model.tensors[1].g[3] == Toy::grad_value(0, 1, 3));
    CHECK(dp.extra_memory() < 1_KiB);  // no bucket buffers for one rank
}

TEST_CASE("buckets are launched in plan order with the planned sizes") {
    // Five tensors of 4000 bytes. Caps: first 4 KiB, then 10 KiB. Reverse order t4..t0 gives
    // {t4} (a second tensor would pass 4 KiB), {t3, t2} (a third would pass 10 KiB), {t1, t0}.
    std::vector<std::vector<testing_support::Collective>> logs(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        RecordingBackend rec(b);
        Toy model({1000, 1000, 1000, 1000, 1000}, 0.0f);
        DataParallel dp(model, rec, gradsync::SizeCappedBuckets{10_KiB, 4_KiB});
        REQUIRE(dp.plan().buckets.size() == 3);
        rec.log.clear();
        for (std::size_t k = 0; k < 5; ++k) std::fill(model.tensors[k].g.begin(), model.tensors[k].g.end(), float(k));
        dp.synchronize();
        logs[static_cast<std::size_t>(b.rank())] = rec.log;
    });
    // Within a bucket the elements are laid out by parameter index, the same on every rank.
    for (const auto& log : logs) {
        REQUIRE(log.size() == 4);
        CHECK(log[0].count == 1000);
        CHECK(log[0].first == 4.0);  // {t4}
        CHECK(log[1].count == 2000);
        CHECK(log[1].first == 2.0);  // {t3, t2}
        CHECK(log[2].count == 2000);
        CHECK(log[2].first == 0.0);  // {t1, t0}
        // A backend that cannot check tags gets the ranks' collective histories compared once a step.
        // Per rank: fingerprint, count, whether a step number was given, its value; 2 halves each.
        CHECK(log[3].count == 2 * 4 * 2);
        CHECK(log[3].dtype == gradsync::DType::float64);
    }
}

TEST_CASE("Options::check_histories = false: no per-step history comparison, only the buckets") {
    std::vector<std::size_t> collectives(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        RecordingBackend rec(b);
        Toy model({1000, 1000, 1000, 1000, 1000}, 0.0f);
        DataParallel dp(model, rec, gradsync::SizeCappedBuckets{10_KiB, 4_KiB},
                        gradsync::Options{.check_histories = false});
        rec.log.clear();
        dp.synchronize();
        dp.synchronize();
        collectives[static_cast<std::size_t>(b.rank())] = rec.log.size();
        for (const auto& c : rec.log) CHECK(c.dtype == gradsync::DType::float32);
    });
    CHECK(collectives == std::vector<std::size_t>{6, 6});  // 3 buckets, twice
}

TEST_CASE("zero-sized parameters are skipped, not an error") {
    struct WithEmpty {
        std::vector<float> w = std::vector<float>(4, 1.0f), g = std::vector<float>(4, 2.0f);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::Parameter{"empty", nullptr, nullptr, 0, gradsync::DType::float32},
                    gradsync::parameter("w", w, g)};
        }
    };
    gradsync::spawn(2, [&](LocalBackend& b) {
        WithEmpty m;
        DataParallel dp(m, b);
        REQUIRE(dp.parameters().size() == 1);
        CHECK(dp.parameters()[0].name == "w");
        dp.synchronize();
        CHECK(m.g[0] == 2.0f);
    });
}

TEST_CASE("a model whose parameters are all empty (made lazily, at the first forward) is refused on every rank") {
    struct Lazy {
        bool made = false;  // on one rank only: the other ranks' refusal must come from agreement
        std::vector<float> w = std::vector<float>(4, 1.0f), g = std::vector<float>(4, 2.0f);
        std::vector<gradsync::Parameter> parameters() {
            if (made) return {gradsync::parameter("fc.weight", w, g)};
            return {gradsync::Parameter{"fc.weight", nullptr, nullptr, 0, gradsync::DType::float32}};
        }
    };
    std::vector<std::string> errors(2), sharded(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        Lazy m;
        m.made = b.rank() == 1;
        try {
            DataParallel dp(m, b);
        } catch (const gradsync::Error& e) {
            errors[r] = e.what();
        }
        try {
            gradsync::ShardedDataParallel dp(m, b);
        } catch (const gradsync::Error& e) {
            sharded[r] = e.what();
        }
    });
    for (const auto& e : {errors[0], errors[1], sharded[0], sharded[1]}) {
        CAPTURE(e);
        CHECK(e.find("rank 0") != std::string::npos);
        CHECK(e.find("the model lists no parameter with elements (1 listed, all empty)") != std::string::npos);
        CHECK(e.find("must run one forward before the model is wrapped") != std::string::npos);
    }
}

TEST_CASE("memory held: bucket buffers only when packing") {
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy model({1000, 50000}, 0.0f);
        DataParallel in_place(model, b);
        CHECK(in_place.gradient_bytes() == gradsync::Bytes{51000 * 4});
        CHECK(in_place.extra_memory() < 1_KiB);
        DataParallel packed(model, b, gradsync::PackedBuckets{});
        CHECK(packed.extra_memory() >= gradsync::Bytes{51000 * 4});
        CHECK(packed.extra_memory() < gradsync::Bytes{51000 * 4} + 1_KiB);
    });
}

TEST_CASE("a null gradient pointer, where gradients cannot come later, is an error on every rank") {
    struct NullGrad {
        std::vector<float> w = std::vector<float>(4);
        bool broken = false;
        std::vector<gradsync::Parameter> parameters() {
            return {
                gradsync::Parameter{"fc.weight", w.data(), broken ? nullptr : w.data(), 4, gradsync::DType::float32}};
        }
    };
    auto messages = messages_of(3, [](LocalBackend& b) {
        NullGrad m;
        m.broken = b.rank() == 1;
        DataParallel dp(m, b, gradsync::Options{.storage_may_move = false});
    });
    check_same_on_every_rank(messages,
                             "gradsync: invalid model on rank 1: parameter 'fc.weight' has a null gradient pointer "
                             "(with device memory, or Options::storage_may_move off, every gradient must exist");

    // One rank alone throws without any collective.
    auto ranks = LocalBackend::create_group(1);
    NullGrad m;
    m.broken = true;
    CHECK_THROWS_WITH_AS(DataParallel(m, ranks[0], gradsync::Options{.storage_may_move = false}),
                         doctest::Contains("has a null gradient pointer"), gradsync::InvalidModel);
}

TEST_CASE("an unsupported dtype is an error on every rank") {
    struct Half {
        std::int32_t w[8]{}, g[8]{};
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::Parameter{"emb", w, g, 8, gradsync::DType::int32}};
        }
    };
    auto messages = messages_of(2, [](LocalBackend& b) {
        Half m;
        DataParallel dp(m, b);
    });
    check_same_on_every_rank(messages,
                             "invalid model on rank 0: parameter 'emb' is int32, which this backend cannot reduce");

    struct Bogus {
        float w[2]{}, g[2]{};
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::Parameter{"x", w, g, 2, static_cast<gradsync::DType>(77)}};
        }
    };
    auto ranks = LocalBackend::create_group(1);
    Bogus bogus;
    CHECK_THROWS_WITH_AS(DataParallel(bogus, ranks[0]),
                         doctest::Contains("parameter 'x' has an unknown dtype (code 77)"), gradsync::InvalidModel);
}

TEST_CASE("two parameters sharing one gradient buffer is an error") {
    struct Shared {
        std::vector<float> a = std::vector<float>(8), b = std::vector<float>(8), g = std::vector<float>(8);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("enc.weight", a.data(), g.data(), 8),
                    gradsync::parameter("dec.weight", b.data(), g.data() + 4, 4)};
        }
    };
    auto messages = messages_of(2, [](LocalBackend& b) {
        Shared m;
        DataParallel dp(m, b);
    });
    check_same_on_every_rank(messages, "parameters 'enc.weight' and 'dec.weight' share gradient memory");
}

TEST_CASE("a layout that differs across ranks names the first differing parameter on every rank") {
    SUBCASE("a size") {
        auto messages = messages_of(3, [](LocalBackend& b) {
            Toy m({10, b.rank() == 2 ? std::size_t{21} : std::size_t{20}, 30}, 0.0f);
            DataParallel dp(m, b);
        });
        check_same_on_every_rank(messages,
                                 "rank 0 has parameter #1 't1' (20 x float32) where rank 2 has parameter #1 't1' (21 x "
                                 "float32)");
    }
    SUBCASE("a dtype") {
        auto messages = messages_of(2, [](LocalBackend& b) {
            Toy m({10}, 0.0f, 0);
            if (b.rank() == 1) m.tensors.clear();
            m.doubles.push_back({"x", std::vector<double>(10), std::vector<double>(10)});
            DataParallel dp(m, b);
        });
        check_same_on_every_rank(
            messages, "rank 0 has parameter #0 't0' (10 x float32) where rank 1 has parameter #0 'x' (10 x float64)");
    }
    SUBCASE("the number of parameters") {
        auto messages = messages_of(2, [](LocalBackend& b) {
            Toy m(b.rank() == 0 ? std::vector<std::size_t>{10, 20} : std::vector<std::size_t>{10, 20, 30}, 0.0f);
            DataParallel dp(m, b);
        });
        check_same_on_every_rank(
            messages, "rank 0 has 2 tensors and rank 1 has 3; parameter #2 't2' (30 x float32) exists only on rank 1");
    }
    SUBCASE("the bucketer") {
        auto messages = messages_of(2, [](LocalBackend& b) {
            Toy m({1000, 1000, 1000}, 0.0f);
            DataParallel dp(m, b, gradsync::SizeCappedBuckets{b.rank() == 0 ? 4_KiB : 8_KiB, 1_KiB});
        });
        check_same_on_every_rank(
            messages,
            "the ranks' settings differ: bucketer is 'size-capped, cap 4 KiB, first cap 1 KiB, growing "
            "along backward' on rank 0 but 'size-capped, cap 8 KiB, first cap 1 KiB, growing along "
            "backward' on rank 1");
    }
    SUBCASE("the plans of a bucketer whose settings do not say how it plans") {
        struct ByRank {
            using policy_category = gradsync::policy_category::bucketer;
            int rank = 0;
            std::string settings() const { return "by rank"; }
            gradsync::BucketPlan plan(std::span<const gradsync::Parameter> params,
                                      std::span<const std::size_t> order) const {
                if (rank == 0) return gradsync::SingleBucket{}.plan(params, order);
                return gradsync::PerParameterBuckets{}.plan(params, order);
            }
        };
        auto messages = messages_of(2, [](LocalBackend& b) {
            Toy m({1000, 1000, 1000}, 0.0f);
            DataParallel dp(m, b, ByRank{b.rank()});
        });
        check_same_on_every_rank(messages, "the bucket plans of rank 0 and rank 1 differ");
    }
}

TEST_CASE("DataParallel deduces its policies and defaults the rest") {
    using Default = DataParallel<Toy, LocalBackend>;
    static_assert(std::is_same_v<Default::bucketer_type, gradsync::SizeCappedBuckets>);
    static_assert(std::is_same_v<Default::memory_type, gradsync::HostMemory>);
    static_assert(Default::reduces_in_place);
    using Packed = DataParallel<Toy, LocalBackend, gradsync::PackedBuckets, gradsync::SingleBucket>;
    static_assert(std::is_same_v<Packed::bucketer_type, gradsync::SingleBucket>);
    static_assert(!Packed::reduces_in_place);
    static_assert(!DataParallel<Toy, RecordingBackend>::reduces_in_place);

    auto ranks = LocalBackend::create_group(1);
    Toy m({4}, 0.0f);
    Packed explicit_policies(m, ranks[0]);  // policies given as types only
    CHECK(explicit_policies.plan().buckets.size() == 1);
}

TEST_CASE("logging: GRADSYNC_LOG_FILE gives each rank a file of its own, lines rank-prefixed") {
    namespace fs = std::filesystem;
    const auto dir = fs::temp_directory_path() / ("gradsync_logs_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    auto& settings = gradsync::detail::log_settings();
    const auto saved = settings;
    settings = {gradsync::detail::LogLevel::info, (dir / "rank%r.log").string()};
    gradsync::spawn(2, [](gradsync::LocalBackend& b) {
        std::vector<float> w(8), g(8);
        struct Model {
            std::vector<float>*w, *g;
            std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", *w, *g)}; }
        } m{&w, &g};
        gradsync::DataParallel dp(m, b);
    });
    settings = saved;
    gradsync::detail::log_files().close();
    for (int r = 0; r < 2; ++r) {
        std::ifstream in(dir / ("rank" + std::to_string(r) + ".log"));
        const std::string prefix = "[gradsync rank " + std::to_string(r) + "] ";
        std::string line;
        REQUIRE(std::getline(in, line));
        CHECK(line.starts_with(prefix + "DataParallel: 1 parameters"));
        while (std::getline(in, line)) CHECK(line.starts_with(prefix));  // only this rank's lines
    }
    CHECK(gradsync::detail::log_file_of("run.log", 3) == "run.log.3");
    fs::remove_all(dir);
}
