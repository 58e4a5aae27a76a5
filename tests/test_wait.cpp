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

}  // namespace

TEST_CASE("wait: a wait that outlasts its spin halves the next spin, down to the least") {
    SpinBudget budget;
    CHECK(budget.get() == SpinBudget::most);
    // 20 ms is far beyond any spin: each of these waits ends asleep.
    wait_for_flag_set_after(20'000us, budget);
    CHECK(budget.get() == SpinBudget::most / 2);
    for (int i = 0; i < 8; ++i) wait_for_flag_set_after(2'000us, budget);
    CHECK(budget.get() == SpinBudget::least);
}

TEST_CASE("wait: a wait that ends while spinning lets the next spin a quarter longer, up to the most") {
    SpinBudget budget;
    for (int i = 0; i < 8; ++i) wait_for_flag_set_after(2'000us, budget);
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
