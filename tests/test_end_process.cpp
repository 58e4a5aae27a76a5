// Ending the process once: deadlines that fire on several threads at once end the process
// through the first of them only (a second MPI_Abort under way has crashed inside Open MPI).
#include <gradsync/detail/end_process.hpp>

#include <doctest/doctest.h>

#include <sys/wait.h>  // for waitpid
#include <unistd.h>    // for fork, pipe, write, read, close

#include <atomic>
#include <chrono>
#include <cstdlib>  // for std::_Exit
#include <string>
#include <thread>
#include <vector>

TEST_CASE("ending the process from eight threads at once runs one ending, and its exit status is the process's") {
    for (int round = 0; round < 5; ++round) {
        CAPTURE(round);
        int fds[2];
        REQUIRE(pipe(fds) == 0);
        const pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            close(fds[0]);
            std::atomic<bool> go{false};
            std::vector<std::thread> threads;
            for (int t = 0; t < 8; ++t)
                threads.emplace_back([&, t] {
                    while (!go.load()) {
                    }
                    gradsync::detail::end_process_once([&] {
                        const char mark = static_cast<char>('a' + t);
                        (void)!write(fds[1], &mark, 1);
                        // Slow, as MPI_Abort is: the others arrive while it is under way.
                        std::this_thread::sleep_for(std::chrono::milliseconds(50));
                        std::_Exit(3);
                    });
                });
            go.store(true);
            for (auto& t : threads) t.join();  // never returns: the process ends first
            std::_Exit(0);
        }
        close(fds[1]);
        std::string marks;
        char c = 0;
        while (read(fds[0], &c, 1) == 1) marks += c;
        close(fds[0]);
        int status = 0;
        REQUIRE(waitpid(child, &status, 0) == child);
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 3);
        CHECK(marks.size() == 1);  // one ending ran
    }
}

TEST_CASE("an ending that returns still ends the process, with status 1") {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) gradsync::detail::end_process_once([] {});
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 1);
}
