// The model's buffers (batch-norm statistics and the like) kept in step across ranks, as the
// buffer policy says: rank 0's copied to every rank at construction, and after every
// synchronize() copied again, averaged, or left alone.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/model/buffers.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace gradsync::inline v0::detail {

template <Backend B>
void sync_buffers(B& backend, std::span<const ModelBuffer> buffers, BufferSync mode, bool at_construction,
                  CollectiveHistory& history, std::int64_t step) {
    if (backend.size() == 1 || buffers.empty() || mode == BufferSync::ignore) return;
    if (!at_construction && mode == BufferSync::broadcast_once) return;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
        const auto& buf = buffers[i];
        const bool average = !at_construction && mode == BufferSync::average_every_step && backend.supports(buf.dtype);
        const auto tag = history.next(average ? CollectivePurpose::buffer_average : CollectivePurpose::buffer_broadcast,
                                      step, i, buf.bytes().count(), buf.dtype);
        if (average)
            allreduce_tagged(backend, Buffer{buf.data, buf.count, buf.dtype}, ReduceOp::average, tag);
        else
            broadcast_tagged(backend, std::span(static_cast<std::byte*>(buf.data), buf.bytes().count()), 0, tag);
    }
}

}  // namespace gradsync::inline v0::detail
