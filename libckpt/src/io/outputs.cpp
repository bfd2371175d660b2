// SPDX-License-Identifier: Apache-2.0
#include "io/outputs.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"
#include "ckpt/output.hpp"
#include "ckpt/test_hooks.hpp"

namespace ckpt {
namespace {

// NOTE [What --force replaces]
// A checkpoint is days of work, and an output path given by mistake may hold anything. So --force
// replaces only what a writer could have put there: a file, a symbolic link (the link, never what
// it points to), an empty directory, or a directory whose every entry is a file that a writer of
// the same kind writes (a DCP directory for shard and the trainer's sharded saves, a shard set of
// safetensors for merge --max-shard-size). A directory with anything else in it (a subdirectory,
// a config.json, a user's notes) is refused, naming the first such entry, and nothing is removed.
// A DCP directory without .metadata (an interrupted save) holds only such files and may be
// replaced; the old output stays under its name until the new one is complete (NOTE [Atomic outputs]).

// `name` without a temporary suffix of a dead or live writer (".tmp.<digits>").
std::string_view without_temp_suffix(std::string_view name) {
  const std::size_t at = name.rfind(".tmp.");
  if (at == std::string_view::npos || at + 5 == name.size()) return name;
  const std::string_view digits = name.substr(at + 5);
  return digits.find_first_not_of("0123456789") == std::string_view::npos ? name.substr(0, at) : name;
}

bool ends_with(std::string_view s, std::string_view suffix) { return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix; }

// Whether a writer of `kind` writes a file named `name` into its directory.
bool written_by(OutputKind kind, std::string_view name) {
  name = without_temp_suffix(name);
  switch (kind) {
    case OutputKind::kFile:
      return false;
    case OutputKind::kDcpDirectory:
      // .metadata (and the name it is written under), rank-local __N.metadata, the data files,
      // Lightning's meta.pt, Megatron's common.pt and metadata.json.
      return name == ".metadata" || name == ".metadata.tmp" || (name.starts_with("__") && ends_with(name, ".metadata")) || ends_with(name, ".distcp") ||
             name == "meta.pt" || name == "common.pt" || name == "metadata.json";
    case OutputKind::kSafetensorsDirectory:
      return ends_with(name, ".safetensors") || ends_with(name, ".safetensors.index.json");
    case OutputKind::kHuggingFaceFolder:
      return written_by(OutputKind::kSafetensorsDirectory, name) || name == kHuggingFaceConfigName;
  }
  return false;
}

std::string_view kind_text(OutputKind kind) {
  switch (kind) {
    case OutputKind::kFile: return "a file";
    case OutputKind::kDcpDirectory: return "a DCP checkpoint directory";
    case OutputKind::kSafetensorsDirectory: return "a directory of safetensors shards";
    case OutputKind::kHuggingFaceFolder: return "a Hugging Face model folder (safetensors shards and config.json)";
  }
  return "";
}

// Whether process `pid`, which named a temporary file last written at `written` (seconds since the
// epoch), still runs: not a zombie, and not a later process that was given the same pid.
bool writer_alive(pid_t pid, std::int64_t written) {
  if (pid == ::getpid()) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: kill() said it exists
  const std::size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  if (line[close + 2] == 'Z') return false;
  // Field 22, the start time in clock ticks after boot; fields from 3 on follow the ')'.
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  unsigned long long start_ticks = 0;
  for (int f = 3; f <= 22 && rest >> field; ++f) {
    if (f == 22) start_ticks = std::strtoull(field.c_str(), nullptr, 10);
  }
  std::ifstream boot("/proc/stat");
  long long btime = -1;
  for (std::string key; boot >> key;) {
    if (key == "btime") {
      boot >> btime;
      break;
    }
  }
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (btime < 0 || ticks <= 0 || start_ticks == 0) return true;
  const long long started = btime + static_cast<long long>(start_ticks / static_cast<unsigned long long>(ticks));
  return started <= written + 1;  // a process started after the file's last write did not write it
}

}  // namespace

std::vector<std::filesystem::path> remove_stale_temps(const std::filesystem::path& target) noexcept {
  std::vector<std::filesystem::path> removed;
  try {
    std::error_code ec;
    const std::filesystem::path dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
    const std::string base = target.filename().string();
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      for (const std::string_view tag : {".tmp.", ".old."}) {
        const std::string prefix = base + std::string(tag);
        if (n.size() <= prefix.size() || n.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string pid_text = n.substr(prefix.size());
        if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) continue;
        struct stat st {};
        if (::lstat(e.path().c_str(), &st) != 0) continue;
        if (writer_alive(static_cast<pid_t>(std::stol(pid_text)), static_cast<std::int64_t>(st.st_mtime))) continue;
        if (std::filesystem::remove_all(e.path(), ec) > 0 && !ec) removed.push_back(target.parent_path() / n);
      }
    }
  } catch (...) {
    // Best effort: what cannot be removed now is left for a later run.
  }
  return removed;
}

void check_output(const std::filesystem::path& output, OutputKind kind, Overwrite overwrite) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::symlink_status(output, ec);
  if (ec || !std::filesystem::exists(st)) return;
  if (overwrite == Overwrite::kNo) {
    throw Error(ErrorKind::kInvalidArgument, output.string(), std::nullopt, "output exists already (use --force to replace it)");
  }
  if (!std::filesystem::is_directory(st)) return;  // a file or a link: replaced by a rename
  const std::string allowed = "--force replaces a file, an empty directory" +
                              (kind == OutputKind::kFile ? std::string() : " or " + std::string(kind_text(kind))) +
                              ", nothing else: move it away or choose another output";
  for (const auto& e : std::filesystem::directory_iterator(output, ec)) {
    const std::string name = e.path().filename().string();
    const std::filesystem::file_status s = e.symlink_status(ec);
    if (std::filesystem::is_regular_file(s) && written_by(kind, name)) continue;
    const bool dir = std::filesystem::is_directory(s);
    throw Error(ErrorKind::kInvalidArgument, output.string(), std::nullopt,
                "output is a directory that holds '" + name + "'" + (dir ? " (a directory)" : "") + ", which " +
                    (kind == OutputKind::kFile ? "a file output cannot replace" : "is not part of " + std::string(kind_text(kind))) +
                    "; " + allowed);
  }
  if (ec) throw Error(ErrorKind::kIo, output.string(), std::nullopt, "cannot list the output directory: " + ec.message());
}

void replace_output(const std::filesystem::path& built, const std::filesystem::path& output) { detail::move_into_place(built, output); }

namespace detail {

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

void sync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, std::string("cannot open the directory: ") + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, std::string("fsync failed: ") + std::strerror(err));
}

void move_into_place(const std::filesystem::path& built, const std::filesystem::path& output) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::absolute(output).parent_path();
  test_hooks::crash_point("replace");
  if (!std::filesystem::exists(std::filesystem::symlink_status(output, ec))) {
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

}  // namespace detail
}  // namespace ckpt

namespace ckpt {
namespace {

// Before writing: check_output, then removes what dead runs left beside `output`, noting each on
// `progress` (which may be null).
void prepare_output(const std::filesystem::path& output, OutputKind kind, Overwrite overwrite, Progress* progress) {
  check_output(output, kind, overwrite);
  for (const std::filesystem::path& p : remove_stale_temps(output)) {
    if (progress) progress->note("removed " + p.string() + ", left by an earlier run that did not finish");
  }
}

// `output` + `suffix`, emptied and created, after removing what dead runs left beside `output`.
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

class DirectoryFiles final : public OutputFiles {
 public:
  explicit DirectoryFiles(std::filesystem::path dir) : dir_(std::move(dir)) {}
  std::unique_ptr<PositionalSink> positional(const std::string& name) override { return open_positional_sink(dir_ / name, Overwrite::kYes); }
  std::unique_ptr<ByteSink> sequential(const std::string& name, const std::string& temp) override {
    return open_file_sink(dir_ / name, Overwrite::kYes, temp.empty() ? std::filesystem::path() : dir_ / temp);
  }
  std::uint64_t size_of(const std::string& name) const override {
    std::error_code ec;
    const std::uintmax_t size = std::filesystem::file_size(dir_ / name, ec);
    if (ec) throw Error(ErrorKind::kIo, (dir_ / name).string(), std::nullopt, "cannot read the size of the file written: " + ec.message());
    return size;
  }

 private:
  std::filesystem::path dir_;
};

// The file system's output (NOTE [Atomic outputs]): one file through its sink's temporary name; a
// directory built at `<output>.tmp.<pid>` (which a later run removes if this one dies) and moved
// into place whole.
class FileOutput final : public Output {
 public:
  FileOutput(std::filesystem::path path, Overwrite overwrite) : path_(std::move(path)), overwrite_(overwrite) {}
  ~FileOutput() override {
    if (!building_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(building_, ec);
    }
  }
  const std::filesystem::path& path() const noexcept override { return path_; }
  bool in_file_system() const noexcept override { return true; }
  void check(OutputKind kind) const override { check_output(path_, kind, overwrite_); }
  void prepare(OutputKind kind, Progress* progress) override { prepare_output(path_, kind, overwrite_, progress); }
  std::unique_ptr<PositionalSink> file() override { return open_positional_sink(path_, overwrite_); }
  OutputFiles& directory() override {
    if (!files_) {
      building_ = fresh_dir(path_, ".tmp." + std::to_string(::getpid()));
      files_ = std::make_unique<DirectoryFiles>(building_);
    }
    return *files_;
  }
  void commit_directory() override {
    if (building_.empty()) internal_error("commit_directory before directory()");
    detail::move_into_place(building_, path_);
    building_.clear();
  }

 private:
  std::filesystem::path path_;
  Overwrite overwrite_;
  std::filesystem::path building_;  // the directory being built; empty once committed
  std::unique_ptr<DirectoryFiles> files_;
};

}  // namespace

std::unique_ptr<Output> open_file_output(const std::filesystem::path& path, Overwrite overwrite) {
  return std::make_unique<FileOutput>(path, overwrite);
}

std::unique_ptr<OutputFiles> directory_files(const std::filesystem::path& dir) { return std::make_unique<DirectoryFiles>(dir); }

}  // namespace ckpt
