// Waiting on another thread: how long a waiter spins is learnt from how its waits end, and a wait
// ends when its condition holds, whether it was spinning, yielding or asleep by then.
#include <gradsync/detail/wait.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

using gradsync::detail::Doorbell;
using gradsync::detail::SpinBudget;
using namespace std::chrono_literals;

namespace {

// Waits on `flag`, which another thread sets after `delay` (and rings the bell for).
void wait_for_flag_set_after(std::chrono::microseconds delay, SpinBudget& budget) {
    std::atomic<bool> flag{false};
    Doorbell bell;
    std::thread setter([&] {
        std::this_thread::sleep_for(delay);
        flag.store(true, std::memory_order_seq_cst);
        bell.ring();
    });
    gradsync::detail::wait_until([&] { return flag.load(std::memory_order_acquire); }, [] {}, bell, budget);
    CHECK(flag.load());
    setter.join();
}

// Waits that each end asleep, until the budget is at its least: a thread preempted while it
// spins (a loaded machine, a sanitizer) may see a wait end during its spin now and then, so the
// count is a bound, not exact. Returns how many waits it took.
int waits_until_least(SpinBudget& budget) {
    int waits = 0;
    while (budget.get() != SpinBudget::least && waits < 40) {
        wait_for_flag_set_after(2'000us, budget);
        ++waits;
    }
    return waits;
}

}  // namespace

TEST_CASE("wait: the budget grows by a quarter when spinning paid and halves when it did not, within bounds") {
    SpinBudget budget;
    CHECK(budget.get() == SpinBudget::most);
    budget.paid();
    CHECK(budget.get() == SpinBudget::most);
    budget.wasted();
    CHECK(budget.get() == SpinBudget::most / 2);
    for (int i = 0; i < 10; ++i) budget.wasted();
    CHECK(budget.get() == SpinBudget::least);
    budget.paid();
    CHECK(budget.get() == SpinBudget::least + SpinBudget::least / 4);
}

TEST_CASE("wait: a wait that outlasts its spin halves the next spin, down to the least") {
    SpinBudget budget;
    // 2 ms is far beyond any spin: these waits end asleep, and six halvings reach the least.
    const int waits = waits_until_least(budget);
    CHECK(budget.get() == SpinBudget::least);
    CHECK(waits >= 6);
}

TEST_CASE("wait: a wait that ends while spinning lets the next spin a quarter longer, up to the most") {
    SpinBudget budget;
    (void)waits_until_least(budget);
    REQUIRE(budget.get() == SpinBudget::least);
    Doorbell bell;
    gradsync::detail::wait_until([] { return true; }, [] {}, bell, budget);
    CHECK(budget.get() == SpinBudget::least + SpinBudget::least / 4);
    for (int i = 0; i < 40; ++i) gradsync::detail::wait_until([] { return true; }, [] {}, bell, budget);
    CHECK(budget.get() == SpinBudget::most);
}

TEST_CASE("wait: the check ends a wait that would never end, whether spinning or asleep") {
    SpinBudget budget;
    Doorbell bell;
    const auto until = std::chrono::steady_clock::now() + 30ms;
    auto check = [&] {
        if (std::chrono::steady_clock::now() >= until) throw std::runtime_error("deadline");
    };
    CHECK_THROWS_WITH_AS(gradsync::detail::wait_until([] { return false; }, check, bell, budget), "deadline",
                         std::runtime_error);
    CHECK(std::chrono::steady_clock::now() >= until);
}

TEST_CASE("wait: with a nap for a sleep, a change nobody rings for is still seen") {
    // A peer in another process cannot ring a Doorbell: the waiter naps and looks again.
    SpinBudget budget;
    std::atomic<bool> flag{false};
    std::atomic<int> checks{0};
    std::thread setter([&] {
        std::this_thread::sleep_for(20ms);
        flag.store(true, std::memory_order_seq_cst);  // and no bell
    });
    gradsync::detail::wait_until([&] { return flag.load(std::memory_order_acquire); }, [&] { ++checks; },
                                 gradsync::detail::Nap(200us), budget);
    setter.join();
    CHECK(flag.load());
    CHECK(checks.load() > 0);
}

TEST_CASE("wait: a nap lasts the shorter of its length and the slice asked for") {
    using clock = std::chrono::steady_clock;
    auto never = [] { return false; };
    auto start = clock::now();
    gradsync::detail::Nap(1ms).sleep(never, 10s);
    CHECK(clock::now() - start < 2s);  // its length, not the slice
    start = clock::now();
    gradsync::detail::Nap(10s).sleep(never, 1ms);
    CHECK(clock::now() - start < 2s);  // the slice, not its length
}
