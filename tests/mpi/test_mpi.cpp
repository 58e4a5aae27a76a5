// MpiBackend and DataParallel<Model, MpiBackend> across processes. Run under mpirun with 2, 3 and
// 4 processes (ctest does, also over TCP): every process runs every test case, and a check that
// fails on one rank fails the whole run. Results are compared across ranks through plain MPI.
#include "mpi/doctest_main.hpp"

#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/mpi.hpp>
#include <gradsync/checkpoint/path_lock.hpp>  // for lock_path_of
#include <gradsync/gradsync.hpp>

#include "mlp.hpp"
#include "support/fake_env.hpp"
#include "support/faulty_backend.hpp"
#include "support/generic_trainer.hpp"
#include "support/half_gradients.hpp"
#include "support/resume_run.hpp"
#include "support/sharded_checks.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_resume.hpp"
#include "support/sharded_training.hpp"
#include "support/toy_model.hpp"

#include <unistd.h>  // for getpid

#include <filesystem>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>  // for setenv, unsetenv
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>  // for std::type_identity
#include <utility>      // for std::pair
#include <vector>

using namespace gradsync::literals;

namespace {

int world_rank() {
    int r = 0;
    MPI_Comm_rank(gradsync::mpi_world(), &r);
    return r;
}
int world_size() {
    int n = 1;
    MPI_Comm_size(gradsync::mpi_world(), &n);
    return n;
}

// Every rank's copy of `bytes`, gathered on every rank.
std::vector<std::vector<std::byte>> gather_all(std::span<const std::byte> bytes) {
    const int n = world_size();
    int mine = static_cast<int>(bytes.size());
    std::vector<int> sizes(static_cast<std::size_t>(n));
    MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, gradsync::mpi_world());
    std::vector<int> offsets(static_cast<std::size_t>(n), 0);
    for (int i = 1; i < n; ++i) offsets[std::size_t(i)] = offsets[std::size_t(i - 1)] + sizes[std::size_t(i - 1)];
    std::vector<std::byte> all(static_cast<std::size_t>(offsets.back() + sizes.back()));
    MPI_Allgatherv(bytes.data(), mine, MPI_BYTE, all.data(), sizes.data(), offsets.data(), MPI_BYTE,
                   gradsync::mpi_world());
    std::vector<std::vector<std::byte>> out;
    for (int i = 0; i < n; ++i)
        out.emplace_back(all.begin() + offsets[std::size_t(i)],
                         all.begin() + offsets[std::size_t(i)] + sizes[std::size_t(i)]);
    return out;
}

template <class T>
bool same_on_every_rank(const std::vector<T>& v) {
    auto all = gather_all(std::as_bytes(std::span(v)));
    for (const auto& a : all)
        if (a != all[0]) return false;
    return true;
}

// Element i of rank r's input: small whole numbers, so sums are exact in every dtype.
float input_value(int rank, std::size_t i) { return float((rank + 1) * int(1 + i % 7)); }
float expected_sum(std::size_t i) {
    float s = 0;
    for (int r = 0; r < world_size(); ++r) s += input_value(r, i);
    return s;
}

template <class T>
void check_allreduce(gradsync::MpiBackend& backend, std::size_t n, gradsync::ReduceOp op) {
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(input_value(backend.rank(), i));
    backend.allreduce(std::span(data), op);
    const float divisor = op == gradsync::ReduceOp::average ? float(world_size()) : 1.0f;
    for (std::size_t i = 0; i < n; ++i) {
        // Rounded like the backend: the sum is exact, the average rounds once to T.
        const T expected = T(expected_sum(i) / divisor);
        if (float(data[i]) != float(expected)) {
            CAPTURE(i);
            CHECK(float(data[i]) == float(expected));
            break;
        }
    }
    CHECK(same_on_every_rank(data));
}

template <class T>
void check_all_ops(std::size_t n) {
    using gradsync::MpiAlgorithm;
    for (auto algorithm : {MpiAlgorithm::automatic, MpiAlgorithm::mpi_allreduce, MpiAlgorithm::ring}) {
        for (auto chunk : {4_MiB, 4_KiB}) {  // one piece, or many
            CAPTURE(int(algorithm));
            CAPTURE(chunk.count());
            gradsync::MpiOptions options;
            options.algorithm = algorithm;
            options.chunk = chunk;
            gradsync::MpiBackend backend(gradsync::mpi_world(), options);
            check_allreduce<T>(backend, n, gradsync::ReduceOp::sum);
            check_allreduce<T>(backend, n, gradsync::ReduceOp::average);
        }
    }
}

}  // namespace

TEST_CASE("MpiBackend: rank and size are the communicator's; the place agrees with the launcher's variables") {
    gradsync::MpiBackend backend;
    CHECK(backend.rank() == world_rank());
    CHECK(backend.size() == world_size());
    auto place = gradsync::mpi_process_place();
    CHECK(place.rank == world_rank());
    CHECK(place.world_size == world_size());
    CHECK(place.local_world_size == world_size());  // one machine
    auto from_env = gradsync::process_place();      // mpirun's OMPI_COMM_WORLD_* or RANK/WORLD_SIZE
    CHECK(from_env.rank == place.rank);
    CHECK(from_env.world_size == place.world_size);
    CHECK(from_env.local_rank == place.local_rank);
    CHECK(from_env.local_world_size == place.local_world_size);
}

namespace {

// Sets environment variables for its lifetime, and puts back what was there.
class EnvOverride {
public:
    EnvOverride() = default;
    EnvOverride(const EnvOverride&) = delete;
    EnvOverride& operator=(const EnvOverride&) = delete;
    ~EnvOverride() {
        for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
            if (it->second)
                setenv(it->first.c_str(), it->second->c_str(), 1);
            else
                unsetenv(it->first.c_str());
        }
    }
    void set(const std::string& name, const std::string& value) {
        const char* old = std::getenv(name.c_str());
        saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
        setenv(name.c_str(), value.c_str(), 1);
    }

private:
    std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// What mpi_process_place() throws, or "".
std::string place_refusal() {
    try {
        (void)gradsync::mpi_process_place();
    } catch (const gradsync::Error& e) {
        return e.what();
    }
    return {};
}

}  // namespace

TEST_CASE("a launcher's LOCAL_RANK/LOCAL_WORLD_SIZE that differ from where MPI finds the processes are refused") {
    if (world_size() < 2) return;  // one process is alone on its machine either way
    std::string what;
    {
        // Each process told it is alone on its machine, as two launchers on one machine would.
        EnvOverride env;
        env.set("RANK", std::to_string(world_rank()));
        env.set("WORLD_SIZE", std::to_string(world_size()));
        env.set("LOCAL_RANK", "0");
        env.set("LOCAL_WORLD_SIZE", "1");
        what = place_refusal();
    }
    CHECK(what.find("LOCAL_RANK/LOCAL_WORLD_SIZE say local rank 0 of 1 on this machine, but MPI finds " +
                    std::to_string(world_size()) + " processes of the job here") != std::string::npos);
    CHECK(gradsync::mpi_process_place().local_world_size == world_size());  // as the launcher says again
}

TEST_CASE("RANK and WORLD_SIZE handed to every process mpirun started are named as such (not as a missing join)") {
    if (world_size() < 2 || std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return;  // started by mpirun only
    std::string what;
    {
        EnvOverride env;
        env.set("RANK", "0");
        env.set("WORLD_SIZE", std::to_string(world_size()));
        what = place_refusal();
    }
    if (world_rank() == 0) {
        CHECK(what.empty());  // rank 0 of them all is right here
    } else {
        CAPTURE(what);
        CHECK(what.find("RANK/WORLD_SIZE say rank 0 of " + std::to_string(world_size()) +
                        ", but an MPI launcher started this process as rank " + std::to_string(world_rank())) !=
              std::string::npos);
        CHECK(what.find("were given to every process") != std::string::npos);
    }
}

TEST_CASE("MpiBackend: allreduce sum and average, every floating dtype and algorithm, one or many pieces") {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{100'003}}) {
        CAPTURE(n);
        check_all_ops<float>(n);
        check_all_ops<double>(n);
        check_all_ops<gradsync::float16>(n);
        check_all_ops<gradsync::bfloat16>(n);
    }
}

TEST_CASE("the name a job's ranks meet under: paddle.distributed.launch's endpoints name a job, and two jobs differ") {
    const gradsync::ProcessPlace place{1, 4, 1, 2, "PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM"};
    fake_env::variables = {{"PADDLE_TRAINER_ID", "1"}, {"PADDLE_TRAINERS_NUM", "4"}};
    CHECK(gradsync::detail::join_service(place, fake_env::lookup).empty());  // nothing names it: refused
    fake_env::variables["PADDLE_TRAINER_ENDPOINTS"] = "127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172,127.0.0.1:6173";
    const auto one = gradsync::detail::join_service(place, fake_env::lookup);
    fake_env::variables["PADDLE_TRAINER_ENDPOINTS"] = "127.0.0.1:6270,127.0.0.1:6271,127.0.0.1:6272,127.0.0.1:6273";
    const auto other = gradsync::detail::join_service(place, fake_env::lookup);
    CHECK_FALSE(one.empty());
    CHECK(one != other);
    fake_env::variables.clear();
}

TEST_CASE("the name a job's ranks meet under: a long job id is named by its hash, short enough for the name service") {
    const gradsync::ProcessPlace place{1, 4, 1, 4, "RANK/WORLD_SIZE"};
    fake_env::variables = {{"GRADSYNC_JOB_ID", std::string(5000, 'a')}};
    const auto one = gradsync::detail::join_service(place, fake_env::lookup);
    CHECK(one.size() < 128);
    CHECK(one.find(":identity-hash=") != std::string::npos);
    CHECK(gradsync::detail::join_service(place, fake_env::lookup) == one);  // the same on every rank
    fake_env::variables["GRADSYNC_JOB_ID"] = std::string(4999, 'a') + "b";
    CHECK(gradsync::detail::join_service(place, fake_env::lookup) != one);  // another job
    fake_env::variables["GRADSYNC_JOB_ID"] = "short";
    CHECK(gradsync::detail::join_service(place, fake_env::lookup) == "gradsync:GRADSYNC_JOB_ID=short:world=4");
    fake_env::variables.clear();
}

TEST_CASE(
    "over MPI, two DataParallel objects of one layout stepped in another order on one rank are caught at that step") {
    gradsync::MpiBackend backend;
    testing_support::Toy first({100, 200}, 0.0f), second({100, 200}, 0.0f);
    gradsync::DataParallel a(first, backend), c(second, backend);
    const bool last = backend.rank() == world_size() - 1;
    std::string what;
    try {
        first.fill_grads(backend.rank());
        second.fill_grads(backend.rank());
        // The step number is the same on every rank: only the wrappers' histories tell them apart.
        auto& one = last ? c : a;
        auto& other = last ? a : c;
        one.synchronize(gradsync::StepNumber{0});
        other.synchronize(gradsync::StepNumber{0});
    } catch (const gradsync::CollectiveError& e) {
        what = e.what();
    }
    CHECK(what.find("the ranks' collective histories diverged") != std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(what.begin(), what.end())));
}

TEST_CASE("over MPI, a huge timeout means wait forever: overlapped steps with a slow rank reduce as usual") {
    gradsync::MpiOptions options;
    options.timeout = std::chrono::milliseconds::max();  // now + timeout would overflow
    gradsync::MpiBackend backend(gradsync::mpi_world(), options);
    testing_support::Toy m({1000, 3000, 200}, 0.0f);
    gradsync::DataParallel dp(m, backend, gradsync::PerParameterBuckets{},
                              gradsync::Options{.timeout = std::chrono::milliseconds::max()});
    int wrong = 0;
    for (int s = 0; s < 3; ++s) {
        m.fill_grads(backend.rank());
        if (backend.rank() == world_size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
        dp.synchronize();
        for (std::size_t k = 0; k < 3; ++k)
            if (m.tensors[k].g[11] != testing_support::expected_average<float>(world_size(), k, 11)) ++wrong;
    }
    CHECK(wrong == 0);
}

TEST_CASE("MpiBackend: scattered segments, large ones in place and small ones packed, all reduced") {
    gradsync::MpiOptions options;
    options.chunk = 8_KiB;
    options.pack_below = 1_KiB;
    options.ring_min = 2_KiB;  // the ring for most pieces, MPI_Allreduce for the rest
    gradsync::MpiBackend backend(gradsync::mpi_world(), options);
    // Sizes straddle pack_below (256 floats) and chunk (2048 floats); a zero-sized one too. A small
    // segment alone is reduced where it lies, several are packed together.
    std::vector<std::size_t> sizes{3, 5000, 0, 255, 256, 1, 2048, 700, 9000, 17};
    SUBCASE("sizes around the limits") {}
    SUBCASE("one small segment alone") { sizes = {5000, 0, 17, 3000}; }
    SUBCASE("only one small segment") { sizes = {100}; }
    SUBCASE("more small segments than one chunk holds") { sizes = std::vector<std::size_t>(20, 200); }
    for (const bool asynchronous : {false, true}) {
        CAPTURE(asynchronous);
        std::vector<std::vector<float>> tensors;
        std::vector<gradsync::Segment> segments;
        std::size_t base = 0;
        for (auto n : sizes) {
            tensors.emplace_back(n);
            for (std::size_t i = 0; i < n; ++i) tensors.back()[i] = input_value(backend.rank(), base + i);
            base += n;
        }
        for (auto& t : tensors) segments.push_back({t.data(), t.size()});
        if (asynchronous) {
            auto h = backend.allreduce_async(segments, gradsync::DType::float32, gradsync::ReduceOp::average);
            h.wait();
            CHECK(h.ready());
        } else {
            backend.allreduce(segments, gradsync::DType::float32, gradsync::ReduceOp::average);
        }
        base = 0;
        for (auto& t : tensors) {
            for (std::size_t i = 0; i < t.size(); ++i) REQUIRE(t[i] == expected_sum(base + i) / float(world_size()));
            base += t.size();
        }
    }
}

TEST_CASE("MpiBackend: reduce_scatter and all_gather, sizes that do not divide by the ranks, in one or many rounds") {
    static_assert(gradsync::ShardedCollectives<gradsync::MpiBackend>);
    static_assert(gradsync::TimedCollectives<gradsync::MpiBackend>);  // its deadline is known
    static_assert(gradsync::detail::check_sharded_collectives<gradsync::MpiBackend>());
    gradsync::MpiOptions small_rounds;
    small_rounds.chunk = 4_KiB;  // 64 Ki elements in dozens of rounds
    for (const auto& options : {gradsync::MpiOptions{}, small_rounds}) {
        gradsync::MpiBackend backend(gradsync::mpi_world(), options);
        // The ring sums in its own order: close to the rank-ordered sum, and every rank alike.
        sharded::check_contract(backend, /*exact=*/false);
    }
    gradsync::MpiBackend backend;
    std::vector<float> v(100'003);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input_value(backend.rank(), i);
    backend.reduce_scatter(std::span<float>(v), gradsync::ReduceOp::average);
    backend.all_gather(std::span<float>(v));
    const auto all = gather_all(std::as_bytes(std::span<const float>(v)));
    for (const auto& other : all) CHECK(std::memcmp(other.data(), all[0].data(), all[0].size()) == 0);
    std::vector<std::int64_t> ids(7, -1);
    const auto mine = gradsync::shard_of(ids.size(), backend.size(), backend.rank());
    for (std::size_t i = mine.offset; i < mine.offset + mine.count; ++i) ids[i] = std::int64_t(i) * 3;
    backend.all_gather(gradsync::Buffer{ids.data(), ids.size(), gradsync::DType::int64});
    for (std::size_t i = 0; i < ids.size(); ++i) CHECK(ids[i] == std::int64_t(i) * 3);
    std::int32_t counters[4] = {};
    CHECK_THROWS_WITH_AS(backend.reduce_scatter(gradsync::Buffer{counters, 4, gradsync::DType::int32}),
                         doctest::Contains("MpiBackend cannot reduce int32"), gradsync::CollectiveError);
}

TEST_CASE("MpiBackend: reduce_scatter and all_gather over segments cut differently on every rank == over a buffer") {
    static_assert(gradsync::ScatteredShardedCollectives<gradsync::MpiBackend>);
    gradsync::MpiOptions small_rounds;
    small_rounds.chunk = 4_KiB;  // parts that cross many segments, in many rounds
    for (const auto& options : {gradsync::MpiOptions{}, small_rounds}) {
        gradsync::MpiBackend backend(gradsync::mpi_world(), options);
        const std::size_t n = 10'007;
        std::vector<float> flat(n), cut(n);
        for (std::size_t i = 0; i < n; ++i) flat[i] = cut[i] = input_value(backend.rank(), i) * 0.37f;
        // Rank r cuts its buffer every 97 * (r + 1) elements, with an empty segment at each cut.
        std::vector<gradsync::Segment> segments;
        const std::size_t step = 97 * static_cast<std::size_t>(backend.rank() + 1);
        for (std::size_t at = 0; at < n; at += step) {
            segments.push_back({cut.data() + at, std::min(step, n - at)});
            segments.push_back({cut.data() + at, 0});
        }
        backend.reduce_scatter(std::span<float>(flat), gradsync::ReduceOp::average);
        backend.reduce_scatter_async(segments, gradsync::DType::float32, gradsync::ReduceOp::average).wait();
        const auto mine = gradsync::shard_of(n, backend.size(), backend.rank());
        CHECK(std::memcmp(cut.data() + mine.offset, flat.data() + mine.offset, mine.count * sizeof(float)) == 0);
        backend.all_gather(std::span<float>(flat));
        backend.all_gather_async(segments, gradsync::DType::float32).wait();
        CHECK(cut == flat);  // the same bits as the buffer's
        CHECK(same_on_every_rank(cut));
        CHECK(std::fabs(cut[5] - expected_sum(5) * 0.37f / float(backend.size())) <= 1e-5f * std::fabs(cut[5]));
    }
}

TEST_CASE("MpiBackend: asynchronous collectives complete in launch order, then synchronous ones") {
    gradsync::MpiBackend backend;
    std::vector<std::vector<double>> bufs(5, std::vector<double>(10'000));
    for (auto& b : bufs)
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = input_value(backend.rank(), i);
    std::vector<gradsync::CollectiveHandle> handles;
    for (auto& b : bufs)
        handles.push_back(backend.allreduce_async(gradsync::buffer_of(std::span(b)), gradsync::ReduceOp::sum));
    std::vector<double> last(4, double(backend.rank()));
    backend.allreduce(std::span(last), gradsync::ReduceOp::sum);  // waits for the ones before it
    for (auto& h : handles) CHECK(h.ready());
    for (auto& b : bufs) CHECK(b[12] == double(expected_sum(12)));
    CHECK(last[0] == double(world_size() * (world_size() - 1) / 2));
}

TEST_CASE("MpiBackend: broadcast from every root, and a barrier") {
    gradsync::MpiBackend backend;
    for (int root = 0; root < backend.size(); ++root) {
        std::vector<std::uint32_t> v(1000, 0);
        if (backend.rank() == root)
            for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::uint32_t(root * 100000 + int(i));
        backend.broadcast(std::span(v), root);
        CHECK(v[999] == std::uint32_t(root * 100000 + 999));
    }
    backend.barrier();
    CHECK_THROWS_WITH_AS(backend.broadcast(std::span<std::byte>(), backend.size()),
                         doctest::Contains("broadcast from rank"), gradsync::CollectiveError);
}

TEST_CASE(
    "MpiBackend: a collective after a rank has left is refused at once, naming the rank and its last collective") {
    if (world_size() < 2) return;
    const int leaver = world_size() - 1;
    gradsync::MpiOptions options;
    options.timeout = std::chrono::seconds(60);
    options.peer_poll = std::chrono::milliseconds(10);
    std::optional<gradsync::MpiBackend> backend(std::in_place, gradsync::mpi_world(), options);
    // The ranks that stay wait for each other before they destroy their backends (this is declared
    // after the backend, so it goes first), or a slow one would find a fast one departed too.
    struct Stayers {
        MPI_Comm comm = MPI_COMM_NULL;
        bool staying = false;
        ~Stayers() {
            if (staying) MPI_Barrier(comm);
            MPI_Comm_free(&comm);
        }
    } stayers;
    MPI_Comm_split(gradsync::mpi_world(), world_rank() == leaver ? 1 : 0, world_rank(), &stayers.comm);
    std::vector<float> v(100, 1.0f);
    backend->allreduce(std::span(v));  // collective #1, a sum by default
    CHECK(v[0] == float(world_size()));
    if (backend->rank() == leaver) {
        backend.reset();  // returns once every peer has destroyed its backend too
        return;
    }
    stayers.staying = true;
    const auto begin = std::chrono::steady_clock::now();
    while (backend->departed_peers().empty() && std::chrono::steady_clock::now() - begin < std::chrono::seconds(30))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(backend->departed_peers() == std::vector<int>{leaver});
    CHECK(std::chrono::steady_clock::now() - begin < std::chrono::seconds(10));  // not the 60 s deadline
    std::string message;
    try {
        backend->allreduce(std::span(v));
    } catch (const gradsync::CollectiveError& e) {
        message = e.what();
    }
    CHECK(message.find("allreduce #2 of 100 x float32") != std::string::npos);
    CHECK(message.find("cannot complete: rank " + std::to_string(leaver) +
                       " has left the group (destroyed its MpiBackend) after its collective #1") != std::string::npos);
}

TEST_CASE("MpiBackend: a dtype it cannot reduce is an exception, not a wrong answer") {
    gradsync::MpiBackend backend;
    std::vector<std::int32_t> v(4, 1);
    CHECK_FALSE(backend.supports(gradsync::DType::int32));
    CHECK_THROWS_WITH_AS(backend.allreduce(std::span(v), gradsync::ReduceOp::sum),
                         doctest::Contains("cannot reduce int32"), gradsync::CollectiveError);
}

TEST_CASE("FaultyBackend over MpiBackend: a NaN planted on the last rank reaches every rank; a delay is no failure") {
    gradsync::MpiBackend mpi;
    testing_support::FaultyBackend<gradsync::MpiBackend> backend(mpi);
    const int last = mpi.size() - 1;
    if (mpi.rank() == last) {
        backend.inject({.kind = testing_support::Fault::Kind::plant_nan, .at_call = 1});
        backend.inject(
            {.kind = testing_support::Fault::Kind::delay, .at_call = 2, .delay = std::chrono::milliseconds(50)});
    }
    std::vector<float> v(1000, 1.0f);
    backend.allreduce_async(gradsync::Buffer{v.data(), v.size(), gradsync::DType::float32}, gradsync::ReduceOp::sum)
        .wait();
    CHECK(std::isnan(v[0]));
    CHECK(v[1] == float(mpi.size()));
    std::vector<double> d(3, 2.0);
    backend.allreduce(gradsync::Buffer{d.data(), d.size(), gradsync::DType::float64}, gradsync::ReduceOp::average);
    CHECK(d == std::vector<double>(3, 2.0));
    CHECK(backend.calls_made() == 2);
}

// The equivalence test across processes: N ranks with micro-batch b == one process with N*b.
namespace {

constexpr int steps = 12;
constexpr int micro_batch = 8;

std::vector<float> train_single(int world) {
    mlp::Mlp model(1);
    mlp::Sgd opt(0.05f, 0.9f);
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(mlp::make_batch(2026, std::size_t(s * world * micro_batch), world * micro_batch));
        opt.step(model);
    }
    return resume::flat(model);
}

template <class... Policies>
std::vector<float> train_parallel(bool overlap, Policies... policies) {
    gradsync::MpiBackend backend;
    mlp::Mlp model(1 + std::uint64_t(backend.rank()) * 1000);  // replaced by rank 0's at construction
    gradsync::DataParallel dp(model, backend, policies...);
    if (overlap) model.on_grad_ready = [&dp](std::size_t i) { dp.grad_ready(i); };
    mlp::Sgd opt(0.05f, 0.9f);
    const int world = backend.size();
    for (int s = 0; s < steps; ++s) {
        auto first = std::size_t(s * world * micro_batch + backend.rank() * micro_batch);
        model.forward_backward(mlp::make_batch(2026, first, micro_batch));
        dp.synchronize();
        opt.step(model);
    }
    return resume::flat(model);
}

// ||a - b|| / ||b||
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
        diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        norm += double(b[i]) * b[i];
    }
    return std::sqrt(diff / norm);
}

// Every rank holds the same bits, close to the single process's.
void check_close(const std::vector<float>& parallel, const std::vector<float>& single, double tolerance = 1e-5) {
    CHECK(relative_difference(parallel, single) <= tolerance);
    CHECK(same_on_every_rank(parallel));
}

}  // namespace

TEST_CASE("equivalence over MPI: N processes with micro-batch b == one process with batch N*b") {
    const auto single = train_single(world_size());
    SUBCASE("default buckets, after backward") { check_close(train_parallel(false), single); }
    SUBCASE("small buckets, overlapped with backward") {
        check_close(train_parallel(true, gradsync::SizeCappedBuckets{64_KiB, 4_KiB}), single);
    }
    SUBCASE("one bucket, packed") {
        check_close(train_parallel(false, gradsync::SingleBucket{}, gradsync::PackedBuckets{}), single);
    }
    SUBCASE("a bucket per parameter, overlapped") {
        check_close(train_parallel(true, gradsync::PerParameterBuckets{}), single);
    }
}

TEST_CASE("sharded over MPI: optimizer state split across processes == one process with the whole batch") {
    // Stage 1 on the example MLP; stage 2 (gradients released once reduced) on the MLP that frees
    // them: the same bits.
    // `behind`: the all-gathers left in flight by step(), waited for by the next forward.
    auto train = [&](auto model_type, const gradsync::SizeCappedBuckets& caps, bool overlap, bool release,
                     bool behind = false) {
        using Model = typename decltype(model_type)::type;
        gradsync::MpiBackend backend;
        Model model(1 + std::uint64_t(backend.rank()) * 1000);  // replaced by rank 0's at construction
        gradsync::ShardedDataParallel sdp(
            model, backend, caps,
            gradsync::ShardedOptions{.release_gradients = release, .gather_behind_forward = behind});
        if (overlap) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
        if (behind) model.before_read = [&](std::size_t i) { sdp.param_ready(i); };
        sharded::ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        const int world = backend.size();
        for (int s = 0; s < steps; ++s) {
            auto first = std::size_t(s * world * micro_batch + backend.rank() * micro_batch);
            model.forward_backward(mlp::make_batch(2026, first, micro_batch));
            CHECK(sdp.buckets_launched() == (overlap ? sdp.plan().buckets.size() : 0));
            CHECK(sdp.step(sgd).applied);
        }
        sdp.wait_for_parameters();  // no all-gather in flight beside the raw MPI call below
        // This rank's state is its share: the shares add up to every parameter once.
        std::uint64_t mine = sdp.state_elements(), all = 0;
        MPI_Allreduce(&mine, &all, 1, MPI_UINT64_T, MPI_SUM, gradsync::mpi_world());
        CHECK(all == sdp.parameter_elements());
        CHECK(mine * std::uint64_t(world) <= sdp.parameter_elements() + std::uint64_t(world) * 8);
        return resume::flat(model);
    };
    for (const auto& caps : {gradsync::SizeCappedBuckets{}, gradsync::SizeCappedBuckets{64_KiB, 4_KiB}})
        for (const bool overlap : {false, true}) {  // reduce_scatters started by grad_ready during backward
            CAPTURE(caps.settings());
            CAPTURE(overlap);
            const auto kept = train(std::type_identity<mlp::Mlp>{}, caps, overlap, false);
            check_close(kept, train_single(world_size()));
            CHECK(same_on_every_rank(kept));
            const auto released = train(std::type_identity<sharded::ReleasingMlp>{}, caps, overlap, true);
            CHECK(released == kept);  // float ==: bitwise here (no NaN)
            CHECK(train(std::type_identity<mlp::Mlp>{}, caps, overlap, false, /*behind=*/true) == kept);
        }
}

TEST_CASE("sharded over MPI: policies in any order, each process its own order, the same training") {
    // Every process gives the same policies, in an order of its own (by rank): they agree, and
    // the weights equal those of the run where every process gives them in one order.
    auto train = [&](bool own_order) {
        gradsync::MpiBackend backend;
        mlp::Mlp model(1 + std::uint64_t(backend.rank()) * 1000);
        const gradsync::SizeCappedBuckets caps{64_KiB, 4_KiB};
        const gradsync::ShardedOptions options{.clip_norm = 1e-3};
        const gradsync::StaticLossScale scale{.value = 128.0f};
        auto run = [&](auto& sdp) {
            sharded::ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            for (int s = 0; s < steps; ++s) {
                auto first = std::size_t(s * backend.size() * micro_batch + backend.rank() * micro_batch);
                model.forward_backward(mlp::make_batch(2026, first, micro_batch), sdp.loss_scale());
                const auto report = sdp.step(sgd);
                CHECK(report.applied);
                CHECK(report.clipped);
                CHECK(report.loss_scale == 128.0f);
            }
        };
        if (!own_order || backend.rank() % 3 == 0) {
            gradsync::ShardedDataParallel sdp(model, backend, caps, options, scale, gradsync::AverageBuffers{});
            run(sdp);
        } else if (backend.rank() % 3 == 1) {
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::AverageBuffers{}, scale, options, caps);
            run(sdp);
        } else {
            gradsync::ShardedDataParallel sdp(model, backend, scale, caps, gradsync::AverageBuffers{}, options);
            run(sdp);
        }
        return resume::flat(model);
    };
    const auto one_order = train(false);
    CHECK(same_on_every_rank(one_order));
    CHECK(train(true) == one_order);  // float ==: bitwise here (no NaN)
}

TEST_CASE("sharded over MPI with PowerSGD: the weights of DataParallel with PowerSGD, overlapped on odd ranks") {
    // The hook averages each bucket in place of the reduce-scatter and each process reads its
    // shard: with an elementwise optimizer, bitwise where DataParallel with the same hook ends.
    const gradsync::SizeCappedBuckets caps{64_KiB, 4_KiB};
    auto batch = [&](int s, int rank) {
        return mlp::make_batch(2026, std::size_t(s * world_size() * micro_batch + rank * micro_batch), micro_batch);
    };
    std::vector<float> unsharded, in_shards;
    {
        gradsync::MpiBackend backend;
        mlp::Mlp model(1);
        gradsync::DataParallel dp(model, backend, caps, gradsync::PowerSGD({.rank = 2}));
        mlp::Sgd opt(0.05f, 0.9f);
        for (int s = 0; s < steps; ++s) {
            model.forward_backward(batch(s, backend.rank()));
            (void)dp.step([&] { opt.step(model); });
        }
        unsharded = resume::flat(model);
    }
    {
        gradsync::MpiBackend backend;
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, gradsync::PowerSGD({.rank = 2}), caps);
        if (backend.rank() % 2 == 1) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
        sharded::ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        for (int s = 0; s < steps; ++s) {
            model.forward_backward(batch(s, backend.rank()));
            CHECK(sdp.step(sgd).applied);
        }
        if (world_size() > 1) CHECK(sdp.comm_hook().elements_sent() * 4 < sdp.comm_hook().elements_reduced());
        in_shards = resume::flat(model);
    }
    CHECK(same_on_every_rank(in_shards));
    CHECK(in_shards == unsharded);  // float ==: bitwise here (no NaN)
}

TEST_CASE("sharded over MPI: a rank that skipped an iteration is caught by its step number, before any update") {
    // The last rank skips iteration 2: its step() pairs with the others' iteration 2. Every rank
    // stops there with the same StepMismatch, and the histories compared in every step before it
    // (MpiBackend cannot compare tags itself) agreed.
    if (world_size() < 2) return;  // nobody to be out of step with
    gradsync::MpiBackend backend;
    const int last = world_size() - 1;
    testing_support::Toy model({3000, 2000}, 1.0f);
    gradsync::ShardedDataParallel sdp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
    auto sgd = [](std::span<const gradsync::ShardPiece<float>> pieces) {
        for (const auto& piece : pieces)
            for (std::size_t i = 0; i < piece.params.size(); ++i) piece.params[i] -= 0.1f * piece.grads[i];
    };
    std::string what;
    int stopped_at = -1;
    std::vector<float> before;
    for (int s = 0; s < 5; ++s) {
        if (s == 2 && world_rank() == last) continue;
        model.fill_grads(world_rank());
        before = model.tensors[0].w;
        try {
            (void)sdp.step(sgd, gradsync::StepNumber{static_cast<std::uint64_t>(s)});
        } catch (const gradsync::StepMismatch& e) {
            what = e.what();
            stopped_at = s;
            break;
        }
    }
    CHECK(stopped_at == (world_rank() == last ? 3 : 2));
    CHECK(what.find("step 3: the ranks are at different steps of the trainer: rank 0 passed step number 2 and rank " +
                    std::to_string(last) + " 3") != std::string::npos);
    CHECK(model.tensors[0].w == before);  // the mismatched step updated nothing
    CHECK(same_on_every_rank(model.tensors[0].w));
}

TEST_CASE("over MPI, bucket autotuning turns one bucket into a finer plan, the same on every rank") {
    gradsync::MpiBackend backend;
    // 16 x 1 MiB over a backward of about 24 ms: the collective's bytes, not its launch, decide, even
    // when other jobs share the cores.
    testing_support::Toy m(std::vector<std::size_t>(16, 256 * 1024), 0.0f);
    gradsync::DataParallel dp(m, backend, gradsync::SizeCappedBuckets{64_MiB, 64_MiB},
                              gradsync::Options{.autotune_buckets = true});
    int wrong = 0;
    std::vector<std::uint64_t> hashes;
    std::size_t first_choice = 0;  // buckets after it
    for (int s = 0; s < 3 * gradsync::detail::BucketTuner::steps_per_round; ++s) {
        m.fill_grads(backend.rank());
        for (std::size_t i = 16; i-- > 0;) {  // last layer first
            std::this_thread::sleep_for(std::chrono::microseconds(1500));
            dp.grad_ready(i);
        }
        dp.synchronize();
        hashes.push_back(dp.plan().hash());
        if (s + 1 == gradsync::detail::BucketTuner::steps_per_round) first_choice = dp.plan().buckets.size();
        for (std::size_t k = 0; k < 16; ++k)
            for (std::size_t i = 0; i < m.tensors[k].g.size(); i += 97)
                if (m.tensors[k].g[i] != testing_support::expected_average<float>(world_size(), k, i)) ++wrong;
    }
    CHECK(wrong == 0);
    CHECK(same_on_every_rank(hashes));
    // Measured with one bucket, all of its time counts as bandwidth: the first choice splits it.
    // (The second, with the latency measured too, depends on this machine's timing.)
    CHECK(first_choice > 1);
}

TEST_CASE("over MPI, bf16 wire compression with dynamic loss scaling trains close to float32") {
    const auto single = train_single(world_size());
    gradsync::MpiBackend backend;
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend, gradsync::Bf16Compression{}, gradsync::DynamicLossScale{});
    model.on_grad_ready = [&dp](std::size_t i) { dp.grad_ready(i); };
    mlp::Sgd opt(0.05f, 0.9f);
    int applied = 0;
    for (int s = 0; s < steps; ++s) {
        auto first = std::size_t(s * world_size() * micro_batch + backend.rank() * micro_batch);
        model.forward_backward(mlp::make_batch(2026, first, micro_batch), dp.loss_scale());
        applied += dp.step([&] { opt.step(model); }).applied ? 1 : 0;
    }
    CHECK(applied == steps);  // no overflow at this scale: the runs took the same steps
    check_close(resume::flat(model), single, /*tolerance=*/1e-2);
}

TEST_CASE("over MPI, PowerSGD overlapped with backward keeps every process bitwise equal, sending a fraction") {
    gradsync::MpiBackend backend;
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 4}));
    model.on_grad_ready = [&dp](std::size_t i) { dp.grad_ready(i); };
    mlp::Sgd opt(0.05f, 0.9f);
    for (int s = 0; s < steps; ++s) {
        auto first = std::size_t(s * world_size() * micro_batch + backend.rank() * micro_batch);
        model.forward_backward(mlp::make_batch(2026, first, micro_batch));
        dp.synchronize();
        opt.step(model);
    }
    const auto flat = resume::flat(model);
    std::vector<char> bytes(flat.size() * sizeof(float));
    std::memcpy(bytes.data(), flat.data(), bytes.size());
    CHECK(same_on_every_rank(bytes));
    if (world_size() > 1) {
        CHECK(dp.comm_hook().elements_sent() * 20 < dp.comm_hook().elements_reduced());
        // Each process keeps its own error: what the approximation left out of its gradients.
        const auto& error = dp.comm_hook().state().at("fc1.weight").error;
        REQUIRE(error.size() == mlp::Mlp::in * mlp::Mlp::hidden);
        std::vector<char> error_bytes(error.size() * sizeof(float));
        std::memcpy(error_bytes.data(), error.data(), error_bytes.size());
        CHECK_FALSE(same_on_every_rank(error_bytes));
    }
}

TEST_CASE(
    "over MPI, bfloat16 gradients averaged in float32 through AllreduceHook are rounded once; plain ones are not") {
    // MPI sums bfloat16 pairwise, rounding every partial sum to 8 bits; through the hook the sum is
    // float32 (exact here) and rounded once.
    gradsync::MpiBackend backend;
    testing_support::HalfGradients hooked, plain;
    gradsync::DataParallel hooked_dp(hooked, backend, gradsync::AllreduceHook{});
    gradsync::DataParallel plain_dp(plain, backend);
    for (int s = 0; s < 2; ++s) {
        hooked.fill(backend.rank(), s);
        plain.fill(backend.rank(), s);
        hooked_dp.synchronize();
        plain_dp.synchronize();
        CHECK(hooked.not_rounded_once(world_size(), s) == 0);
        CHECK(testing_support::HalfGradients::not_the_average(hooked_dp.float32_gradient("a"), world_size(), s, 0) ==
              0);
        // Two ranks add once: nothing to round between. From three on, the 16-bit sum's own
        // rounding shows.
        if (world_size() >= 3) CHECK(plain.bfloat16_not_rounded_once(world_size(), s) > 0);
    }
}

TEST_CASE("over MPI, a layout that differs on one rank throws the same LayoutMismatch on every rank") {
    struct Model {
        std::vector<float> a = std::vector<float>(10), ga = std::vector<float>(10);
        std::vector<float> b, gb;
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("a", a, ga), gradsync::parameter("b", b, gb)};
        }
    } model;
    const std::size_t n = world_rank() == world_size() - 1 ? 6 : 5;  // the last rank differs
    model.b.resize(n);
    model.gb.resize(n);
    gradsync::MpiBackend backend;
    std::string message;
    try {
        gradsync::DataParallel dp(model, backend);
    } catch (const gradsync::LayoutMismatch& e) {
        message = e.what();
    }
    CHECK(message.find("'b'") != std::string::npos);
    std::vector<char> text(message.begin(), message.end());
    CHECK(same_on_every_rank(text));
}

TEST_CASE("over MPI, names in another order, or a setting that changes the sums, are refused on every rank") {
    struct Model {
        std::vector<float> a = std::vector<float>(10), ga = std::vector<float>(10);
        std::vector<float> b = std::vector<float>(10), gb = std::vector<float>(10);
        bool swapped = false;
        std::vector<gradsync::Parameter> parameters() {
            auto pa = gradsync::parameter("a", a, ga), pb = gradsync::parameter("b", b, gb);
            if (swapped) return {pb, pa};
            return {pa, pb};
        }
    } model;
    const bool last = world_rank() == world_size() - 1;
    model.swapped = last;
    gradsync::MpiBackend backend;
    std::string message;
    try {
        gradsync::DataParallel dp(model, backend);
    } catch (const gradsync::LayoutMismatch& e) {
        message = e.what();
    }
    CHECK(message.find("rank 0 has parameter #0 'a' (10 x float32) where rank " + std::to_string(world_size() - 1) +
                       " has parameter #0 'b' (10 x float32)") != std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(message.begin(), message.end())));

    model.swapped = false;
    message.clear();
    try {
        gradsync::DataParallel dp(model, backend, gradsync::Options{.clip_norm = last ? 2.0 : 0.0});
    } catch (const gradsync::ConfigurationError& e) {
        message = e.what();
    }
    CHECK(message.find("Options::clip_norm is '0' on rank 0 but '2' on rank " + std::to_string(world_size() - 1)) !=
          std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(message.begin(), message.end())));
}

TEST_CASE("ShardedSampler across processes: disjoint shards that cover the dataset, equal batch counts") {
    for (std::size_t dataset : {std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
        CAPTURE(dataset);
        gradsync::ShardedSampler sampler(dataset, world_size(), world_rank(), {.seed = 5});
        sampler.set_epoch(3);
        auto mine = sampler.indices();
        std::vector<std::uint64_t> as64(mine.begin(), mine.end());
        auto all = gather_all(std::as_bytes(std::span(as64)));
        std::vector<int> seen(dataset, 0);
        for (const auto& bytes : all) {
            CHECK(bytes.size() == all[0].size());  // the same number of samples, hence batches
            for (std::size_t k = 0; k < bytes.size() / 8; ++k) {
                std::uint64_t idx = 0;
                std::memcpy(&idx, bytes.data() + 8 * k, 8);
                REQUIRE(idx < dataset);
                ++seen[idx];
            }
        }
        for (int s : seen) CHECK(s >= 1);  // covered; repeats only from padding
        std::size_t total = 0;
        for (int s : seen) total += std::size_t(s);
        CHECK(total == sampler.size() * std::size_t(world_size()));
        CHECK(total - dataset < std::size_t(world_size()));  // padding is less than one per rank
    }
}

namespace {

// A path rank 0 chose, the same on every rank (one machine: a shared temporary directory).
std::string shared_path(const std::string& name) {
    std::string path =
        world_rank() == 0
            ? (std::filesystem::temp_directory_path() / ("gradsync_mpi_" + std::to_string(::getpid()) + "_" + name))
                  .string()
            : std::string();
    int length = static_cast<int>(path.size());
    MPI_Bcast(&length, 1, MPI_INT, 0, gradsync::mpi_world());
    path.resize(std::size_t(length));
    MPI_Bcast(path.data(), length, MPI_CHAR, 0, gradsync::mpi_world());
    return path;
}

}  // namespace

TEST_CASE("checkpoint over MPI: 10 steps == 5 steps, save, a new communicator, load, 5 steps, bit for bit") {
    const auto path = shared_path("resume.safetensors");
    resume::Outcome straight, resumed;
    {
        gradsync::MpiBackend backend;
        straight = resume::run_steps(backend, 0, 10, "", "");
    }
    {
        gradsync::MpiBackend backend;
        resume::run_steps(backend, 0, 5, "", path);
    }
    {
        gradsync::MpiBackend backend;  // a new process group: a communicator of its own
        resumed = resume::run_steps(backend, 5, 10, path, "");
    }
    CHECK(std::memcmp(straight.weights.data(), resumed.weights.data(), straight.weights.size() * 4) == 0);
    CHECK(std::memcmp(straight.velocity0.data(), resumed.velocity0.data(), straight.velocity0.size() * 4) == 0);
    CHECK(straight.loss_scale == resumed.loss_scale);
    CHECK(straight.epoch == resumed.epoch);
    CHECK(same_on_every_rank(resumed.weights));
    MPI_Barrier(gradsync::mpi_world());
    if (world_rank() == 0) std::filesystem::remove(path);
}

TEST_CASE("sharded checkpoint over MPI: 8 steps == 4, save (a shard file per process), new communicator, load, 4") {
    const auto path = shared_path("sharded.safetensors");
    const gradsync::SizeCappedBuckets caps{.cap = 16_KiB, .first_cap = 4_KiB};
    sharded_resume::Outcome straight, resumed;
    {
        gradsync::MpiBackend backend;
        straight = sharded_resume::run(backend, caps, 0, 8, {}, {});
    }
    {
        gradsync::MpiBackend backend;
        sharded_resume::run(backend, caps, 0, 4, {}, path);
    }
    {
        gradsync::MpiBackend backend;  // a new process group: a communicator of its own
        resumed = sharded_resume::run(backend, caps, 4, 8, path, {});
    }
    for (std::size_t t = 0; t < straight.weights.size(); ++t) {
        CHECK(straight.weights[t] == resumed.weights[t]);
        CHECK(straight.m1[t] == resumed.m1[t]);
        CHECK(straight.m2[t] == resumed.m2[t]);
        CHECK(same_on_every_rank(resumed.weights[t]));
    }
    CHECK(resumed.t == 8);
    MPI_Barrier(gradsync::mpi_world());
    if (world_rank() == 0)
        for (int r = 0; r < world_size(); ++r)
            CHECK(std::filesystem::remove(std::filesystem::path(path).parent_path() /
                                          gradsync::detail::shard_file_name(path, 4, r, world_size())));
    if (world_rank() == 0) {
        std::filesystem::remove(path);
        std::filesystem::remove(gradsync::detail::lock_path_of(path));  // saves and loads leave it, by design
    }
}

TEST_CASE("checkpoint over MPI: a file only rank 0 can read is broadcast; a bad one fails on every rank") {
    const auto path = shared_path("bad.safetensors");
    gradsync::MpiBackend backend;
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend);
    if (world_rank() == 0) {
        std::ofstream(path, std::ios::binary) << "garbage that is no safetensors file";
    }
    std::string message;
    try {
        gradsync::Checkpoint().load(path, dp);
    } catch (const gradsync::CheckpointError& e) {
        message = e.what();
    }
    CHECK(message.find("is unreadable") != std::string::npos);
    std::vector<char> text(message.begin(), message.end());
    CHECK(same_on_every_rank(text));
    gradsync::Checkpoint().save(path, dp);  // replaces the bad file
    model.w1.assign(model.w1.size(), 0.0f);
    gradsync::Checkpoint().load(path, dp);
    CHECK(model.w1 != std::vector<float>(model.w1.size(), 0.0f));
    MPI_Barrier(gradsync::mpi_world());
    if (world_rank() == 0) std::filesystem::remove(path);
}

TEST_CASE("over MPI, replicas that drift apart are named at the next check, and a save refuses them") {
    gradsync::MpiBackend backend;
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend, gradsync::Options{.check_replicas_every = 2});
    const bool last = world_rank() == world_size() - 1;
    std::string message;
    try {
        for (int s = 0; s < 4; ++s) {
            model.forward_backward(mlp::make_batch(5, static_cast<std::size_t>(s * 8), 8));
            dp.synchronize();
            if (s == 0 && last) model.b2[0] += 1.0f;  // one rank's update differs
        }
    } catch (const gradsync::ReplicaMismatch& e) {
        message = e.what();
    }
    CHECK(message.find("gradsync: step 2: the ranks' replicas differ: parameter 'fc2.bias' on rank " +
                       std::to_string(world_size() - 1) + " is not rank 0's") != std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(message.begin(), message.end())));
    const auto path = shared_path("drifted.safetensors");
    message.clear();
    try {
        gradsync::Checkpoint().save(path, dp);
    } catch (const gradsync::ReplicaMismatch& e) {
        message = e.what();
    }
    CHECK(message.find("checkpoint save after step") != std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(message.begin(), message.end())));
    CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("checkpoint over MPI: a rank that would load other tensors than rank 0 fails every rank, changing nothing") {
    const auto path = shared_path("extras.safetensors");
    gradsync::MpiBackend backend;
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend);
    std::vector<float> moment(16, 1.0f);
    gradsync::Checkpoint().add("moment", std::span(moment)).save(path, dp);
    const bool last = world_rank() == world_size() - 1;
    std::vector<float> other(last ? 20 : 16, 2.0f);
    const auto before = model.w1;
    model.w1.assign(model.w1.size(), 0.0f);
    std::string message;
    try {
        gradsync::Checkpoint().add("moment", std::span(other)).load(path, dp);
    } catch (const gradsync::CheckpointError& e) {
        message = e.what();
    }
    CHECK(message.find("would load tensor #") != std::string::npos);
    CHECK(same_on_every_rank(std::vector<char>(message.begin(), message.end())));
    CHECK(model.w1 == std::vector<float>(model.w1.size(), 0.0f));  // nothing restored
    CHECK(other[0] == 2.0f);
    MPI_Barrier(gradsync::mpi_world());
    if (world_rank() == 0) std::filesystem::remove(path);
}

TEST_CASE("MpiBackend: a trainer's collective calls, written once for every backend") {
    gradsync::MpiBackend backend;
    const int n = backend.size();
    const auto r = static_cast<float>(backend.rank());
    std::vector<float> grads(5, r + 1);  // sum n(n+1)/2, then that average again
    std::vector<double> stats(2, 2.0 * r);
    std::vector<gradsync::float16> halves(4, gradsync::float16(2.0f * r));
    std::vector<std::int64_t> seeds(3, 100 + backend.rank());
    generic::collective_step(backend, std::span(grads), std::span(stats), std::span(halves), std::span(seeds));
    for (float g : grads) CHECK(g == static_cast<float>(n * (n + 1) / 2));
    for (double s : stats) CHECK(s == static_cast<double>(n - 1));
    for (auto h : halves) CHECK(static_cast<float>(h) == static_cast<float>(n - 1));
    for (auto s : seeds) CHECK(s == 100);
}
