// A communication hook without finish() is refused, naming the member and what it must do.
// expect: a communication hook needs `void finish\(const gradsync::HookBucket&, gradsync::HookComm&\)`
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct SumHook {
    using policy_category = gradsync::policy_category::comm_hook;
    static constexpr bool hooked = true;
    std::string settings() const { return "sum"; }
    gradsync::HookComm::Pending start(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        return comm.allreduce_async(bucket.values, gradsync::ReduceOp::average);
    }
#ifndef GRADSYNC_EXPECT_FAILURE
    void finish(const gradsync::HookBucket&, gradsync::HookComm&) {}
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], SumHook{});
    dp.synchronize();
}
