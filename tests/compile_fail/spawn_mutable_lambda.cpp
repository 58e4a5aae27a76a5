// spawn calls one fn from every rank's thread: a mutable lambda would race on its own state.
// expect: is_invocable_v<const Fn&, gradsync::v0::LocalBackend&>
#include <gradsync/launch/spawn.hpp>

int main() {
    int calls = 0;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::spawn(2, [calls](gradsync::LocalBackend&) mutable { ++calls; });
#else
    gradsync::spawn(2, [&calls](gradsync::LocalBackend& b) {
        if (b.rank() == 0) ++calls;
    });
#endif
    return calls == 1 ? 0 : 1;
}
