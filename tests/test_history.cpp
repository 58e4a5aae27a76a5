// CollectiveHistory: tags say what a collective is for, fingerprints fold in everything before,
// and verify() makes every rank fail alike when one rank's history differs.
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include <string>
#include <vector>

using gradsync::DType;
using gradsync::detail::CollectiveHistory;
using gradsync::detail::CollectivePurpose;

TEST_CASE("history: a tag names the step and the bucket, buffers have none, and fingerprints fold in the past") {
    CollectiveHistory a, b;
    const auto first = a.next(CollectivePurpose::bucket, 3, 2, 4096, DType::float32);
    CHECK(first.step == 3);
    CHECK(first.bucket == 2);
    const auto buffer = a.next(CollectivePurpose::buffer_broadcast, 3, 0, 64, DType::float32);
    CHECK(buffer.bucket == -1);
    CHECK(a.count() == 2);

    // The same calls give the same fingerprints; one different call makes every later one differ.
    CHECK(b.next(CollectivePurpose::bucket, 3, 2, 4096, DType::float32) == first);
    CHECK(b.next(CollectivePurpose::buffer_broadcast, 3, 0, 64, DType::float32) == buffer);
    CollectiveHistory c;
    CHECK(c.next(CollectivePurpose::bucket, 3, 2, 2048, DType::float32).fingerprint != first.fingerprint);
    CHECK(c.next(CollectivePurpose::buffer_broadcast, 3, 0, 64, DType::float32).fingerprint != buffer.fingerprint);
    CollectiveHistory d;
    CHECK(d.next(CollectivePurpose::float_redo, 3, 2, 4096, DType::float32).fingerprint != first.fingerprint);
}

TEST_CASE("history: verify() passes equal histories and fails every rank alike when one differs") {
    std::vector<std::string> errors(3);
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        CollectiveHistory h;
        for (std::size_t b = 0; b < 2; ++b) (void)h.next(CollectivePurpose::bucket, 1, b, 100, DType::float32);
        h.verify(backend, 1);  // all alike
        if (backend.rank() == 2) (void)h.next(CollectivePurpose::bucket, 2, 0, 100, DType::float32);
        try {
            h.verify(backend, 2);
        } catch (const gradsync::HistoryMismatch& e) {  // raised on every rank alike: no abort
            errors[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& e : errors) {
        CHECK(e == errors[0]);
        CHECK(e ==
              "gradsync: step 2: the ranks' collective histories diverged: rank 0 issued 2 collectives and rank 2 3, "
              "with different fingerprints; every rank must launch the same buckets in the same order, and step its "
              "DataParallel objects in the same order");
    }
}
