// Checkpoints of a DataParallel run: rank 0 writes the parameters, the model's buffers, the
// extra tensors the user adds (optimizer moments), the step, the loss scaler's state and the
// sampler's epoch and seed to one safetensors file, atomically, once every rank's replica matches
// rank 0's; loading checks that every rank loads the same tensors, checks the file against them on
// rank 0 and broadcasts it to every rank, so resuming is bitwise exact. With ShardedDataParallel,
// optimizer state split across the ranks goes to one shard file per rank beside it (shard_files.hpp);
// state that differs by rank (PowerSGD's error feedback) to one file per rank (local_files.hpp).
// With a memory policy on the device (CudaMemory) every tensor it saves or loads (parameters,
// buffers, the additions) lies in device memory and is copied through the policy.
// Not included by <gradsync/gradsync.hpp>: it needs nlohmann/json (Debian: nlohmann-json3-dev).
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/sharded_data_parallel.hpp>
#include <gradsync/data_parallel/replica_check.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/checkpoint/agreement.hpp>
#include <gradsync/checkpoint/front_traits.hpp>
#include <gradsync/checkpoint/host_staging.hpp>
#include <gradsync/checkpoint/safetensors.hpp>
#include <gradsync/checkpoint/local_files.hpp>
#include <gradsync/checkpoint/metadata.hpp>
#include <gradsync/checkpoint/path_lock.hpp>
#include <gradsync/checkpoint/shard_files.hpp>
#include <gradsync/checkpoint/safetensors_file.hpp>
#include <gradsync/launch/sampler.hpp>
#include <gradsync/reduction/powersgd.hpp>

#include <charconv>  // for std::to_chars, std::from_chars
#include <chrono>
#include <cmath>     // for std::isfinite
#include <concepts>  // for std::same_as, std::convertible_to
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <system_error>  // for std::errc
#include <type_traits>   // for std::remove_cvref_t
#include <utility>       // for std::pair
#include <vector>

namespace gradsync::inline v0 {

// What a checkpoint holds besides the model's parameters and buffers. Save and load are
// collective: every rank calls them, between steps, with the same additions.
class Checkpoint {
public:
    struct Options {
        SafetensorsWriteOptions write;  // test hooks
        // How long a save or load of a checkpoint with files beside it (shard or rank files) waits
        // for another save or load of the same path to end (path_lock.hpp).
        std::chrono::milliseconds lock_wait = std::chrono::minutes(10);
    };

    Checkpoint() = default;
    explicit Checkpoint(Options options) : options_(std::move(options)) {}

    // Extra state saved and restored bit for bit, such as optimizer moments or an optimizer's
    // step counter. Its size at load time must be the size saved.
    template <HasDType T>
    Checkpoint& add(std::string name, std::span<T> data) {
        extras_.push_back(Extra{std::move(name), data.data(), data.size(), dtype_of<T>});
        return *this;
    }
    // Optimizer state split across the ranks, for ShardedDataParallel: an array of its
    // state_elements() elements, indexed by ShardPiece::state_offset. Each rank saves its pieces
    // to a shard file of its own beside the checkpoint (the checkpoint's folder must be one every
    // rank can read and write, such as a shared file system); a load fills each rank's pieces from
    // whichever shards hold them, so it may run on another number of ranks or another bucket plan.
    template <HasDType T>
    Checkpoint& add_shard(std::string name, std::span<T> state) {
        shards_.push_back(detail::ShardedArray{std::move(name), state.data(), state.size(), dtype_of<T>});
        return *this;
    }
    // State that differs by rank, such as a communication hook's error feedback: each rank saves
    // its own array to a file of its own beside the checkpoint, and a load, into as many ranks,
    // restores each rank's own. Its size at load time must be the size saved.
    template <HasDType T>
    Checkpoint& add_local(std::string name, std::span<T> data) {
        locals_.push_back(detail::ShardedArray{std::move(name), data.data(), data.size(), dtype_of<T>});
        return *this;
    }
    // PowerSGD's state (PowerSGD, or CudaPowerSGD with the front's tensors on the device): each
    // matrix's last Q (the same on every rank, in the checkpoint) and its error (this rank's, in
    // the rank's file), as "powersgd.q.<parameter>" and "powersgd.error.<parameter>". The hook
    // must be the DataParallel's (dp.comm_hook()).
    template <class Hook>
    requires requires(Hook& hook) {
        { hook.state_arrays() } -> std::same_as<std::map<std::string, PowerSGDArrays>>;
        { hook.config() } -> std::convertible_to<const PowerSGDConfig&>;
    }
    Checkpoint& add(Hook& hook) {
        for (auto& [name, state] : hook.state_arrays()) {
            if (hook.config().warm_start) add("powersgd.q." + name, state.q);
            if (hook.config().error_feedback) add_local("powersgd.error." + name, state.error);
        }
        return *this;
    }
    // The sampler's epoch and seed, so that a resumed run reads the same examples.
    Checkpoint& add(ShardedSampler& sampler) {
        sampler_ = &sampler;
        return *this;
    }

    // Rank 0 writes `path` atomically (a crash at any point leaves the previous file intact);
    // every rank returns once it is written, or throws the same CheckpointError. First every rank
    // compares what it holds with rank 0's (parameters, buffers kept equal, the additions), since
    // rank 0's copy is what every rank gets back: replicas that differ throw ReplicaMismatch on
    // every rank, and nothing is written. With files beside the checkpoint, saves and loads of one
    // path take turns (Options::lock_wait): two trainers saving it leave the last one's whole.
    template <class DP>
    void save(const std::filesystem::path& path, DP& dp) const {
        static_assert(detail::tensors_readable<DP>() && detail::checkpoint_layout_known<DP>());
        dp.wait_for_parameters();  // none left being written (all-gathers behind the forward)
        detail::HostStaging staging(dp.memory());
        std::string problem;
        std::vector<Extra> all;
        try {
            all = targets(dp);
        } catch (const std::exception& e) {
            problem = e.what();
        }
        detail::agree_on_problem(dp.backend(), problem);
        detail::PathLock lock;
        if (files_beside<DP>()) {
            try {
                lock = lock_beside(path, dp, detail::PathLock::Mode::exclusive);
            } catch (const std::exception& e) {
                problem = e.what();
            }
            detail::agree_on_problem(dp.backend(), problem);
        }
        if constexpr (!detail::on_device<DP>()) {
            auto tensors = detail::replica_tensors(dp.parameters(), dp.buffers(), DP::buffers_type::mode);
            for (const auto& e : extras_)
                tensors.push_back(
                    detail::ReplicaTensor{&e.name, "checkpointed tensor", e.data, e.count * size_of(e.dtype)});
            detail::compare_replicas(dp.backend(), std::span<const detail::ReplicaTensor>(tensors),
                                     "checkpoint save after step " + std::to_string(dp.steps()));
        }
        auto meta = detail::checkpoint_metadata(dp, sampler_);
        detail::ShardList shards;
        if constexpr (detail::sharded_front<DP>)
            if (!shards_.empty()) {
                shards = write_shards(path, dp, staging.on_host(std::span<const detail::ShardedArray>(shards_)));
                meta["gradsync.shards"] = detail::to_text(shards);
            }
        detail::ShardList locals;
        if (!locals_.empty()) {
            locals = write_locals(path, dp, staging.on_host(std::span<const detail::ShardedArray>(locals_)));
            meta["gradsync.local"] = detail::to_text(locals);
        }
        if (dp.rank() == 0) {
            try {
                std::vector<TensorBytes> tensors;
                for (const auto& t : staging.on_host(std::span<const Extra>(all)))
                    tensors.push_back(TensorBytes{
                        t.name, t.dtype, detail::saved_shape(t.shape, t.count),
                        std::span<const std::byte>(static_cast<const std::byte*>(t.data), t.count * size_of(t.dtype))});
                write_safetensors(path, tensors, meta, options_.write);
            } catch (const std::exception& e) {
                problem = e.what();
            }
        }
        detail::agree_on_problem(dp.backend(), problem);
        if (!shards.names.empty()) detail::remove_stale_shards(path, shards);
        if (!locals.names.empty()) detail::remove_stale_shards(path, locals, "rank");
        if (files_beside<DP>()) detail::agree_on_problem(dp.backend(), {});  // every rank's removal ends first
    }

    // Every rank checks that it loads what rank 0 loads (names, dtypes, sizes); rank 0 reads
    // `path` and checks it against the model's parameters and buffers and the additions here
    // (nothing missing, nothing left over); every rank reads its pieces of the sharded state from
    // the shard files the checkpoint lists, checking each against its hash there; then every rank
    // receives the contents. Restores the step count, the loss scaler and the sampler. On any
    // problem every rank throws the same CheckpointError and nothing has been changed on any rank.
    template <class DP>
    void load(const std::filesystem::path& path, DP& dp) {
        load_parts(path, dp, /*weights_only=*/false);
    }

    // The model's parameters and buffers alone, from any safetensors file that names them as the
    // model does: a state dict Python saved (safetensors.torch.save_file(model.state_dict(), path))
    // or a gradsync checkpoint without additions. Checked as load() checks (every tensor there,
    // none left over, dtypes, sizes, and the shapes the model states) and received alike by every
    // rank; the step count, the loss scaler, the sampler and this Checkpoint's additions are left
    // as they are.
    template <class DP>
    void load_weights(const std::filesystem::path& path, DP& dp) {
        load_parts(path, dp, /*weights_only=*/true);
    }

private:
    template <class DP>
    void load_parts(const std::filesystem::path& path, DP& dp, bool weights_only) {
        static_assert(detail::tensors_readable<DP>() && detail::checkpoint_layout_known<DP>());
        dp.wait_for_parameters();  // none left to overwrite what is loaded
        const detail::HostStaging staging(dp.memory());
        std::vector<Extra> wanted;
        std::string problem;
        try {
            wanted = weights_only ? weights(dp) : targets(dp);
        } catch (const std::exception& e) {
            problem = e.what();
        }
        detail::agree_on_problem(dp.backend(), problem);
        const auto& shards = weights_only ? no_arrays : shards_;
        const auto& locals = weights_only ? no_arrays : locals_;
        problem = detail::differs_from_rank0(dp.backend(), path, std::span<const Extra>(wanted),
                                             std::span<const detail::ShardedArray>(shards));
        detail::CheckpointScalars scalars;
        std::optional<SafetensorsFile> file;
        std::string shard_text, local_text;
        detail::PathLock lock;  // held until every rank has read its files
        if (dp.rank() == 0 && problem.empty()) {
            try {
                if (!weights_only) lock = lock_beside(path, dp, detail::PathLock::Mode::shared);
                file.emplace(path);
                problem = detail::check_contents(*file, wanted);
                if (problem.empty() && !weights_only)
                    problem = detail::read_scalars(*file, scalars, sampler_ != nullptr);
                if (problem.empty() && !weights_only)
                    problem = detail::read_file_list(*file, detail::shard_files, scalars.step, shards_, shard_text);
                if (problem.empty() && !weights_only)
                    problem = detail::read_file_list(*file, detail::rank_files, scalars.step, locals_, local_text);
            } catch (const std::exception& e) {
                problem = e.what();
            }
        }
        detail::agree_on_problem(dp.backend(), problem);
        std::vector<std::vector<std::byte>> state;  // this rank's pieces of each sharded array
        if constexpr (detail::sharded_front<DP>)
            if (!shards.empty()) {
                detail::broadcast_text(dp.backend(), shard_text, 0);
                problem = read_shards(path, shard_text, dp, state);
                detail::agree_on_problem(dp.backend(), problem);
            }
        std::vector<std::vector<std::byte>> local;  // this rank's own arrays
        if (!locals.empty()) {
            detail::broadcast_text(dp.backend(), local_text, 0);
            try {
                problem = detail::read_local(path, detail::shard_list_from_text(local_text), locals_, dp.rank(),
                                             dp.world_size(), local);
            } catch (const std::exception& e) {
                problem = e.what();
            }
            detail::agree_on_problem(dp.backend(), problem);
        }
        // Everything checks out on every rank: only now is anything overwritten.
        if (dp.rank() == 0)
            for (const auto& t : wanted) {
                const auto& saved = *file->find(t.name);
                staging.copy_in(t.data, saved.bytes);
            }
        if (dp.world_size() > 1)
            for (const auto& t : wanted)
                dp.backend().broadcast(std::span(static_cast<std::byte*>(t.data), t.count * size_of(t.dtype)), 0);
        if (weights_only) return;
        if (dp.world_size() > 1) dp.backend().broadcast(std::as_writable_bytes(std::span(&scalars, 1)), 0);
        for (std::size_t a = 0; a < state.size(); ++a) staging.copy_in(shards_[a].data, state[a]);
        for (std::size_t a = 0; a < local.size(); ++a) staging.copy_in(locals_[a].data, local[a]);
        dp.restore_steps(scalars.step);
        if constexpr (requires { dp.loss_scaler().state; }) {
            dp.loss_scaler().state.scale = scalars.scale;
            dp.loss_scaler().state.good_steps = scalars.good_steps;
            dp.loss_scaler().state.bad_steps = scalars.bad_steps;
        }
        if (sampler_ != nullptr) {
            sampler_->set_epoch(scalars.epoch);
            sampler_->set_seed(scalars.seed);
        }
    }

    struct Extra {
        std::string name;
        void* data;
        std::size_t count;
        DType dtype;
        std::vector<std::size_t> shape{};  // as the model states it; none for the additions
    };

    // Each rank writes its shard file; every rank returns the list of them (hashes gathered from
    // every rank), or throws the same CheckpointError. Collective.
    template <class DP>
    detail::ShardList write_shards(const std::filesystem::path& path, DP& dp,
                                   const std::vector<detail::ShardedArray>& shards) const {
        return detail::write_rank_files(dp, &detail::shard_file_name, path, [&](const std::filesystem::path& mine) {
            return detail::write_shard(mine, shards, pieces_of(dp), dp.parameters(), dp.steps(), dp.rank(),
                                       dp.world_size(), options_.write);
        });
    }

    // Each rank writes its file of state that differs by rank; every rank returns the list of them.
    template <class DP>
    detail::ShardList write_locals(const std::filesystem::path& path, DP& dp,
                                   const std::vector<detail::ShardedArray>& locals) const {
        return detail::write_rank_files(dp, &detail::local_file_name, path, [&](const std::filesystem::path& mine) {
            return detail::write_local(mine, locals, dp.steps(), dp.rank(), dp.world_size(), options_.write);
        });
    }

    template <class DP>
    static std::vector<detail::PieceSpan> pieces_of(DP& dp) {
        std::vector<detail::PieceSpan> out;
        for (const auto& p : dp.shard_pieces()) out.push_back({p.parameter, p.offset, p.params.size(), p.state_offset});
        return out;
    }

    // Whether the checkpoint has files beside it: shard files or rank files.
    template <class DP>
    [[nodiscard]] bool files_beside() const {
        return !locals_.empty() || (detail::sharded_front<DP> && !shards_.empty());
    }
    // Rank 0's turn at `path` where files lie beside it (path_lock.hpp); else no lock.
    template <class DP>
    detail::PathLock lock_beside(const std::filesystem::path& path, DP& dp, detail::PathLock::Mode mode) const {
        if (dp.rank() != 0 || !files_beside<DP>()) return {};
        return detail::PathLock(path, mode, options_.lock_wait);
    }

    // This rank's pieces of every sharded array, from the shard files `text` lists.
    template <class DP>
    std::string read_shards(const std::filesystem::path& path, const std::string& text, DP& dp,
                            std::vector<std::vector<std::byte>>& state) const {
        try {
            return detail::read_shards(path, detail::shard_list_from_text(text), shards_, pieces_of(dp),
                                       dp.parameters(), dp.rank(), state);
        } catch (const std::exception& e) {
            return e.what();
        }
    }

    // The model's parameters and buffers, with their shapes.
    template <class DP>
    static std::vector<Extra> weights(DP& dp) {
        std::vector<Extra> all;
        for (const auto& p : dp.parameters()) all.push_back(Extra{p.name, p.data, p.count, p.dtype, p.shape});
        for (const auto& b : dp.buffers()) all.push_back(Extra{b.name, b.data, b.count, b.dtype, b.shape});
        return all;
    }

    template <class DP>
    std::vector<Extra> targets(DP& dp) const {
        auto all = weights(dp);
        all.insert(all.end(), extras_.begin(), extras_.end());
        if constexpr (detail::sharded_front<DP>) {
            for (const auto& a : shards_)
                if (a.count != dp.state_elements())
                    throw CheckpointError(detail::rank_prefix(dp.rank()) + ": sharded state '" + a.name + "' has " +
                                          std::to_string(a.count) +
                                          " elements; ShardedDataParallel::state_elements() "
                                          "is " +
                                          std::to_string(dp.state_elements()));
        } else if (!shards_.empty()) {
            throw CheckpointError("gradsync: Checkpoint::add_shard('" + shards_.front().name +
                                  "') adds state split across the ranks, which only a ShardedDataParallel has; "
                                  "use Checkpoint::add for a DataParallel's state");
        }
        std::set<std::string> names;
        for (const auto& t : shards_)
            if (!names.insert(t.name).second)
                throw CheckpointError("gradsync: two sharded state arrays named '" + t.name + "'");
        names.clear();
        for (const auto& t : locals_)
            if (!names.insert(t.name).second)
                throw CheckpointError("gradsync: two arrays of state that differs by rank named '" + t.name + "'");
        names.clear();
        for (const auto& t : all)
            if (!names.insert(t.name).second)
                throw CheckpointError("gradsync: two tensors named '" + t.name +
                                      "' (parameters, buffers and Checkpoint::add names must be unique)");
        return all;
    }

    Options options_;
    std::vector<Extra> extras_;
    std::vector<detail::ShardedArray> shards_;
    std::vector<detail::ShardedArray> locals_;  // state that differs by rank
    inline static const std::vector<detail::ShardedArray> no_arrays{};
    ShardedSampler* sampler_ = nullptr;
};

}  // namespace gradsync::inline v0
