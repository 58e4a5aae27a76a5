// FaultyBackend<B>: wraps a backend (LocalBackend, MpiBackend, any with the same calls) and
// makes this rank misbehave at its k-th collective (counting from 1, every collective it calls),
// so that every failure path of DataParallel is a unit test. Everything else goes to the wrapped
// backend unchanged.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace testing_support {

struct Fault {
    enum class Kind : std::uint8_t {
        delay,           // sleeps for `delay` before taking part
        throw_error,     // the call throws InjectedFault on this rank, and the group is aborted with it
        vanish,          // asynchronous calls only: from this call on, the rank takes part in nothing; the
                         // handles complete only with an error, once this rank aborts the group
        swap_with_next,  // asynchronous calls only: the next call is issued first, then this one
        plant_nan,       // writes a NaN into the first element of this rank's allreduce input
    };
    Kind kind = Kind::delay;
    std::uint64_t at_call = 1;
    std::chrono::milliseconds delay{0};
};

// What a fault of kind throw_error throws.
class InjectedFault : public gradsync::Error {
public:
    using gradsync::Error::Error;
};

template <class B>
class FaultyBackend {
    using InnerHandle = decltype(std::declval<B&>().allreduce_async(gradsync::Buffer{}, gradsync::ReduceOp::sum));

    // A collective this wrapper may hold back (swap_with_next) or never issue (vanish): the
    // inner handle once the call is issued, and whether the group was aborted meanwhile.
    struct State {
        std::optional<InnerHandle> inner;
        bool vanished = false;
        const std::atomic<bool>* aborted = nullptr;
        std::string what;
    };

public:
    class Handle {
    public:
        Handle() = default;
        explicit Handle(std::shared_ptr<State> s) : s_(std::move(s)) {}
        [[nodiscard]] bool ready() const { return !s_ || (s_->inner ? s_->inner->ready() : s_->aborted->load()); }
        void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }
        [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
            if (!s_) return true;
            while (!s_->inner) {
                if (s_->aborted->load())
                    throw gradsync::CollectiveError("gradsync: injected fault: " + s_->what + " never took part");
                if (std::chrono::steady_clock::now() >= deadline) return false;
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            return s_->inner->wait_until(deadline);
        }
        [[nodiscard]] std::chrono::steady_clock::time_point finished_at() const {
            if (s_ && s_->inner) return s_->inner->finished_at();
            return {};
        }

    private:
        std::shared_ptr<State> s_;
    };

    static constexpr bool checks_tags = gradsync::CheckedCollectives<B>;

    explicit FaultyBackend(B& inner) : inner_(inner) {}

    // Makes this rank misbehave at its fault.at_call-th collective.
    void inject(Fault fault) { faults_.push_back(fault); }
    // Collectives called so far (the next one is number calls_made() + 1).
    [[nodiscard]] std::uint64_t calls_made() const { return calls_; }

    [[nodiscard]] int rank() const { return inner_.rank(); }
    [[nodiscard]] int size() const { return inner_.size(); }
    [[nodiscard]] bool supports(gradsync::DType t) const { return inner_.supports(t); }

    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        (void)before(describe(buf.count, buf.dtype, op, tag), buf);
        forward_now([&] {
            if constexpr (requires { inner_.allreduce(buf, op, tag); })
                inner_.allreduce(buf, op, tag);
            else
                inner_.allreduce(buf, op);
        });
    }
    Handle allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        const gradsync::Segment seg{buf.data, buf.count};
        return launch(describe(buf.count, buf.dtype, op, tag), std::span(&seg, 1), buf.dtype, [this, buf, op, tag] {
            if constexpr (requires { inner_.allreduce_async(buf, op, tag); })
                return inner_.allreduce_async(buf, op, tag);
            else
                return inner_.allreduce_async(buf, op);
        });
    }
    void allreduce(std::span<const gradsync::Segment> segs, gradsync::DType t, gradsync::ReduceOp op,
                   gradsync::CollectiveTag tag = {}) requires gradsync::ScatteredAllreduce<B> {
        (void)before(describe(gradsync::detail::total_count(segs), t, op, tag), segs, t);
        forward_now([&] {
            if constexpr (requires { inner_.allreduce(segs, t, op, tag); })
                inner_.allreduce(segs, t, op, tag);
            else
                inner_.allreduce(segs, t, op);
        });
    }
    Handle allreduce_async(std::span<const gradsync::Segment> segs, gradsync::DType t, gradsync::ReduceOp op,
                           gradsync::CollectiveTag tag = {}) requires gradsync::ScatteredAllreduce<B> {
        return launch(describe(gradsync::detail::total_count(segs), t, op, tag), segs, t, [this, segs, t, op, tag] {
            if constexpr (requires { inner_.allreduce_async(segs, t, op, tag); })
                return inner_.allreduce_async(segs, t, op, tag);
            else
                return inner_.allreduce_async(segs, t, op);
        });
    }
    void broadcast(std::span<std::byte> bytes, int root, gradsync::CollectiveTag tag = {}) {
        gradsync::CollectiveCall call{.kind = gradsync::CollectiveKind::broadcast,
                                      .seq = calls_ + 1,
                                      .count = bytes.size(),
                                      .root = root,
                                      .tag = tag};
        (void)before(call, gradsync::Buffer{});
        forward_now([&] {
            if constexpr (requires { inner_.broadcast(bytes, root, tag); })
                inner_.broadcast(bytes, root, tag);
            else
                inner_.broadcast(bytes, root);
        });
    }
    void barrier() {
        (void)before(gradsync::CollectiveCall{.kind = gradsync::CollectiveKind::barrier, .seq = calls_ + 1},
                     gradsync::Buffer{});
        forward_now([&] { inner_.barrier(); });
    }

    void abort(const std::string& reason) requires gradsync::Abortable<B> {
        aborted_->store(true);
        inner_.abort(reason);
    }
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) requires gradsync::StatusReporting<B> {
        return inner_.add_status_reporter(std::move(reporter));
    }
    void remove_status_reporter(std::uint64_t id) requires gradsync::StatusReporting<B> {
        inner_.remove_status_reporter(id);
    }
    [[nodiscard]] std::string peer_status(int r) const requires gradsync::PeerStatus<B> {
        return inner_.peer_status(r);
    }
    [[nodiscard]] std::uint64_t peer_collectives(int r) const requires gradsync::PeerStatus<B> {
        return inner_.peer_collectives(r);
    }

private:
    gradsync::CollectiveCall describe(std::size_t count, gradsync::DType t, gradsync::ReduceOp op,
                                      gradsync::CollectiveTag tag) const {
        return {.kind = gradsync::CollectiveKind::allreduce,
                .seq = calls_ + 1,
                .count = count,
                .dtype = t,
                .op = op,
                .tag = tag};
    }

    // Counts the call and carries out the misbehaviour planned for it, but for those that need
    // the call's handle (vanish, swap_with_next), which it returns.
    std::optional<Fault> before(const gradsync::CollectiveCall& call, std::span<const gradsync::Segment> segs,
                                gradsync::DType t) {
        ++calls_;
        std::optional<Fault> fault;
        for (const auto& f : faults_)
            if (f.at_call == calls_) fault = f;
        if (!fault) return fault;
        const std::string who = "rank " + std::to_string(rank()) + " ";
        switch (fault->kind) {
            case Fault::Kind::delay: std::this_thread::sleep_for(fault->delay); break;
            case Fault::Kind::throw_error: {
                const std::string what = "gradsync: injected fault: " + who + "throws at " + call.describe();
                if constexpr (gradsync::Abortable<B>) abort(what);
                throw InjectedFault(what);
            }
            case Fault::Kind::plant_nan: plant_nan(segs, t); break;
            case Fault::Kind::vanish:
            case Fault::Kind::swap_with_next: return fault;
        }
        return std::nullopt;
    }
    std::optional<Fault> before(const gradsync::CollectiveCall& call, gradsync::Buffer buf) {
        const gradsync::Segment seg{buf.data, buf.count};
        return before(call, std::span(&seg, buf.data != nullptr ? 1 : 0), buf.dtype);
    }

    template <class F>
    void forward_now(F&& issue) {
        if (vanished_) {
            while (!aborted_->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            throw gradsync::CollectiveError("gradsync: injected fault: rank " + std::to_string(rank()) +
                                            " takes part in nothing any more");
        }
        release_held();
        issue();
    }

    template <class Issue>
    Handle launch(const gradsync::CollectiveCall& call, std::span<const gradsync::Segment> segs, gradsync::DType t,
                  Issue issue) {
        const auto fault = before(call, segs, t);
        auto state = std::make_shared<State>();
        state->aborted = aborted_.get();
        state->what = "rank " + std::to_string(rank()) + " " + call.describe();
        if (fault && fault->kind == Fault::Kind::vanish) vanished_ = true;
        if (vanished_) return Handle(state);  // never issued
        if (fault && fault->kind == Fault::Kind::swap_with_next) {
            held_ = [state, issue] { state->inner.emplace(issue()); };  // issued after the next call
            return Handle(state);
        }
        state->inner.emplace(issue());
        release_held();
        return Handle(state);
    }

    void release_held() {
        if (!held_) return;
        auto held = std::move(held_);
        held_ = nullptr;
        held();
    }

    static void plant_nan(std::span<const gradsync::Segment> segs, gradsync::DType t) {
        for (const auto& seg : segs) {
            if (seg.count == 0) continue;
            gradsync::detail::visit_float_dtype(t, [&]<class T>(gradsync::detail::type_tag<T>) {
                *static_cast<T*>(seg.data) = T(std::numeric_limits<float>::quiet_NaN());
            });
            return;
        }
    }

    B& inner_;
    std::vector<Fault> faults_;
    std::uint64_t calls_ = 0;
    std::function<void()> held_;  // a call a swap_with_next fault holds back
    bool vanished_ = false;       // a vanish fault struck: nothing is issued any more
    std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace testing_support
