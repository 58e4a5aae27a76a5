// A bucket reduction without finish() is refused, naming the member and what it must do.
// expect: a bucket reduction needs `void finish\(Step&\) const`
// most errors: 1
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/memory/host.hpp>

struct SumInPlace {
    static constexpr bool deferred = false;
    template <class Slot>
    bool needs_buffer(const Slot&) const {
        return false;
    }
    template <class S>
    void start(S& s, gradsync::CollectiveTag tag) const {
        run(s, tag);
    }
    template <class S>
    void run(S& s, gradsync::CollectiveTag tag) const {
        gradsync::detail::allreduce_tagged(s.backend, s.packed(), gradsync::ReduceOp::sum, tag);
    }
#ifndef GRADSYNC_EXPECT_FAILURE
    template <class S>
    void finish(S&) const {}
#endif
};

using Engine =
    gradsync::detail::BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, gradsync::DType::float32, false>;
static_assert(gradsync::detail::check_bucket_reduction<SumInPlace, Engine::Step>());

int main() {}
