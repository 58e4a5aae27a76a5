// The name server that torchrun-style processes meet through when the user named none (Open MPI):
// rank 0 starts Open MPI's `ompi-server` for the job and serves its address over TCP on port
// MASTER_PORT + 2 (MASTER_PORT is torchrun's own store, + 1 NCCL's bootstrap); every other rank
// fetches it from MASTER_ADDR there. Each process then names it to MPI
// (OMPI_MCA_pmix_server_uri) before MPI_Init, and the join goes on as with a server of the user's.
#pragma once

#include <gradsync/backend/mpi/join.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/file_descriptor.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>

#include <fcntl.h>  // for open
#include <netdb.h>  // for getaddrinfo
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>  // for kill
#include <sys/socket.h>
#include <sys/wait.h>  // for waitpid
#include <unistd.h>    // for fork, execlp, close
#ifdef __linux__
#include <sys/prctl.h>  // for PR_SET_PDEATHSIG
#endif

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>  // for mkdtemp, setenv, strtol
#include <cstring>  // for std::strerror
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>  // for std::exchange

namespace gradsync::inline v0::detail {

inline constexpr int name_server_port_offset = 2;
inline constexpr const char* name_server_greeting = "gradsync MPI name server";

// Where rank 0 serves the name server's address: MASTER_ADDR and MASTER_PORT + 2; nothing when
// the launcher set neither (not a torchrun-style launch).
struct NameServerAddress {
    std::string host;
    int port = 0;
};

inline std::optional<NameServerAddress> name_server_address(const std::string& who, EnvLookup lookup = real_env) {
    const auto addr = lookup("MASTER_ADDR");
    const auto port = lookup("MASTER_PORT");
    if (!addr || !port) return std::nullopt;
    char* end = nullptr;
    const long number = std::strtol(port->c_str(), &end, 10);
    if (port->empty() || *end != '\0' || number < 1 || number > 65535 - name_server_port_offset)
        throw ConfigurationError(who + ": MASTER_PORT='" + *port + "' is no port from 1 to " +
                                 std::to_string(65535 - name_server_port_offset) +
                                 " (MPI's name server is served on MASTER_PORT + 2)");
    return NameServerAddress{*addr, static_cast<int>(number) + name_server_port_offset};
}

// Rank 0's ompi-server, stopped when this goes (after MPI_Finalize: the ranks' names live there
// while the world does). On Linux it also ends when the thread that started it ends.
class NameServerProcess {
public:
    NameServerProcess(const std::string& who, std::chrono::steady_clock::time_point deadline) {
        char dir[] = "/tmp/gradsync-name-server-XXXXXX";
        if (::mkdtemp(dir) == nullptr)
            throw CollectiveError(who +
                                  ": cannot make a folder for the MPI name server's address: " + std::strerror(errno));
        dir_ = dir;
        const std::string file = dir_ + "/uri";
        pid_ = ::fork();
        if (pid_ < 0) throw CollectiveError(who + ": cannot start ompi-server: " + std::strerror(errno));
        if (pid_ == 0) {  // the child: only calls that are safe after fork
#ifdef __linux__
            ::prctl(PR_SET_PDEATHSIG, SIGTERM);
#endif
            const int null = ::open("/dev/null", O_RDWR);
            ::dup2(null, 1);
            ::dup2(null, 2);
            ::execlp("ompi-server", "ompi-server", "--no-daemonize", "-r", file.c_str(), static_cast<char*>(nullptr));
            ::_exit(127);
        }
        for (;;) {
            std::ifstream in(file);
            std::string line;
            if (std::getline(in, line) && !in.eof() && !line.empty()) {
                uri_ = line;
                remove_folder();  // read: not needed again, and not left behind by a rank that aborts
                return;
            }
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                remove_folder();
                const bool missing = WIFEXITED(status) && WEXITSTATUS(status) == 127;
                throw CollectiveError(who + ": ompi-server, Open MPI's name server, " +
                                      (missing ? "is not on PATH (Debian: openmpi-bin)" : "ended at its start") +
                                      "; the ranks of a launch without mpirun meet through it");
            }
            if (std::chrono::steady_clock::now() > deadline) {
                stop();
                throw CollectiveError(who + ": ompi-server, Open MPI's name server, wrote no address in time");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    NameServerProcess(const NameServerProcess&) = delete;
    NameServerProcess& operator=(const NameServerProcess&) = delete;
    ~NameServerProcess() { stop(); }

    [[nodiscard]] const std::string& uri() const { return uri_; }

private:
    void stop() {
        if (pid_ > 0) {
            ::kill(pid_, SIGTERM);
            ::waitpid(pid_, nullptr, 0);
            pid_ = -1;
        }
        remove_folder();
    }
    void remove_folder() {
        std::error_code ignored;
        std::filesystem::remove_all(dir_, ignored);
    }

    pid_t pid_ = -1;
    std::string dir_, uri_;
};

// The text rank 0 serves: who it is, the job's name (join_service), the server's address.
inline std::string name_server_message(const std::string& job, const std::string& uri) {
    return std::string(name_server_greeting) + "\n" + job + "\n" + uri + "\n";
}

// Rank 0 hands the message to every process that connects to `port`, until this goes.
class NameServerAnnouncer {
public:
    NameServerAnnouncer(int port, std::string message, const std::string& who) : message_(std::move(message)) {
        listener_ = listen_on(port);
        if (!listener_.is_open())
            throw CollectiveError(who + ": cannot serve the MPI name server's address on port " + std::to_string(port) +
                                  " (MASTER_PORT + 2): " + std::strerror(errno) +
                                  ". Choose another MASTER_PORT, or name a server of your own in "
                                  "OMPI_MCA_pmix_server_uri");
        thread_ = std::thread([this] { serve(); });
    }
    NameServerAnnouncer(const NameServerAnnouncer&) = delete;
    NameServerAnnouncer& operator=(const NameServerAnnouncer&) = delete;
    ~NameServerAnnouncer() {
        stop_ = true;
        thread_.join();
    }

private:
    // Every address of this machine, IPv6 and IPv4 where the host has both.
    static FileDescriptor listen_on(int port) {
        const int yes = 1, no = 0;
        FileDescriptor fd(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (fd.is_open()) {
            ::setsockopt(fd.fd(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
            ::setsockopt(fd.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof no);
            sockaddr_in6 address{};
            address.sin6_family = AF_INET6;
            address.sin6_addr = in6addr_any;
            address.sin6_port = htons(static_cast<std::uint16_t>(port));
            if (::bind(fd.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                ::listen(fd.fd(), 64) == 0)
                return fd;
            if (errno == EADDRINUSE) return FileDescriptor{};
        }
        fd = FileDescriptor(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));  // a host without IPv6
        if (!fd.is_open()) return fd;
        ::setsockopt(fd.fd(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_ANY);
        address.sin_port = htons(static_cast<std::uint16_t>(port));
        if (::bind(fd.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(fd.fd(), 64) != 0)
            return FileDescriptor{};
        return fd;
    }

    void serve() {
        while (!stop_) {
            pollfd ready{listener_.fd(), POLLIN, 0};
            if (::poll(&ready, 1, 50) <= 0) continue;
            FileDescriptor peer(::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC));
            if (!peer.is_open()) continue;
            std::size_t sent = 0;
            while (sent < message_.size()) {
                const auto n = ::send(peer.fd(), message_.data() + sent, message_.size() - sent, MSG_NOSIGNAL);
                if (n <= 0) break;
                sent += static_cast<std::size_t>(n);
            }
        }
    }

    std::string message_;
    FileDescriptor listener_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

// The whole message of rank 0 at host:port, or "" when nobody answered there (yet).
inline std::string fetch_message(const NameServerAddress& at, const std::string& who) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(at.host.c_str(), std::to_string(at.port).c_str(), &hints, &found);
    if (rc != 0)
        throw ConfigurationError(who + ": MASTER_ADDR='" + at.host + "' names no address: " + ::gai_strerror(rc));
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> list(found, ::freeaddrinfo);
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
        FileDescriptor fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
        if (!fd.is_open()) continue;
        const timeval patience{2, 0};  // rank 0 answers at once; something else may never
        ::setsockopt(fd.fd(), SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
        if (::connect(fd.fd(), a->ai_addr, a->ai_addrlen) != 0) continue;
        std::string text;
        char buffer[512];
        for (;;) {
            const auto n = ::recv(fd.fd(), buffer, sizeof buffer, 0);
            if (n <= 0) break;
            text.append(buffer, static_cast<std::size_t>(n));
        }
        return text;
    }
    return {};
}

// The name server's address as rank 0 serves it for `job`, fetched by the deadline.
inline std::string fetch_name_server(const NameServerAddress& at, const std::string& job, const std::string& who,
                                     std::chrono::steady_clock::time_point deadline) {
    const std::string where = at.host + ":" + std::to_string(at.port) + " (MASTER_ADDR, MASTER_PORT + 2)";
    for (;;) {
        std::istringstream text(fetch_message(at, who));
        std::string greeting, served_job, uri;
        if (std::getline(text, greeting) && std::getline(text, served_job) && std::getline(text, uri)) {
            if (greeting != name_server_greeting)
                throw CollectiveError(who + ": something other than rank 0 of a gradsync job answers at " + where +
                                      "; choose another MASTER_PORT");
            if (served_job != job)
                throw CollectiveError(who + ": rank 0 at " + where + " serves another job (" + served_job +
                                      ", this one is " + job + "); give each job its own MASTER_PORT");
            return uri;
        }
        if (std::chrono::steady_clock::now() > deadline)
            throw CollectiveError(who + ": rank 0 did not serve MPI's name server at " + where +
                                  " in time: it did not start, or it has other MASTER_ADDR and MASTER_PORT");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

// What a launch without mpirun and without a name server of the user's needs before MPI_Init
// (Open MPI; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; OMPI_MCA_pmix_server_uri not):
// rank 0's server and its announcer (until the join is done), the others' fetch; every process
// then has OMPI_MCA_pmix_server_uri set. Nothing in any other case.
struct OwnNameServer {
    std::unique_ptr<NameServerProcess> server;
    std::unique_ptr<NameServerAnnouncer> announcer;
};

inline OwnNameServer meet_through_own_name_server([[maybe_unused]] const ProcessPlace& launcher,
                                                  [[maybe_unused]] std::chrono::seconds timeout) {
    OwnNameServer own;
#ifdef OPEN_MPI
    if (launcher.world_size <= 1 || real_env("OMPI_COMM_WORLD_SIZE") || real_env("PMIX_RANK") ||
        real_env("OMPI_MCA_pmix_server_uri"))
        return own;
    const std::string who = rank_prefix(launcher.rank, launcher.world_size, launcher.source);
    const auto at = name_server_address(who);
    if (!at) return own;
    const std::string job = join_service(launcher);
    const auto deadline = deadline_after(timeout);
    std::string uri;
    if (launcher.rank == 0) {
        own.server = std::make_unique<NameServerProcess>(who, deadline);
        uri = own.server->uri();
        own.announcer = std::make_unique<NameServerAnnouncer>(at->port, name_server_message(job, uri), who);
    } else {
        uri = fetch_name_server(*at, job, who, deadline);
    }
    ::setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
#endif
    return own;
}

}  // namespace gradsync::inline v0::detail
