// No silent hangs: every failure mode, driven by a fault-injecting wrapper around LocalBackend,
// ends in an exception on every rank within a short deadline, and the message names the culprit.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/faulty_backend.hpp"
#include "support/toy_model.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::Fault;
using testing_support::Toy;
using Faulty = testing_support::FaultyBackend<LocalBackend>;

namespace {

struct Outcome {
    std::string kind;  // "ok", "timeout", "injected", "collective", "readiness", "error"
    std::string message;
};

constexpr auto deadline = 500ms;  // every DataParallel wait in these tests

// One overlapped step on `world` ranks of a 4-bucket model (bucket b holds parameter 3 - b), with
// `fault` planned on rank `culprit` at bucket `bucket`'s collective. `backward` may replace the
// rank's grad_ready calls. Returns what each rank ended with, and checks nobody hung.
template <class Backward>
std::vector<Outcome> one_step(int world, int culprit, std::optional<Fault> fault, int bucket, Backward backward) {
    std::vector<Outcome> out(static_cast<std::size_t>(world));
    gradsync::LocalGroupOptions group;
    group.timeout = 5s;  // the DataParallel deadline comes first
    const auto start = std::chrono::steady_clock::now();
    gradsync::spawn(
        world,
        [&](LocalBackend& local) {
            Faulty b(local);
            auto& o = out[static_cast<std::size_t>(b.rank())];
            try {
                Toy m({100, 200, 300, 400}, 0.0f);
                DataParallel dp(m, b, gradsync::PerParameterBuckets{}, gradsync::Options{.timeout = deadline});
                if (fault && b.rank() == culprit) {
                    auto f = *fault;
                    f.at_call = b.calls_made() + 1 + static_cast<std::uint64_t>(bucket);
                    b.inject(f);
                }
                m.fill_grads(b.rank());
                backward(b, dp);
                dp.synchronize();
                o.kind = "ok";
                o.message = std::to_string(m.tensors[1].g[0]) + (std::isnan(m.tensors[1].g[0]) ? " nan" : "");
            } catch (const gradsync::TimeoutError& e) {
                o = {"timeout", e.what()};
            } catch (const testing_support::InjectedFault& e) {
                o = {"injected", e.what()};
            } catch (const gradsync::CollectiveError& e) {
                o = {"collective", e.what()};
            } catch (const gradsync::ReadinessError& e) {
                o = {"readiness", e.what()};
            }
        },
        group);
    CHECK(std::chrono::steady_clock::now() - start < 4s);  // far below the backend's 5 s
    return out;
}

void all_ready(Faulty&, DataParallel<Toy, Faulty, gradsync::PerParameterBuckets, gradsync::Options>& dp) {
    for (std::size_t i = 4; i-- > 0;) dp.grad_ready(i);
}

bool has(const Outcome& o, const std::string& needle) { return o.message.find(needle) != std::string::npos; }

}  // namespace

TEST_CASE("a rank whose collective throws fails every rank, and they name it") {
    Fault f{.kind = Fault::Kind::throw_error};
    auto out = one_step(3, 1, f, 1, all_ready);
    CHECK(out[1].kind == "injected");
    for (const auto& o : out) {
        CAPTURE(o.message);
        CHECK(has(o, "injected fault: rank 1 throws at allreduce"));
        CHECK(has(o, "step 1, bucket 1)"));
    }
    CHECK(out[0].kind == "collective");
    CHECK(out[2].kind == "collective");
}

TEST_CASE("a rank that vanishes in a collective: every rank's error names it as the one behind") {
    Fault f{.kind = Fault::Kind::vanish};
    auto out = one_step(3, 1, f, 1, all_ready);
    bool timed_out = false;
    for (const auto& o : out) {
        CAPTURE(o.message);
        timed_out = timed_out || o.kind == "timeout";
        if (&o == &out[1] && has(o, "injected fault: rank 1 allreduce #7")) continue;  // its own story
        CHECK(has(o, "step 1: bucket 1 of 4 (1.2 KiB, 1 parameters: 't2') was not reduced within 500 ms"));
        CHECK(has(o, "Behind the furthest rank (8): rank 1 has entered 7 collectives;"));
    }
    CHECK(timed_out);  // whichever rank's deadline came first
}

TEST_CASE("a rank stuck in backward: peers name the parameters it has not produced") {
    auto stuck = [](Faulty& b, auto& dp) {
        dp.grad_ready(std::size_t{3});
        dp.grad_ready(std::size_t{2});
        if (b.rank() == 2) std::this_thread::sleep_for(1500ms);  // longer than the peers' deadline
        dp.grad_ready(std::size_t{1});
        dp.grad_ready(std::size_t{0});
    };
    auto out = one_step(3, -1, std::nullopt, 0, stuck);
    for (int r : {0, 1}) {
        const auto& o = out[static_cast<std::size_t>(r)];
        CAPTURE(o.message);
        CHECK(has(o, "step 1: bucket 2 of 4 (800 B, 1 parameters: 't1') was not reduced within 500 ms"));
        CHECK(has(o, "Behind the furthest rank (9): rank 2 has entered 8 collectives;"));
        CHECK(has(o,
                  "rank 2: in the backward of step 1, 2 of 4 buckets launched; bucket 2 waits for grad_ready of "
                  "'t1' (1 of 1 parameters)"));
    }
    CHECK(out[2].kind == "collective");
}

TEST_CASE("a rank that reorders its collectives is caught at the first one out of place") {
    Fault f{.kind = Fault::Kind::swap_with_next};
    auto out = one_step(2, 1, f, 1, all_ready);
    for (const auto& o : out) {
        CAPTURE(o.message);
        CHECK(o.kind == "collective");
        CHECK(has(o, "collective mismatch: rank 0 is in allreduce #"));
        CHECK(has(o, " of 300 x float32 (1.2 KiB), average (step 1, bucket 1) but rank 1 is in allreduce #"));
        CHECK(has(o, " of 200 x float32 (800 B), average (step 1, bucket 2)"));
    }
}

TEST_CASE("two DataParallel objects of one layout on one backend never average each other's gradients") {
    // Rank 1 steps them in the other order: each collective meets the other wrapper's, alike in
    // every size, and is refused on every rank instead of averaging across the wrappers.
    std::vector<std::string> errors(2);
    std::vector<int> wrong(2, 0);
    gradsync::spawn(2, [&](LocalBackend& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        Toy first({100, 200}, 0.0f), second({100, 200}, 0.0f);
        DataParallel a(first, b), c(second, b);
        first.fill_grads(b.rank());
        second.fill_grads(b.rank());
        a.synchronize();  // in the same order: each averages its own
        c.synchronize();
        for (std::size_t k = 0; k < 2; ++k)
            if (first.tensors[k].g[5] != testing_support::expected_average<float>(2, k, 5) ||
                second.tensors[k].g[5] != testing_support::expected_average<float>(2, k, 5))
                ++wrong[r];
        try {
            if (b.rank() == 0) {
                a.synchronize();
                c.synchronize();
            } else {
                c.synchronize();
                a.synchronize();
            }
        } catch (const gradsync::CollectiveError& e) {
            errors[r] = e.what();
        }
    });
    CHECK(wrong == std::vector<int>{0, 0});
    for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.find("collective mismatch: rank 0 is in allreduce #") != std::string::npos);
        CHECK(e.find("of another history (another DataParallel on this backend") != std::string::npos);
    }
}

TEST_CASE(
    "which deadline applies: synchronize() without grad_ready ends by the earlier of Options' and the backend's") {
    // A rank that never synchronizes, under two deadlines: the other ends at the earlier one, in
    // the words of whichever it was (Options::timeout: DataParallel's diagnosis). LocalBackend
    // says its deadline, so the collectives run on the calling thread only where it comes first.
    static_assert(gradsync::TimedCollectives<LocalBackend>);
    struct Case {
        std::chrono::milliseconds options, group;
        std::string says;
    };
    for (const auto& c : {Case{300ms, 60s, "300 ms"}, Case{60s, 300ms, "timed out after 300 ms waiting for rank 1"}}) {
        CAPTURE(c.says);
        gradsync::LocalGroupOptions group;
        group.timeout = c.group;
        std::string what;
        std::chrono::steady_clock::duration took{};
        gradsync::spawn(
            2,
            [&](LocalBackend& b) {
                Toy m({100, 200}, 0.0f);
                DataParallel dp(m, b, gradsync::Options{.timeout = c.options});
                if (b.rank() == 1) {
                    std::this_thread::sleep_for(1500ms);  // never synchronizes; leaves after its peer gave up
                    return;
                }
                const auto start = std::chrono::steady_clock::now();
                try {
                    dp.synchronize();
                } catch (const gradsync::TimeoutError& e) {
                    what = e.what();
                }
                took = std::chrono::steady_clock::now() - start;
            },
            group);
        CHECK(what.find(c.says) != std::string::npos);
        CHECK(what.find("rank 1") != std::string::npos);
        CHECK(took >= 250ms);
        CHECK(took < 1200ms);  // long before the other deadline, and before rank 1 leaves
    }
}

TEST_CASE("a huge timeout means wait forever: steps with overlap, a slow rank and a plain synchronize() work") {
    // now + milliseconds::max() overflows; a deadline in the past would time out every wait at once.
    gradsync::LocalGroupOptions group;
    group.timeout = std::chrono::milliseconds::max();
    std::vector<int> wrong(3, 0);
    gradsync::spawn(
        3,
        [&](LocalBackend& b) {
            Toy m({100, 200, 300}, 0.0f);
            DataParallel dp(m, b, gradsync::PerParameterBuckets{},
                            gradsync::Options{.timeout = std::chrono::milliseconds::max()});
            for (int s = 0; s < 3; ++s) {
                m.fill_grads(b.rank());
                if (b.rank() == 2) std::this_thread::sleep_for(50ms);  // the others wait for it
                if (s != 1)
                    for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
                dp.synchronize();
                for (std::size_t k = 0; k < 3; ++k)
                    if (m.tensors[k].g[7] != testing_support::expected_average<float>(3, k, 7))
                        ++wrong[static_cast<std::size_t>(b.rank())];
            }
        },
        group);
    CHECK(wrong == std::vector<int>{0, 0, 0});
}

TEST_CASE("a slow rank within the deadline is no failure") {
    Fault f{.kind = Fault::Kind::delay, .delay = 150ms};
    auto out = one_step(3, 2, f, 1, all_ready);
    for (const auto& o : out) {
        CAPTURE(o.message);
        CHECK(o.kind == "ok");
        CHECK(o.message == std::to_string(testing_support::expected_average<float>(3, 1, 0)));
    }
}

TEST_CASE("a NaN planted in one rank's gradient reaches every rank alike") {
    Fault f{.kind = Fault::Kind::plant_nan};
    auto out = one_step(3, 1, f, 2, all_ready);  // bucket 2 holds t1
    for (const auto& o : out) {
        CHECK(o.kind == "ok");
        CHECK(has(o, " nan"));
    }
}

TEST_CASE("an exception in one rank's backward releases the others at once") {
    std::vector<std::string> messages(3);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(gradsync::spawn(3,
                                         [&](LocalBackend& b) {
                                             Toy m({100, 200, 300, 400}, 0.0f);
                                             DataParallel dp(m, b, gradsync::PerParameterBuckets{});
                                             dp.grad_ready(std::size_t{3});
                                             if (b.rank() == 1) throw std::runtime_error("loss is NaN on rank 1");
                                             try {
                                                 for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
                                                 dp.synchronize();
                                             } catch (const gradsync::CollectiveError& e) {
                                                 messages[static_cast<std::size_t>(b.rank())] = e.what();
                                             }
                                         }),
                         "loss is NaN on rank 1", std::runtime_error);
    CHECK(std::chrono::steady_clock::now() - start < 5s);  // the default deadlines are 600 s
    for (int r : {0, 2}) {
        CAPTURE(messages[static_cast<std::size_t>(r)]);
        CHECK(messages[static_cast<std::size_t>(r)].find("rank 1 destroyed its DataParallel in step 1 with collectives "
                                                         "in flight") != std::string::npos);
    }
}

TEST_CASE("the timeline is a Chrome trace with every bucket's ready, launched and allreduce events") {
    const std::string path = "gradsync_test_timeline.json";
    std::remove(path.c_str());
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({100, 200, 300}, 0.0f);
        DataParallel dp(m, b, gradsync::PerParameterBuckets{}, gradsync::Options{.timeline = path});
        for (int step = 0; step < 2; ++step) {
            m.fill_grads(b.rank());
            for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
            dp.synchronize();
        }
    });
    std::ifstream in(path);
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    const std::string json = text.str();
    auto count = [&](const std::string& needle) {
        std::size_t n = 0;
        for (auto at = json.find(needle); at != std::string::npos; at = json.find(needle, at + 1)) ++n;
        return n;
    };
    CHECK(json.rfind("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", 0) == 0);
    CHECK(count("\"name\":\"process_name\"") == 2);
    // 2 ranks x 2 steps x 3 buckets of each, and one span per step.
    CHECK(count("\"name\":\"ready\"") == 12);
    CHECK(count("\"name\":\"launched\"") == 12);
    CHECK(count("\"name\":\"allreduce\"") == 12);
    CHECK(count("\"name\":\"step\"") == 4);
    CHECK(count("\"args\":{\"step\":2,\"bucket\":2}") == 6);
    std::remove(path.c_str());
}
