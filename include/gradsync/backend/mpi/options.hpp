// MpiOptions: how MpiBackend reduces, how long a collective may take, how often it looks for
// peers that have left the group, and what its messages call the group.
#pragma once

#include <gradsync/bytes.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace gradsync::inline v0 {

// How MpiBackend reduces.
enum class MpiAlgorithm : std::uint8_t {
    // ring for pieces of MpiOptions::ring_min and more, the MPI library's own allreduce below.
    automatic,
    // MPI_Allreduce in place, then a pass that divides by the number of ranks for an average.
    mpi_allreduce,
    // Our ring over point-to-point messages: reduce-scatter then all-gather, in place, with the
    // division for an average folded into the last reduction step, so the gradients are read and
    // written no more often than the reduction itself needs, and the only scratch memory is
    // persistent (one huge MPI_Allreduce page-faults on fresh temporaries at every call).
    ring,
};

struct MpiOptions {
    MpiAlgorithm algorithm = MpiAlgorithm::automatic;
    // A collective that has not completed by then ends the job (MPI_Abort) with a diagnosis.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
    // An allreduce runs in pieces of this size, so each piece is still in cache when it is
    // averaged, and scratch memory stays at this size over the number of ranks. On 2 processes of
    // a 2-core VM, 512 KiB to 1 MiB pieces reduced BERT-base's gradients in 0.85 of the time
    // 4 MiB pieces took; 1 MiB leaves parts of 128 KiB on 8 ranks.
    Bytes chunk = Bytes{1u << 20};
    // `automatic` uses the ring for pieces of at least this size.
    Bytes ring_min = Bytes{256u << 10};
    // Segments smaller than this are packed together and reduced in one call: many small
    // tensors must not mean many collectives.
    Bytes pack_below = Bytes{64u << 10};
    // How often the watcher looks for a peer that has left the group (destroyed its MpiBackend),
    // so that a collective which can no longer complete ends the job at once instead of at the
    // timeout. Zero: never. Needs MPI_THREAD_MULTIPLE (the watcher calls MPI).
    std::chrono::milliseconds peer_poll = std::chrono::milliseconds(100);
    // The name of a group of some of the job's ranks (a communicator split from the job's), for
    // messages, which list its job ranks as well.
    std::string group_name;
};

}  // namespace gradsync::inline v0
