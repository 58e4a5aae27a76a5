// Checkpoints of a DataParallel run: rank 0 writes the parameters, the model's buffers, the
// extra tensors the user adds (optimizer moments), the step, the loss scaler's state and the
// sampler's epoch and seed to one safetensors file, atomically; loading checks the file against
// what it is loaded into on rank 0 and broadcasts it to every rank, so resuming is bitwise exact.
// Not included by <gradsync/gradsync.hpp>: it needs nlohmann/json (Debian: nlohmann-json3-dev).
#pragma once

#include <gradsync/data_parallel.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/checkpoint/safetensors.hpp>
#include <gradsync/launch/sampler.hpp>

#include <charconv>  // for std::to_chars, std::from_chars
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <system_error>  // for std::errc
#include <vector>

namespace gradsync::inline v0 {

// What a checkpoint holds besides the model's parameters and buffers. Save and load are
// collective: every rank calls them, between steps, with the same additions.
class Checkpoint {
public:
    struct Options {
        SafetensorsWriteOptions write;  // test hooks
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
    // The sampler's epoch and seed, so that a resumed run reads the same examples.
    Checkpoint& add(ShardedSampler& sampler) {
        sampler_ = &sampler;
        return *this;
    }

    // Rank 0 writes `path` atomically (a crash at any point leaves the previous file intact);
    // every rank returns once it is written, or throws the same CheckpointError.
    template <class Model, class B, class... P>
    void save(const std::filesystem::path& path, DataParallel<Model, B, P...>& dp) const {
        std::string problem;
        if (dp.rank() == 0) {
            try {
                std::vector<TensorBytes> tensors;
                for (const auto& t : targets(dp))
                    tensors.push_back(TensorBytes{
                        t.name,
                        t.dtype,
                        {t.count},
                        std::span<const std::byte>(static_cast<const std::byte*>(t.data), t.count * size_of(t.dtype))});
                write_safetensors(path, tensors, metadata(dp), options_.write);
            } catch (const std::exception& e) {
                problem = e.what();
            }
        }
        agree(dp.backend(), problem);
    }

    // Rank 0 reads `path` and checks it against the model's parameters and buffers and the
    // additions here (names, dtypes, sizes; nothing missing, nothing left over); then every rank
    // receives its contents. Restores the step count, the loss scaler and the sampler. On any
    // problem every rank throws the same CheckpointError and nothing has been changed.
    template <class Model, class B, class... P>
    void load(const std::filesystem::path& path, DataParallel<Model, B, P...>& dp) {
        const auto wanted = targets(dp);
        Scalars scalars;
        std::string problem;
        std::optional<SafetensorsFile> file;
        if (dp.rank() == 0) {
            try {
                file.emplace(path);
                problem = check(*file, wanted);
                if (problem.empty()) problem = read_scalars(file->metadata(), scalars);
            } catch (const std::exception& e) {
                problem = e.what();
            }
        }
        agree(dp.backend(), problem);
        // Everything checks out on rank 0: only now is anything overwritten.
        if (dp.rank() == 0)
            for (const auto& t : wanted) {
                const auto& saved = *file->find(t.name);
                std::memcpy(t.data, saved.bytes.data(), saved.bytes.size());
            }
        if (dp.world_size() > 1) {
            for (const auto& t : wanted)
                dp.backend().broadcast(std::span(static_cast<std::byte*>(t.data), t.count * size_of(t.dtype)), 0);
            dp.backend().broadcast(std::as_writable_bytes(std::span(&scalars, 1)), 0);
        }
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

private:
    struct Extra {
        std::string name;
        void* data;
        std::size_t count;
        DType dtype;
    };
    // Fixed-size, so that it can be broadcast as bytes.
    struct Scalars {
        std::uint64_t step = 0;
        std::uint64_t epoch = 0;
        std::uint64_t seed = 0;
        float scale = 0;
        std::uint32_t good_steps = 0;
        std::uint32_t bad_steps = 0;
    };

    template <class DP>
    std::vector<Extra> targets(DP& dp) const {
        std::vector<Extra> all;
        for (const auto& p : dp.parameters()) all.push_back(Extra{p.name, p.data, p.count, p.dtype});
        for (const auto& b : dp.buffers()) all.push_back(Extra{b.name, b.data, b.count, b.dtype});
        all.insert(all.end(), extras_.begin(), extras_.end());
        std::set<std::string> names;
        for (const auto& t : all)
            if (!names.insert(t.name).second)
                throw CheckpointError("gradsync: two tensors named '" + t.name +
                                      "' (parameters, buffers and Checkpoint::add names must be unique)");
        return all;
    }

    static std::string number(std::uint64_t v) { return std::to_string(v); }
    static std::string number(float v) {
        char buf[32];
        auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back the same float
        return std::string(buf, r.ptr);
    }

    template <class DP>
    std::map<std::string, std::string> metadata(DP& dp) const {
        std::map<std::string, std::string> m{{"format", "pt"},  // what Python loaders expect
                                             {"gradsync.step", number(dp.steps())},
                                             {"gradsync.world_size", number(std::uint64_t(dp.world_size()))}};
        if constexpr (requires { dp.loss_scaler().state; }) {
            const auto& s = dp.loss_scaler().state;
            m["gradsync.loss_scale"] = number(s.scale);
            m["gradsync.good_steps"] = number(std::uint64_t(s.good_steps));
            m["gradsync.bad_steps"] = number(std::uint64_t(s.bad_steps));
        }
        if (sampler_ != nullptr) {
            m["gradsync.sampler.epoch"] = number(sampler_->epoch());
            m["gradsync.sampler.seed"] = number(sampler_->options().seed);
        }
        return m;
    }

    // Empty when `file` holds exactly the tensors wanted, with their dtypes and sizes.
    static std::string check(const SafetensorsFile& file, const std::vector<Extra>& wanted) {
        const std::string where = "gradsync: checkpoint " + file.path().string() + " does not fit: ";
        std::set<std::string> names;
        for (const auto& t : wanted) {
            names.insert(t.name);
            const auto* saved = file.find(t.name);
            if (saved == nullptr) return where + "it has no tensor '" + t.name + "'";
            if (saved->dtype != t.dtype)
                return where + "tensor '" + t.name + "' is " + to_string(saved->dtype) + " there and " +
                       to_string(t.dtype) + " here";
            if (saved->bytes.size() != t.count * size_of(t.dtype))
                return where + "tensor '" + t.name + "' has " + std::to_string(saved->bytes.size() / size_of(t.dtype)) +
                       " elements there and " + std::to_string(t.count) + " here";
        }
        for (const auto& saved : file.tensors())
            if (!names.contains(saved.name))
                return where + "it holds tensor '" + saved.name + "', which nothing here loads";
        return {};
    }

    std::string read_scalars(const std::map<std::string, std::string>& m, Scalars& s) const {
        std::string problem;
        auto get = [&](const std::string& key, auto& out) {
            auto it = m.find(key);
            if (it == m.end()) {
                if (problem.empty()) problem = "gradsync: checkpoint metadata lacks '" + key + "'";
                return;
            }
            const auto& text = it->second;
            auto r = std::from_chars(text.data(), text.data() + text.size(), out);
            if ((r.ec != std::errc{} || r.ptr != text.data() + text.size()) && problem.empty())
                problem = "gradsync: checkpoint metadata '" + key + "' = '" + text + "' is not a number";
        };
        get("gradsync.step", s.step);
        if (m.contains("gradsync.loss_scale")) {
            get("gradsync.loss_scale", s.scale);
            std::uint64_t good = 0, bad = 0;
            get("gradsync.good_steps", good);
            get("gradsync.bad_steps", bad);
            s.good_steps = static_cast<std::uint32_t>(good);
            s.bad_steps = static_cast<std::uint32_t>(bad);
        }
        if (sampler_ != nullptr) {
            get("gradsync.sampler.epoch", s.epoch);
            get("gradsync.sampler.seed", s.seed);
        }
        return problem;
    }

    // Rank 0's verdict, on every rank: returns when `problem` is empty there, else throws it.
    template <class B>
    static void agree(B& backend, std::string problem) {
        if (backend.size() > 1) {
            std::uint64_t length = problem.size();
            backend.broadcast(std::as_writable_bytes(std::span(&length, 1)), 0);
            problem.resize(length);
            backend.broadcast(std::as_writable_bytes(std::span(problem.data(), problem.size())), 0);
        }
        if (!problem.empty()) throw CheckpointError(problem);
    }

    Options options_;
    std::vector<Extra> extras_;
    ShardedSampler* sampler_ = nullptr;
};

}  // namespace gradsync::inline v0
