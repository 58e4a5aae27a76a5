// Sizes are typed: a bare number is not a bucket cap, 25_MiB is.
// expect: could not convert [^ ]*25[^ ]* from [^ ]*int[^ ]* to [^ ]*gradsync::v0::Bytes
#include <gradsync/bucket/bucketers.hpp>

using namespace gradsync::literals;

int main() {
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::SizeCappedBuckets policy{25, 1};
#else
    gradsync::SizeCappedBuckets policy{25_MiB, 1_MiB};
#endif
    return policy.cap == 25_MiB ? 0 : 1;
}
