// RecordingBackend: a contiguous-only backend (no ScatteredAllreduce) over a LocalBackend that
// logs every collective, so tests can check what a policy made happen, not only final numbers.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/local.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace testing_support {

struct Collective {
    std::string kind;  // "allreduce", "broadcast", "barrier"
    std::size_t count = 0;
    gradsync::DType dtype = gradsync::DType::float32;
    double first = 0;  // the first element sent, for allreduces of float32/float64
};

class RecordingBackend {
public:
    explicit RecordingBackend(gradsync::LocalBackend& inner) : inner_(inner) {}

    int rank() const { return inner_.rank(); }
    int size() const { return inner_.size(); }
    bool supports(gradsync::DType t) const { return inner_.supports(t); }

    void allreduce(gradsync::Buffer b, gradsync::ReduceOp op) {
        record(b);
        inner_.allreduce(b, op);
    }
    gradsync::CollectiveHandle allreduce_async(gradsync::Buffer b, gradsync::ReduceOp op) {
        record(b);
        return inner_.allreduce_async(b, op);
    }
    void broadcast(std::span<std::byte> bytes, int root) {
        log.push_back({"broadcast", bytes.size(), gradsync::DType::float32, 0});
        inner_.broadcast(bytes, root);
    }
    void barrier() {
        log.push_back({"barrier", 0, gradsync::DType::float32, 0});
        inner_.barrier();
    }

    std::vector<Collective> log;

private:
    void record(gradsync::Buffer b) {
        double first = 0;
        if (b.count > 0 && b.dtype == gradsync::DType::float32) first = *static_cast<const float*>(b.data);
        if (b.count > 0 && b.dtype == gradsync::DType::float64) first = *static_cast<const double*>(b.data);
        log.push_back({"allreduce", b.count, b.dtype, first});
    }
    gradsync::LocalBackend& inner_;
};

static_assert(gradsync::Backend<RecordingBackend>);
static_assert(!gradsync::ScatteredAllreduce<RecordingBackend>);

}  // namespace testing_support
