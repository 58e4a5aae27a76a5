// A ShardedDataParallel destroyed while its reduce_scatters are in flight (an exception left the
// step after grad_ready launched them) aborts the group and drains them before its memory goes:
// the peers fail at once, naming the rank, and nothing reads freed memory (checked under
// AddressSanitizer in the sanitizer preset).
#include <gradsync/backend/local.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/toy_model.hpp"

#include <chrono>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

TEST_CASE("a ShardedDataParallel destroyed with reduce_scatters in flight fails its peers at once, naming it") {
    std::string peer;
    std::string first;
    const auto start = std::chrono::steady_clock::now();
    try {
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            testing_support::Toy model({4000, 3000}, 1.0f);
            gradsync::ShardedDataParallel sharded(model, backend,
                                                  gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
            for (std::size_t i = model.tensors.size(); i-- > 0;) sharded.grad_ready(i);  // every bucket launched
            if (backend.rank() == 0) throw std::runtime_error("rank 0 lost its data loader");
            try {
                (void)sharded.step([](std::span<const gradsync::ShardPiece<float>>) {});
            } catch (const gradsync::CollectiveError& e) {
                peer = e.what();
            }
        });
    } catch (const std::exception& e) {
        first = e.what();
    }
    CHECK(first == "rank 0 lost its data loader");
    CHECK(peer.find("rank 0 destroyed its ShardedDataParallel in step 1 with collectives in flight") !=
          std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));  // not the 600 s deadline
}
