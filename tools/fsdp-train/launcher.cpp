// SPDX-License-Identifier: Apache-2.0
#include "fsdp-train/launcher.hpp"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_train {
namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::runtime_error(std::string("finding a free port: ") + std::strerror(e));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string how(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  return "stopped";
}

}  // namespace

int launch_local(int nproc, int argc, char** argv) {
  const std::string port = std::to_string(free_port());
  sigset_t handled, old;
  sigemptyset(&handled);
  sigaddset(&handled, SIGINT);
  sigaddset(&handled, SIGTERM);
  sigaddset(&handled, SIGCHLD);
  sigprocmask(SIG_BLOCK, &handled, &old);
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids(static_cast<std::size_t>(nproc), -1);
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      if (::getppid() != launcher) ::_exit(1);
      sigprocmask(SIG_SETMASK, &old, nullptr);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("FSDP_TRAIN_LAUNCHED", "1", 1);
      // OpenMP's idle threads sleep instead of spinning, unless the user chose otherwise. LibTorch's
      // OpenMP pool and OpenBLAS's own threads (libopenblas0-pthread) take turns on the same cores:
      // spinning, the pool took them from the matrix products, and one process at 2 threads on 2
      // cores stepped the 3.2M-parameter GPT in about twice the time. libgomp reads this at start.
      ::setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
      std::vector<char*> args(argv, argv + argc);
      args.push_back(nullptr);
      ::execv("/proc/self/exe", args.data());
      std::cerr << "fsdp-train: error: rank " << r << ": exec /proc/self/exe: " << std::strerror(errno) << "\n";
      ::_exit(127);
    }
    pids[static_cast<std::size_t>(r)] = pid;
  }
  int running = nproc;
  int failed_rank = -1;
  bool failed_usage = false;  // the first rank to fail exited 2
  std::string failure;
  bool killed = false;
  auto signal_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) ::kill(p, sig);
    }
  };
  while (running > 0) {
    siginfo_t info{};
    timespec wait{1, 0};
    const int sig = ::sigtimedwait(&handled, &info, &wait);
    if (sig == SIGINT || sig == SIGTERM) {
      signal_all(sig);  // each rank finishes its step, saves and exits 0
      continue;
    }
    // SIGCHLD or the timeout: reap whatever ended.
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (int r = 0; r < nproc; ++r) {
        if (pids[static_cast<std::size_t>(r)] != pid) continue;
        pids[static_cast<std::size_t>(r)] = -1;
        --running;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank < 0) {
          failed_rank = r;
          failed_usage = WIFEXITED(status) && WEXITSTATUS(status) == 2;
          failure = how(status);
          signal_all(SIGTERM);
        }
      }
    }
    if (failed_rank >= 0 && running > 0 && !killed) {
      static int waited = 0;
      if (sig < 0 && ++waited >= 10) {  // 10 s after SIGTERM: the others are stuck in a collective
        signal_all(SIGKILL);
        killed = true;
      }
    }
  }
  sigprocmask(SIG_SETMASK, &old, nullptr);
  if (failed_rank >= 0) {
    if (failed_usage) return 2;  // a usage error, which every rank finds alike and rank 0 has said
    std::cerr << "fsdp-train: error: rank " << failed_rank << " of " << nproc << " " << failure << "; stopped the other ranks\n";
    return 1;
  }
  return 0;
}

}  // namespace fsdp_train
