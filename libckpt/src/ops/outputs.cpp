// SPDX-License-Identifier: Apache-2.0
#include "ops/outputs.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <cstdio>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"
#include "ckpt/test_hooks.hpp"

namespace ckpt::detail {

void refuse_output_over_input(const std::filesystem::path& input, const std::filesystem::path& output) {
  std::error_code ec;
  const std::filesystem::path in = std::filesystem::weakly_canonical(input, ec);
  const std::filesystem::path out = std::filesystem::weakly_canonical(output, ec);
  if (in.empty() || out.empty()) return;
  auto [o, i] = std::mismatch(out.begin(), out.end(), in.begin(), in.end());
  if (o == out.end()) {
    throw Error(ErrorKind::kInvalidArgument, output.string(), std::nullopt,
                in == out ? "output is the input checkpoint" : "output is a directory that holds the input checkpoint");
  }
}

std::filesystem::path fresh_dir(const std::filesystem::path& output, const std::string& suffix) {
  remove_stale_temps(output);
  std::filesystem::path t = output;
  t += suffix;
  std::error_code ec;
  std::filesystem::remove_all(t, ec);
  if (!std::filesystem::create_directories(t, ec) && ec) {
    throw Error(ErrorKind::kIo, t.string(), std::nullopt, "cannot create the output directory: " + ec.message());
  }
  return t;
}

void sync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, std::string("cannot open the directory: ") + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, std::string("fsync failed: ") + std::strerror(err));
}

void move_dir_into_place(const std::filesystem::path& built, const std::filesystem::path& output) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::absolute(output).parent_path();
  test_hooks::crash_point("replace");
  if (!std::filesystem::exists(output, ec)) {
    std::filesystem::rename(built, output, ec);
    if (ec) throw Error(ErrorKind::kIo, output.string(), std::nullopt, "cannot move the new output into place: " + ec.message());
    sync_dir(parent);
    return;
  }
  // One atomic step: the new output takes the old one's name and the old one takes the
  // temporary name, so that at every instant `output` is one whole checkpoint or the other.
  if (::renameat2(AT_FDCWD, built.c_str(), AT_FDCWD, output.c_str(), RENAME_EXCHANGE) == 0) {
    sync_dir(parent);
    test_hooks::crash_point("exchanged");
    std::filesystem::remove_all(built, ec);  // the old output, now under the temporary name
    return;
  }
  if (errno != EINVAL && errno != ENOSYS) {
    throw Error(ErrorKind::kIo, output.string(), std::nullopt, std::string("cannot exchange the new output with the old: ") + std::strerror(errno));
  }
  // A file system without RENAME_EXCHANGE: the old output is moved aside first (a crash in
  // between leaves it at <output>.old.<pid>, which the next run removes).
  std::filesystem::path old = output;
  old += ".old." + std::to_string(::getpid());
  std::filesystem::rename(output, old, ec);
  if (ec) throw Error(ErrorKind::kIo, output.string(), std::nullopt, "cannot move the old output aside: " + ec.message());
  std::filesystem::rename(built, output, ec);
  if (ec) throw Error(ErrorKind::kIo, output.string(), std::nullopt, "cannot move the new output into place: " + ec.message());
  sync_dir(parent);
  std::filesystem::remove_all(old, ec);
}

}  // namespace ckpt::detail
