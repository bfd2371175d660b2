// SPDX-License-Identifier: Apache-2.0
// The multi-process tests' launcher: runs this very binary as the ranks of a case, with RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun sets them, on a free loopback port; and
// the modes a test binary runs in besides Catch2's session (catch_rank_main.cpp): `rank CASE`,
// what launch_ranks starts, and any other a test file registers with a Mode.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace fsdp_test {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Runs `/proc/self/exe rank CASE` as `world` ranks; true when every rank exits 0.
inline bool launch_ranks(const std::string& case_name, int world) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execl("/proc/self/exe", "fsdp-test-rank", "rank", case_name.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

/// Ends this test case as skipped: CTest runs one case a process and reports exit 77 as skipped.
[[noreturn]] inline void skip(const std::string& why) {
  std::cout << "SKIPPED: " << why << std::endl;
  std::exit(77);
}

/// `BINARY NAME ARG` runs the function registered under NAME with ARG; its return is the exit status.
using ModeFn = std::function<int(const std::string& arg)>;
inline std::map<std::string, ModeFn>& modes() {
  static std::map<std::string, ModeFn> m;
  return m;
}
/// Registers a mode at static initialisation: `const fsdp_test::Mode kRank{"rank", rank_main};`.
struct Mode {
  Mode(const std::string& name, ModeFn f) { modes().emplace(name, std::move(f)); }
};

}  // namespace fsdp_test
