// The stand-in CUDA runtime's shared state (device_state.hpp) and the test-facing controls of
// standin.hpp that concern it.
#include "device_state.hpp"

#include "standin.hpp"

#include <array>
#include <cstdio>
#include <utility>  // for std::move

namespace standin::detail {
namespace {

// The handles of one kind the runtime gave out, each owned until destroyed (work queued on a
// stream keeps what it uses alive beyond that).
template <class T>
struct HandleTable {
    std::map<T*, std::shared_ptr<T>> owned;

    void add(std::shared_ptr<T> h) { owned[h.get()] = std::move(h); }
    std::shared_ptr<T> remove(T* h) {
        const auto it = owned.find(h);
        if (it == owned.end()) return nullptr;
        auto out = std::move(it->second);
        owned.erase(it);
        return out;
    }
    [[nodiscard]] std::shared_ptr<T> find(T* h) const {
        const auto it = owned.find(h);
        return it == owned.end() ? nullptr : it->second;
    }
};

struct Registry {
    std::mutex mutex;  // everything below
    HandleTable<CUstream_st> streams;
    HandleTable<CUevent_st> events;
    std::array<std::shared_ptr<CUstream_st>, max_devices> legacy{};  // made on first use
    std::vector<std::string> misuses;
    std::array<int, max_devices> contexts{};
};

Registry& registry() {
    static auto* r = new Registry;  // never destroyed: stream threads may outlive main
    return *r;
}

std::shared_ptr<CUstream_st> legacy_stream(int device) {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    auto& s = r.legacy[std::size_t(device)];
    if (!s) {
        s = std::make_shared<CUstream_st>();
        s->device = device;
        s->legacy = true;
        s->queue = WorkQueue::start();
    }
    return s;
}

// Queues on `waiter` a wait for what `other` was given so far.
void wait_for(CUstream_st& waiter, const CUstream_st& other) {
    const std::uint64_t ticket = other.queue->last_ticket();
    if (other.queue->done(ticket)) return;
    waiter.queue->push([queue = other.queue, ticket] { queue->wait_done(ticket); });
}

}  // namespace

ThreadState& this_thread() {
    thread_local ThreadState state;
    return state;
}

void report_misuse(std::string what) {
    std::fprintf(stderr, "stand-in CUDA/NCCL: misuse: %s\n", what.c_str());
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    r.misuses.push_back(std::move(what));
}

namespace {
struct Memory {
    std::mutex mutex;
    std::map<std::uintptr_t, Allocation> by_begin;
};
Memory& memory() {
    static auto* m = new Memory;
    return *m;
}
}  // namespace

void add_allocation(const Allocation& a) {
    auto& m = memory();
    std::lock_guard lock(m.mutex);
    m.by_begin[a.begin] = a;
}

std::optional<Allocation> remove_allocation(const void* p) {
    auto& m = memory();
    std::lock_guard lock(m.mutex);
    const auto it = m.by_begin.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == m.by_begin.end()) return std::nullopt;
    Allocation a = it->second;
    m.by_begin.erase(it);
    return a;
}

std::optional<Allocation> find_allocation(const void* p) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    auto& m = memory();
    std::lock_guard lock(m.mutex);
    auto it = m.by_begin.upper_bound(at);
    if (it == m.by_begin.begin()) return std::nullopt;
    --it;
    const Allocation& a = it->second;
    if (at < a.begin + a.size || (a.size == 0 && at == a.begin)) return a;
    return std::nullopt;
}

// Each under the registry's lock.
template <class Fn>
auto locked(Fn&& fn) {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    return fn(r);
}

void add_stream(std::shared_ptr<CUstream_st> s) {
    locked([&](Registry& r) { r.streams.add(std::move(s)); });
}
std::shared_ptr<CUstream_st> remove_stream(cudaStream_t s) {
    return locked([&](Registry& r) { return r.streams.remove(s); });
}
std::shared_ptr<CUstream_st> find_stream(cudaStream_t s) {
    return locked([&](Registry& r) { return r.streams.find(s); });
}

std::shared_ptr<CUstream_st> resolve_stream(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy) return legacy_stream(this_thread().device);
    return find_stream(s);
}

void add_event(std::shared_ptr<CUevent_st> e) {
    locked([&](Registry& r) { r.events.add(std::move(e)); });
}
std::shared_ptr<CUevent_st> remove_event(cudaEvent_t e) {
    return locked([&](Registry& r) { return r.events.remove(e); });
}
std::shared_ptr<CUevent_st> find_event(cudaEvent_t e) {
    return locked([&](Registry& r) { return r.events.find(e); });
}

std::vector<std::shared_ptr<CUstream_st>> streams_of(int device) {
    std::vector<std::shared_ptr<CUstream_st>> out;
    auto legacy = legacy_stream(device);
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    out.push_back(std::move(legacy));
    for (const auto& [handle, s] : r.streams.owned)
        if (s->device == device) out.push_back(s);
    return out;
}

void enqueue(CUstream_st& stream, std::function<void()> task) {
    // The default stream waits for every blocking stream of its device, and they for it.
    if (stream.legacy) {
        for (const auto& other : streams_of(stream.device))
            if (other->blocking) wait_for(stream, *other);
    } else if (stream.blocking) {
        wait_for(stream, *legacy_stream(stream.device));
    }
    stream.queue->push(std::move(task));
}

void note_context(int device) {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    ++r.contexts[std::size_t(device)];
}

int device_for_call(const char* call) {
    auto& t = this_thread();
    if (!t.chosen && !t.context)
        report_misuse(std::string(call) + " from a thread that never called cudaSetDevice: it runs on device 0");
    if (!t.context) {
        t.context = true;
        note_context(t.device);
    }
    return t.device;
}

std::atomic<int>& device_count() {
    static std::atomic<int> count{4};
    return count;
}

}  // namespace standin::detail

namespace standin {

void set_device_count(int n) { detail::device_count().store(n); }

std::vector<std::string> take_misuses() {
    auto& r = detail::registry();
    std::lock_guard lock(r.mutex);
    return std::exchange(r.misuses, {});
}

int contexts_made(int device) {
    auto& r = detail::registry();
    std::lock_guard lock(r.mutex);
    return r.contexts[std::size_t(device)];
}

std::uint64_t host_waits() { return detail::this_thread().waits; }

}  // namespace standin

// For a test compiled once and linked against either the real runtime or this one: it finds
// this through a weak declaration, null where the real runtime is linked.
extern "C" std::uint64_t gradsync_standin_host_waits() { return standin::host_waits(); }

namespace standin {

void slow_stream(cudaStream_t stream, std::chrono::microseconds delay) {
    if (auto s = detail::resolve_stream(stream)) s->queue->set_delay(delay);
}

}  // namespace standin
