// detail::Watchdog, the no-hang guarantee of the NCCL backend, against a fake device: ops retire in
// issue order as the device finishes them; a late op or a device error fails the communicator
// once, aborts the device, and every waiter throws the reason naming the rank and the operation.
#include <gradsync/backend/detail/watchdog.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using gradsync::detail::Watchdog;
using gradsync::detail::WatchedOp;

namespace {

// A device whose ops finish when the test says so. Event k is the address of finished[k].
struct FakeDevice {
    std::atomic<bool> finished[8] = {};
    std::atomic<int> aborts{0};
    std::atomic<int> released{0};
    std::string error;  // set before the watchdog looks
    std::atomic<bool> error_set{false};
    std::atomic<bool> calling{false};        // a test's call is inside run()
    std::atomic<int> aborts_during_call{0};  // must stay 0: an abort never frees what a call uses
    std::atomic<int> untargeted_looks{0};    // device callbacks on the watchdog's thread before it chose the GPU
    std::atomic<int> watchdog_looks{0};
    std::string peers;  // where the peers it sees stand, as the device says

    gradsync::detail::WatchedDevice callbacks() {
        return {.finished =
                    [this](void* event) {
                        note_look();
                        return static_cast<std::atomic<bool>*>(event)->load();
                    },
                .error = [this]() -> std::string {
                    note_look();
                    return error_set.load() ? error : std::string();
                },
                .abort =
                    [this] {
                        aborts.fetch_add(1);
                        if (calling.load()) aborts_during_call.fetch_add(1);
                    },
                .release = [this](void*) { released.fetch_add(1); },
                .enter_thread = [this] { chosen = true; },
                .peers = [this] { return peers; }};
    }

private:
    static inline thread_local bool chosen = false;  // this thread selected the device
    void note_look() {
        if (chosen)
            watchdog_looks.fetch_add(1);
        else if (std::this_thread::get_id() != main_thread)
            untargeted_looks.fetch_add(1);
    }
    std::thread::id main_thread = std::this_thread::get_id();
};

std::shared_ptr<WatchedOp> op(FakeDevice& device, int k, std::chrono::steady_clock::duration within,
                              std::int64_t step = 3, std::int32_t bucket = 2) {
    auto o = std::make_shared<WatchedOp>();
    o->call = gradsync::CollectiveCall{.kind = gradsync::CollectiveKind::allreduce,
                                       .seq = 5,
                                       .count = 1u << 20,
                                       .dtype = gradsync::DType::float32,
                                       .op = gradsync::ReduceOp::average,
                                       .tag = gradsync::CollectiveTag{0, step, bucket}};
    o->deadline = std::chrono::steady_clock::now() + within;
    o->event = &device.finished[k];
    return o;
}

std::string error_of(Watchdog& dog, const WatchedOp& o) {
    try {
        (void)dog.wait_until(o, std::chrono::steady_clock::time_point::max());
    } catch (const gradsync::TimeoutError& e) {
        return std::string("timeout: ") + e.what();
    } catch (const gradsync::CollectiveError& e) {
        return e.what();
    }
    return "no error";
}

}  // namespace

TEST_CASE("watchdog: ops retire in issue order as the device finishes them") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 1 of 2 (fake)", device.callbacks(), 0ms);
    auto a = op(device, 0, 10s);
    auto b = op(device, 1, 10s);
    dog.run([&] {
        dog.watch(a);
        dog.watch(b);
    });
    CHECK_FALSE(dog.ready(*a));
    device.finished[1] = true;  // the later one alone does not retire: the device runs them in order
    CHECK_FALSE(dog.ready(*b));
    CHECK_FALSE(dog.wait_until(*b, std::chrono::steady_clock::now() + 5ms));  // the caller's deadline: no failure
    CHECK_FALSE(dog.failed());
    device.finished[0] = true;
    CHECK(dog.wait_until(*b, std::chrono::steady_clock::now() + 5s));
    CHECK(a->done.load());
    CHECK(device.released.load() == 2);
    CHECK(device.aborts.load() == 0);
}

TEST_CASE("watchdog: a late op aborts the communicator once and every waiter throws, naming rank and op") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 1 of 2 (fake)", device.callbacks(), 0ms);
    auto late = op(device, 0, 20ms);
    auto after = op(device, 1, 10s, 3, 3);
    dog.run([&] {
        dog.watch(late);
        dog.watch(after);
    });
    const auto first = error_of(dog, *after);  // waiting on the later op still notices the earlier one is late
    CHECK(first.find("timeout: gradsync: rank 1 of 2 (fake): allreduce #5 of 1048576 x float32 (4 MiB), average "
                     "(step 3, bucket 2) did not complete by its deadline; the communicator was aborted") == 0);
    CHECK(error_of(dog, *late) == first);
    CHECK(device.aborts.load() == 1);
    CHECK_THROWS_AS(dog.run([] {}), gradsync::TimeoutError);  // nothing more may be queued
    CHECK(dog.ready(*late));                                  // ready: waiting would not block
}

TEST_CASE("watchdog: a late op's message ends with where the device says the peers stand") {
    FakeDevice device;
    device.peers = " Where its peers in this process stand: rank 0 has entered 4 collectives (this rank 5)";
    Watchdog dog("gradsync: rank 1 of 2 (fake)", device.callbacks(), 0ms);
    auto late = op(device, 0, 20ms);
    dog.run([&] { dog.watch(late); });
    const auto what = error_of(dog, *late);
    CHECK(what.find("did not complete by its deadline") != std::string::npos);
    CHECK(
        what.ends_with("its own error says more. Where its peers in this process stand: rank 0 has entered 4 "
                       "collectives (this rank 5)"));
}

TEST_CASE("watchdog: an asynchronous device error fails the communicator during the oldest op") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 0 of 4 (fake)", device.callbacks(), 0ms);
    auto a = op(device, 0, 10s, 7, 0);
    dog.run([&] { dog.watch(a); });
    device.error = "remote process exited or there was a network error";
    device.error_set = true;
    const auto what = error_of(dog, *a);
    CHECK(what ==
          "gradsync: rank 0 of 4 (fake): the communicator failed during allreduce #5 of 1048576 x float32 "
          "(4 MiB), average (step 7, bucket 0): remote process exited or there was a network error; it was "
          "aborted");
    CHECK(device.aborts.load() == 1);
}

TEST_CASE("watchdog: an op that completed before the failure still waits successfully") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 0 of 2 (fake)", device.callbacks(), 0ms);
    auto a = op(device, 0, 10s);
    dog.run([&] { dog.watch(a); });
    device.finished[0] = true;
    CHECK(dog.wait_until(*a, std::chrono::steady_clock::time_point::max()));
    dog.fail("gradsync: rank 0 of 2: aborted by the test");
    CHECK(dog.wait_until(*a, std::chrono::steady_clock::time_point::max()));  // its data are final
    auto b = op(device, 1, 10s);
    CHECK_THROWS_WITH_AS(dog.run([&] { dog.watch(b); }), "gradsync: rank 0 of 2: aborted by the test",
                         gradsync::CollectiveError);
}

TEST_CASE("watchdog: the thread aborts a hung communicator though nobody waits") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 1 of 2 (fake)", device.callbacks(), 5ms);
    auto late = op(device, 0, 10ms);
    dog.run([&] { dog.watch(late); });
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (device.aborts.load() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
    CHECK(device.aborts.load() == 1);
    CHECK(dog.failed());
}

TEST_CASE("watchdog: the first reason wins, abort runs once, whoever fails it from any thread") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 0 of 2 (fake)", device.callbacks(), 1ms);
    auto a = op(device, 0, 10s);
    dog.run([&] { dog.watch(a); });
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([&dog, t] { dog.fail("gradsync: reason " + std::to_string(t)); });
    for (auto& t : threads) t.join();
    CHECK(device.aborts.load() == 1);
    const auto what = error_of(dog, *a);
    CHECK(what.find("gradsync: reason ") == 0);
    CHECK(error_of(dog, *a) == what);
}

TEST_CASE("watchdog: an abort from another thread ends a call stuck in progress within a second, after it left") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 1 of 2 (fake)", device.callbacks(), 5ms);
    std::thread peer([&] {
        std::this_thread::sleep_for(100ms);
        dog.fail("gradsync: rank 1 of 2 (fake): aborted because rank 0 failed");
    });
    const auto began = std::chrono::steady_clock::now();
    std::string what;
    try {
        dog.run([&] {
            device.calling = true;
            struct Left {
                FakeDevice& d;
                ~Left() { d.calling = false; }
            } left{device};
            // A non-blocking communicator's "in progress", for ever: only the abort can end it.
            dog.settle([] { return gradsync::detail::QueueState{}; }, "allreduce", std::chrono::minutes(10));
        });
    } catch (const gradsync::CollectiveError& e) {
        what = e.what();
    }
    peer.join();
    CHECK(what == "gradsync: rank 1 of 2 (fake): aborted because rank 0 failed");
    CHECK(std::chrono::steady_clock::now() - began < 1s);
    CHECK(device.aborts.load() == 1);
    CHECK(device.aborts_during_call.load() == 0);  // after the call had left run()
}

TEST_CASE("watchdog: a call queued past its deadline, or failing, fails the communicator naming it") {
    FakeDevice device;
    Watchdog late("gradsync: rank 0 of 2 (fake)", device.callbacks(), 0ms);
    CHECK_THROWS_WITH_AS(
        late.run([&] { late.settle([] { return gradsync::detail::QueueState{}; }, "broadcast", 30ms); }),
        "gradsync: rank 0 of 2 (fake): queueing broadcast did not finish within 30 ms; the communicator was aborted",
        gradsync::TimeoutError);
    CHECK(device.aborts.load() == 1);

    FakeDevice other;
    Watchdog failing("gradsync: rank 1 of 2 (fake)", other.callbacks(), 0ms);
    int polls = 0;
    CHECK_THROWS_WITH_AS(failing.run([&] {
        failing.settle(
            [&]() -> gradsync::detail::QueueState {
                if (++polls < 3) return std::nullopt;
                return std::string("remote process exited");
            },
            "allreduce", std::chrono::minutes(1));
    }),
                         "gradsync: rank 1 of 2 (fake): allreduce failed: remote process exited; the communicator "
                         "was aborted",
                         gradsync::CollectiveError);
    CHECK(other.aborts.load() == 1);

    FakeDevice fine;
    Watchdog settled("gradsync: rank 0 of 1 (fake)", fine.callbacks(), 0ms);
    polls = 0;
    settled.run([&] {
        settled.settle(
            [&]() -> gradsync::detail::QueueState {
                return ++polls < 5 ? std::nullopt : std::optional<std::string>("");
            },
            "allreduce", std::chrono::minutes(1));
    });
    CHECK(polls == 5);
    CHECK_FALSE(settled.failed());
}

TEST_CASE("watchdog: its thread selects the device before it looks at it") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 0 of 2 (fake)", device.callbacks(), 1ms);
    auto a = op(device, 0, 10s);
    dog.run([&] { dog.watch(a); });
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (device.watchdog_looks.load() < 3 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(1ms);
    dog.stop();
    CHECK(device.watchdog_looks.load() >= 3);
    CHECK(device.untargeted_looks.load() == 0);
}

TEST_CASE("a collective is described the same way everywhere: kind, number, size, operator, purpose") {
    gradsync::CollectiveCall c{.kind = gradsync::CollectiveKind::broadcast, .count = 1536};
    CHECK(c.describe() == "broadcast of 1.5 KiB from rank 0");
    c.seq = 2;
    c.root = 1;
    c.tag.step = 4;
    CHECK(c.describe() == "broadcast #2 of 1.5 KiB from rank 1 (step 4)");
    c = {.kind = gradsync::CollectiveKind::allreduce,
         .seq = 7,
         .count = 300,
         .dtype = gradsync::DType::float32,
         .op = gradsync::ReduceOp::average,
         .tag = {0, 1, 1}};
    CHECK(c.describe() == "allreduce #7 of 300 x float32 (1.2 KiB), average (step 1, bucket 1)");
    CHECK(gradsync::CollectiveCall{.kind = gradsync::CollectiveKind::barrier, .seq = 4}.describe() == "barrier #4");
    auto other = c;
    CHECK(other.same_as(c));
    other.count = 200;
    CHECK_FALSE(other.same_as(c));
}

TEST_CASE("watchdog: closing it (the backend goes away) aborts nothing, and a handle left over throws the reason") {
    FakeDevice device;
    Watchdog dog("gradsync: rank 0 of 2 (fake)", device.callbacks(), 1ms);
    auto a = op(device, 0, 10s);
    dog.run([&] { dog.watch(a); });
    dog.close("gradsync: rank 0 of 2 (fake): the backend was destroyed");
    CHECK(device.aborts.load() == 0);
    CHECK(error_of(dog, *a) == "gradsync: rank 0 of 2 (fake): the backend was destroyed");
    dog.fail("later");  // the first reason stays
    CHECK(device.aborts.load() == 0);
}
