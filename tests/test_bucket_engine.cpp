// BucketEngine, the part of DataParallel that moves buckets: the reduction each bucket takes, a
// bucket reduced now or launched and waited for, the diagnosis of a late one, and the finalize
// pass through the memory policy; and the same engine reduce-scattering buckets into shards, as
// ShardedDataParallel runs it, the sharded step's decision over the shards and stage 2's gradient
// store.
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/released_shards.hpp>
#include <gradsync/data_parallel/shard_step.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/memory/host.hpp>

#include <doctest/doctest.h>

#include "support/recording_backend.hpp"
#include "support/sharded_training.hpp"
#include "support/toy_model.hpp"

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

using gradsync::DType;
using gradsync::detail::BucketEngine;
using gradsync::detail::BufferAllreduce;
using gradsync::detail::InPlaceAllreduce;
using gradsync::detail::ReduceScatterShard;
using gradsync::detail::WireAllreduce;
using testing_support::RecordingBackend;

namespace {

// t0 and t1 adjacent in one buffer; t2 and t3 each in a vector of its own.
struct Mixed {
    std::vector<float> w01 = std::vector<float>(30), g01 = std::vector<float>(30);
    std::vector<float> w2 = std::vector<float>(5), g2 = std::vector<float>(5);
    std::vector<float> w3 = std::vector<float>(7), g3 = std::vector<float>(7);
    std::vector<gradsync::Parameter> parameters() {
        return {{"t0", w01.data(), g01.data(), 10, DType::float32},
                {"t1", w01.data() + 10, g01.data() + 10, 20, DType::float32},
                gradsync::parameter("t2", w2, g2),
                gradsync::parameter("t3", w3, g3)};
    }
    void fill(int rank) {
        for (std::size_t i = 0; i < g01.size(); ++i) g01[i] = float(rank + 1) * float(i);
        for (std::size_t i = 0; i < g2.size(); ++i) g2[i] = float(rank + 1) * 2.0f;
        for (std::size_t i = 0; i < g3.size(); ++i) g3[i] = float(rank + 1) * 3.0f;
    }
};

gradsync::BucketPlan two_buckets() {
    gradsync::BucketPlan plan;
    plan.buckets = {{DType::float32, {1, 0}, 30}, {DType::float32, {3, 2}, 12}};
    return plan;
}

}  // namespace

TEST_CASE(
    "bucket engine: a bucket is a view when contiguous, packed otherwise, compressed under a wire, in place "
    "with a backend that reduces scattered memory") {
    gradsync::spawn(2, [](gradsync::LocalBackend& local) {
        Mixed m;
        const auto params = m.parameters();
        RecordingBackend contiguous_only(local);
        BucketEngine<RecordingBackend, gradsync::HostMemory, DType::float32, false> packed(contiguous_only, {});
        packed.setup(two_buckets(), params);
        CHECK(packed.slots()[0].reduced_by<BufferAllreduce>());
        CHECK(packed.slots()[0].view.has_value());
        CHECK(packed.slots()[1].reduced_by<BufferAllreduce>());
        CHECK_FALSE(packed.slots()[1].view.has_value());
        CHECK(packed.view_buckets() == 1);
        CHECK(packed.slots()[1].buffer.size() == 12 * sizeof(float));
        CHECK(packed.slots()[1].indices == std::vector<std::size_t>{2, 3});  // laid out by parameter index
        CHECK(packed.reduced_buffer(0) == nullptr);  // reduced as a view, where the gradients lie
        CHECK(packed.reduced_buffer(1) == gradsync::HostMemory::data(packed.slots()[1].buffer));
        // An allreducing engine never reduce-scatters, and a plain one never compresses.
        CHECK_FALSE(packed.slots()[0].reduced_by<ReduceScatterShard<false>>());
        static_assert(!gradsync::detail::has_alternative<InPlaceAllreduce, decltype(packed)::Reductions>);

        BucketEngine<RecordingBackend, gradsync::HostMemory, DType::bfloat16, false> narrow(contiguous_only, {});
        narrow.setup(two_buckets(), params);
        CHECK(narrow.slots()[0].reduced_by<WireAllreduce>());
        CHECK(narrow.slots()[0].wire == DType::bfloat16);
        CHECK(narrow.slots()[0].buffer.size() == 30 * 2);
        CHECK(narrow.view_buckets() == 0);

        BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, DType::float32, true> in_place(local, {});
        in_place.setup(two_buckets(), params);
        CHECK(in_place.slots()[0].reduced_by<InPlaceAllreduce>());
        CHECK(in_place.slots()[1].reduced_by<InPlaceAllreduce>());
        CHECK(in_place.slots()[1].buffer.size() == 0);  // no bucket buffer at all
        CHECK(in_place.reduced_buffer(1) == nullptr);
    });
}

TEST_CASE("bucket engine: reduced now or launched and waited for, every reduction ends with the average") {
    std::vector<int> wrong(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& local) {
        RecordingBackend backend(local);
        Mixed m;
        BucketEngine<RecordingBackend, gradsync::HostMemory, DType::float32, false> engine(backend, {});
        engine.setup(two_buckets(), m.parameters());
        for (bool overlapped : {false, true}) {
            m.fill(local.rank());
            engine.begin_step(false, 1.0);
            for (std::size_t b = 0; b < 2; ++b) {
                if (overlapped)
                    engine.launch(b, {});
                else
                    engine.reduce_now(b, {});
            }
            engine.wait_all(std::chrono::steady_clock::now() + std::chrono::seconds(30),
                            [](std::size_t) { return std::string("late"); });
            CHECK_FALSE(engine.in_flight());
            int bad = 0;
            for (std::size_t i = 0; i < m.g01.size(); ++i) bad += m.g01[i] != 1.5f * float(i);
            for (float v : m.g2) bad += v != 3.0f;
            for (float v : m.g3) bad += v != 4.5f;
            wrong[static_cast<std::size_t>(local.rank())] += bad;
        }
    });
    CHECK(wrong == std::vector<int>{0, 0});
}

TEST_CASE("bucket engine: reduce-scattered buckets are packed even on one rank, and only this rank's shard averaged") {
    for (int world : {1, 3}) {
        CAPTURE(world);
        std::vector<int> wrong(static_cast<std::size_t>(world));
        gradsync::spawn(world, [&](gradsync::LocalBackend& local) {
            sharded::BufferOnly backend{local};
            Mixed m;
            BucketEngine<sharded::BufferOnly, gradsync::HostMemory, DType::float32, false, gradsync::NoCommHook,
                         gradsync::detail::BucketCollective::reduce_scatter>
                engine(backend, {});
            engine.setup(two_buckets(), m.parameters());
            CHECK(engine.slots()[0].reduced_by<ReduceScatterShard<false>>());
            CHECK(engine.reduced_buffer(0) == gradsync::HostMemory::data(engine.slots()[0].buffer));
            CHECK_FALSE(engine.slots()[0].view.has_value());  // contiguous, yet read from the buffer
            CHECK(engine.slots()[0].buffer.size() == 30 * sizeof(float));
            CHECK(engine.view_buckets() == 0);
            // A result slot beside the buckets' for the front's decision.
            CHECK(engine.spare_result_slot() == 2);
            CHECK(engine.memory().results().size() == 3);
            m.fill(local.rank());
            const auto gradients = m.g01;
            engine.begin_step(/*finalizing=*/true, 0.5);  // still: nothing unscaled, nothing unpacked
            engine.launch(0, {});
            engine.reduce_now(1, {});
            engine.wait_all(std::chrono::steady_clock::now() + std::chrono::seconds(30),
                            [](std::size_t) { return std::string("late"); });
            CHECK_FALSE(engine.in_flight());
            CHECK_FALSE(engine.slots()[0].measured);
            const float mean = float(world + 1) / 2.0f;  // of the ranks' factors rank + 1
            int bad = m.g01 != gradients;
            const auto packed = [&](std::size_t b) {
                return reinterpret_cast<const float*>(gradsync::HostMemory::data(engine.slots()[b].buffer));
            };
            const auto first = gradsync::shard_of(30, world, local.rank());
            for (std::size_t i = first.offset; i < first.offset + first.count; ++i)
                bad += packed(0)[i] != mean * float(i);
            const auto second = gradsync::shard_of(12, world, local.rank());  // t2's 5, then t3's 7
            for (std::size_t i = second.offset; i < second.offset + second.count; ++i)
                bad += packed(1)[i] != (i < 5 ? 2.0f : 3.0f) * mean;
            wrong[static_cast<std::size_t>(local.rank())] = bad;
        });
        CHECK(wrong == std::vector<int>(static_cast<std::size_t>(world), 0));
    }
}

TEST_CASE("bucket engine: a bucket not reduced by the deadline is named by the diagnosis") {
    std::string what;
    gradsync::spawn(2, [&](gradsync::LocalBackend& local) {
        if (local.rank() == 1) return;  // never launches: leaves the group
        Mixed m;
        BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, DType::float32, true> engine(local, {});
        engine.setup(two_buckets(), m.parameters());
        engine.begin_step(false, 1.0);
        engine.launch(0, {});
        try {
            engine.wait_all(std::chrono::steady_clock::now() + std::chrono::milliseconds(100),
                            [](std::size_t b) { return "bucket " + std::to_string(b) + " is late"; });
        } catch (const gradsync::TimeoutError& e) {
            what = e.what();
        } catch (const gradsync::CollectiveError& e) {
            what = e.what();  // rank 1 left first: the backend says so
        }
        local.abort("done");
        engine.drain(std::chrono::steady_clock::now() + std::chrono::seconds(5));
        CHECK_FALSE(engine.in_flight());
    });
    CHECK((what == "bucket 0 is late" || what.find("rank 1 left the group") != std::string::npos));
}

TEST_CASE("bucket engine: the finalize pass unscales and measures each bucket, and without it, nothing changes") {
    gradsync::spawn(1, [](gradsync::LocalBackend& local) {
        Mixed m;
        m.fill(0);
        BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, DType::float32, true> engine(local, {});
        engine.setup(two_buckets(), m.parameters());
        engine.begin_step(false, 0.5);
        engine.finalize_in_place(1);
        CHECK(m.g2[0] == 2.0f);  // not finalizing: untouched
        CHECK_FALSE(engine.slots()[1].measured);
        engine.begin_step(true, 0.5);
        engine.finalize_in_place(1);
        CHECK(m.g2[0] == 1.0f);
        CHECK(m.g3[0] == 1.5f);
        CHECK(engine.slots()[1].measured);
        CHECK(engine.memory().results()[1] == 5 * 1.0 + 7 * 2.25);
        engine.scale_all(2.0);
        CHECK(m.g3[0] == 3.0f);
        CHECK(m.g01[4] == 8.0f);
    });
}

namespace {

// The least a bucket reduction is: its collective started and its pass after it. This one sums
// the bucket's first gradient over the ranks, then doubles it.
struct SumFirstThenDouble {
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
        const auto& first = s.slot.segments.front();
        gradsync::detail::allreduce_tagged(s.backend, gradsync::Buffer{first.data, first.count, s.slot.dtype},
                                           gradsync::ReduceOp::sum, tag);
    }
    template <class S>
    void finish(S& s) const {
        auto* values = static_cast<float*>(s.slot.segments.front().data);
        for (std::size_t i = 0; i < s.slot.segments.front().count; ++i) values[i] *= 2.0f;
    }
};
// Started, but with no pass after it.
struct NoFinish {
    static constexpr bool deferred = false;
    template <class Slot>
    bool needs_buffer(const Slot&) const {
        return false;
    }
    template <class S>
    void start(S&, gradsync::CollectiveTag) const {}
    template <class S>
    void run(S&, gradsync::CollectiveTag) const {}
};
// Not deferred, yet it cannot run now.
struct NoRun {
    static constexpr bool deferred = false;
    template <class Slot>
    bool needs_buffer(const Slot&) const {
        return false;
    }
    template <class S>
    void start(S&, gradsync::CollectiveTag) const {}
    template <class S>
    void finish(S&) const {}
};
// Deferred: only started and finished, never run.
struct DeferredNoRun : NoRun {
    static constexpr bool deferred = true;
};

}  // namespace

TEST_CASE("bucket engine: a reduction is what the concept states, and a minimal one runs over a bucket step") {
    using Engine = BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, DType::float32, false>;
    using Step = Engine::Step;
    static_assert(gradsync::detail::BucketReduction<SumFirstThenDouble, Step>);
    static_assert(gradsync::detail::BucketReduction<DeferredNoRun, Step>);
    static_assert(!gradsync::detail::BucketReduction<NoFinish, Step>);
    static_assert(!gradsync::detail::BucketReduction<NoRun, Step>);
    static_assert(!gradsync::detail::BucketReduction<int, Step>);
    std::vector<int> wrong(3);
    gradsync::spawn(3, [&](gradsync::LocalBackend& local) {
        Mixed m;
        m.fill(local.rank());
        Engine engine(local, {});
        engine.setup(two_buckets(), m.parameters());
        Step step = engine.step_of(1);  // t2 and t3: the first is t2
        const SumFirstThenDouble reduction;
        reduction.start(step, {});
        reduction.finish(step);
        int bad = 0;
        for (float v : m.g2) bad += v != 2.0f * (2.0f + 4.0f + 6.0f);
        for (float v : m.g3) bad += v != float(local.rank() + 1) * 3.0f;  // untouched
        wrong[static_cast<std::size_t>(local.rank())] = bad;
    });
    CHECK(wrong == std::vector<int>{0, 0, 0});
}

namespace {

// HostMemory that counts the passes the sharded step's decision makes through it.
struct CountingMemory : gradsync::HostMemory {
    mutable int finalized = 0, scaled = 0, measured = 0;
    void finalize(const Table& t, const std::byte* src, DType type, double factor, std::size_t slot) {
        ++finalized;
        HostMemory::finalize(t, src, type, factor, slot);
    }
    void scale(const Table& t, double factor) const {
        ++scaled;
        HostMemory::scale(t, factor);
    }
    std::vector<double> segment_sums(const Table& t) const {
        ++measured;
        return HostMemory::segment_sums(t);
    }
};

}  // namespace

TEST_CASE("sharded step: the decision unscales, measures, clips and names an overflow through the memory policy") {
    using gradsync::detail::ShardLayout;
    const auto no_tag = [](auto...) { return gradsync::CollectiveTag{}; };
    const auto packed_nowhere = [](std::size_t) { return static_cast<float*>(nullptr); };
    gradsync::spawn(2, [&](gradsync::LocalBackend& local) {
        const auto r = static_cast<std::size_t>(local.rank());
        Mixed m;
        m.fill(0);  // alike on both ranks: g01[i] = i, g2 = 2, g3 = 3
        const auto params = m.parameters();
        const auto plan = two_buckets();  // shards: t0 and t1 split at 15; t2 and t3[0] | t3[1..6]
        CountingMemory memory;
        memory.prepare_results(1);  // slot 0 for the decision, as the bucket engine's set-up prepares one
        ShardLayout<true, CountingMemory> shards(memory, 0, params, plan, 2, local.rank(), packed_nowhere);
        gradsync::StaticLossScale scaler;
        scaler.value = 2.0f;
        gradsync::StepReport report;
        gradsync::detail::decide_on_shards(local, shards, params, scaler, /*clip_norm=*/1.0, report, no_tag);
        // Both ranks' shards, unscaled: (1/4) * (0^2 + ... + 29^2) + 5 * 1^2 + 7 * 1.5^2.
        const double norm = std::sqrt(8555.0 / 4 + 5 + 7 * 2.25);
        CHECK(report.applied);
        CHECK(report.grad_norm == doctest::Approx(norm));
        CHECK(report.clipped);
        CHECK(memory.finalized == 1);
        CHECK(memory.scaled == 1);
        CHECK(memory.measured == 0);
        for (std::size_t i = 0; i < 30; ++i) {
            const bool mine = i / 15 == r;
            CHECK(m.g01[i] == doctest::Approx(mine ? i * 0.5 / (norm + 1e-6) : double(i)));
        }
        CHECK(m.g2[0] == doctest::Approx(r == 0 ? 1.0 / (norm + 1e-6) : 2.0));
        CHECK(m.g3[6] == doctest::Approx(r == 1 ? 1.5 / (norm + 1e-6) : 3.0));

        // A non-finite gradient in rank 1's shard: both ranks skip the step and name its parameter.
        m.fill(0);
        if (r == 1) m.g3[6] = std::nanf("");
        gradsync::StepReport skipped;
        gradsync::detail::decide_on_shards(local, shards, params, scaler, 1.0, skipped, no_tag);
        CHECK_FALSE(skipped.applied);
        CHECK(std::isnan(skipped.grad_norm));
        CHECK(skipped.overflowed == std::vector<std::string>{"t3"});
        CHECK(memory.measured == 1);
        CHECK(memory.scaled == 1);  // not clipped
    });
}

namespace {

// HostMemory whose copies count packs and unpacks; its copies share the counts.
struct CopyCountingMemory : gradsync::HostMemory {
    std::shared_ptr<int> packs = std::make_shared<int>(0), unpacks = std::make_shared<int>(0);
    void pack(const Table& t, std::byte* dst) const {
        ++*packs;
        HostMemory::pack(t, dst);
    }
    void unpack(const Table& t, const std::byte* src) const {
        ++*unpacks;
        HostMemory::unpack(t, src);
    }
};

}  // namespace

TEST_CASE(
    "sharded layout: the shard's parameters, the gathered bucket and a kept shard are copied by the memory policy") {
    using gradsync::detail::ShardLayout;
    const auto packed_nowhere = [](std::size_t) { return static_cast<float*>(nullptr); };
    const auto plan = two_buckets();  // shards of 2 ranks: t0 and t1 split at 15; t2 and t3[0] | t3[1..6]
    for (int rank : {0, 1}) {
        CAPTURE(rank);
        Mixed m;
        m.fill(0);
        for (std::size_t i = 0; i < m.w01.size(); ++i) m.w01[i] = 100.0f + float(i);
        const auto params = m.parameters();
        CopyCountingMemory memory;
        ShardLayout<false, CopyCountingMemory> packed(memory, 0, params, plan, 2, rank, packed_nowhere);
        packed.pack_shard(0);
        CHECK(*memory.packs == 1);
        const float* buffer = packed.slots[0].buffer();
        const std::size_t lo = rank == 0 ? 0 : 15;
        for (std::size_t i = 0; i < 30; ++i) CHECK(buffer[i] == (i - lo < 15 ? 100.0f + float(i) : 0.0f));
        // As an all-gather leaves it: every element written; then the model takes it.
        for (std::size_t i = 0; i < 30; ++i) packed.slots[0].buffer()[i] = -float(i);
        packed.unpack_params(0);
        CHECK(*memory.unpacks == 1);
        for (std::size_t i = 0; i < 30; ++i) CHECK(m.w01[i] == -float(i));

        // Stage 2: bucket 1's share of the gradients, kept in the store where its pieces lie.
        std::vector<float> store(gradsync::detail::shard_elements(plan, 2, rank), -1.0f);
        ShardLayout<true, CopyCountingMemory> kept(memory, 0, params, plan, 2, rank, packed_nowhere, store.data());
        kept.keep_shard(1);
        CHECK(*memory.packs == 2);
        const std::size_t at = 15;  // after bucket 0's shard
        if (rank == 0) {
            for (std::size_t i = 0; i < 5; ++i) CHECK(store[at + i] == m.g2[i]);
            CHECK(store[at + 5] == m.g3[0]);
        } else {
            for (std::size_t i = 0; i < 6; ++i) CHECK(store[at + i] == m.g3[1 + i]);
        }
        CHECK(store[0] == -1.0f);  // bucket 0 not kept
    }
}

namespace {

// HostMemory that counts allocations and zeroings; its copies share the counts.
struct AllocationCountingMemory : gradsync::HostMemory {
    std::shared_ptr<int> allocations = std::make_shared<int>(0), zeroed = std::make_shared<int>(0);
    Storage allocate(gradsync::Bytes size) const {
        ++*allocations;
        return HostMemory::allocate(size);
    }
    void zero(gradsync::Segment s, DType t) const {
        ++*zeroed;
        HostMemory::zero(s, t);
    }
};

}  // namespace

TEST_CASE("released shards: the gradient store is allocated and zeroed by the memory policy, only when on") {
    const auto plan = two_buckets();
    const std::size_t elements = gradsync::detail::shard_elements(plan, 2, 1);
    CHECK(elements == 15 + 6);  // rank 1's shards: t0 and t1 from 15 on; t3[1..6]
    for (bool on : {false, true}) {
        CAPTURE(on);
        const AllocationCountingMemory memory;
        gradsync::detail::ReleasedShards<Mixed, AllocationCountingMemory> released;
        released.plan(on, plan, 2, 1, memory);
        CHECK(*memory.allocations == (on ? 1 : 0));
        CHECK(*memory.zeroed == (on ? 1 : 0));
        CHECK(released.on() == on);
        CHECK(released.bytes() == (on ? elements * sizeof(float) : 0));
        CHECK((released.store() != nullptr) == on);
        if (on)
            for (std::size_t i = 0; i < elements; ++i) CHECK(released.store()[i] == 0.0f);
    }
}
