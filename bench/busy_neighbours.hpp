// Load beside a benchmark: threads that spin on arithmetic while they live, as a trainer's own
// compute threads would.
#pragma once

#include <algorithm>  // for std::max
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace bench {

class BusyNeighbours {
public:
    // One thread per core by default.
    explicit BusyNeighbours(unsigned threads = std::max(1u, std::thread::hardware_concurrency())) {
        for (unsigned i = 0; i < threads; ++i)
            threads_.emplace_back([this] {
                std::uint64_t x = 1;
                while (!stop_.load(std::memory_order_relaxed)) {
                    for (int k = 0; k < 1000; ++k) x = x * 6364136223846793005ull + 1442695040888963407ull;
                    sink_.store(x, std::memory_order_relaxed);  // keeps the loop from being optimized away
                }
            });
    }
    BusyNeighbours(const BusyNeighbours&) = delete;
    BusyNeighbours& operator=(const BusyNeighbours&) = delete;
    ~BusyNeighbours() {
        stop_.store(true);
        for (auto& t : threads_) t.join();
    }

private:
    std::atomic<bool> stop_{false};
    std::atomic<std::uint64_t> sink_{0};
    std::vector<std::thread> threads_;
};

}  // namespace bench
