// SPDX-License-Identifier: Apache-2.0
// FileSink and PositionalFileSink: the atomic file outputs every writer uses.
//
// NOTE [Atomic outputs]
// A file appears under its final name only when it is complete and durable: bytes go to
// `<target>.tmp.<pid>` in the same directory, commit() flushes, fsyncs, moves the file into place
// and fsyncs the directory. Without --force the move is link()+unlink(), which fails if the target
// appeared meanwhile, so nothing is ever overwritten by accident. A sink destroyed before commit()
// (an exception, a failed check) unlinks its temporary file: an interrupted run leaves the old
// output or nothing.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <string_view>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"
#include "ckpt/test_hooks.hpp"
#include "io/outputs.hpp"

namespace ckpt {

namespace {

constexpr std::size_t kBufferSize = std::size_t{1} << 20;

// The temporary file behind both sinks: created beside the target, moved into place by commit(),
// unlinked when abandoned.
class TempFile {
 public:
  TempFile(std::filesystem::path target, Overwrite overwrite, std::filesystem::path temp, OutputKind replaces = OutputKind::kFile)
      : target_(std::move(target)), temp_(std::move(temp)), overwrite_(overwrite), name_(target_.string()) {
    check_output(target_, replaces, overwrite_);
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC;
    if (temp_.empty()) {
      remove_stale_temps(target_);
      temp_ = target_;
      temp_ += ".tmp." + std::to_string(::getpid());
      flags |= O_EXCL;
    } else {
      flags |= O_TRUNC;  // a fixed temporary name (.metadata.tmp) left by a dead writer is replaced
    }
    fd_ = ::open(temp_.c_str(), flags, 0644);
    if (fd_ < 0) fail("cannot create temporary file " + temp_.string());
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const noexcept { return fd_; }
  const std::filesystem::path& temp() const noexcept { return temp_; }
  const std::string& name() const noexcept { return name_; }
  bool committed() const noexcept { return committed_; }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorKind::kIo, name_, std::nullopt, what + ": " + std::strerror(errno));
  }

  void commit() {
    if (committed_) return;
    if (::fsync(fd_) != 0) fail("fsync failed");
    if (::close(fd_) != 0) {
      fd_ = -1;
      fail("close failed");
    }
    fd_ = -1;
    test_hooks::crash_point("rename");
    std::error_code ec;
    if (overwrite_ == Overwrite::kYes && std::filesystem::is_directory(std::filesystem::symlink_status(target_, ec))) {
      detail::move_into_place(temp_, target_);  // a directory check_output allowed: exchanged, then removed
    } else if (overwrite_ == Overwrite::kYes) {
      if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("cannot rename " + temp_.string() + " into place");
    } else {
      if (::link(temp_.c_str(), target_.c_str()) != 0) {
        if (errno == EEXIST) {
          throw Error(ErrorKind::kInvalidArgument, name_, std::nullopt, "output appeared while writing; not replaced");
        }
        fail("cannot move " + temp_.string() + " into place");
      }
      ::unlink(temp_.c_str());
    }
    committed_ = true;
    test_hooks::crash_point("renamed");
    std::filesystem::path dir = target_.parent_path();
    if (dir.empty()) dir = ".";
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  Overwrite overwrite_;
  std::string name_;
  int fd_ = -1;
  bool committed_ = false;
};

class FileSink final : public ByteSink {
 public:
  FileSink(std::filesystem::path target, Overwrite overwrite, std::filesystem::path temp, OutputKind replaces)
      : file_(std::move(target), overwrite, std::move(temp), replaces) {
    buffer_.reserve(kBufferSize);
  }

  const std::string& name() const noexcept override { return file_.name(); }
  std::uint64_t offset() const noexcept override { return written_ + buffer_.size(); }

  void write(std::span<const std::byte> bytes) override {
    if (file_.committed()) internal_error("write after commit on " + name());
    if (buffer_.size() + bytes.size() <= kBufferSize) {
      buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
      return;
    }
    flush();
    if (bytes.size() >= kBufferSize) {
      write_fully(bytes);
    } else {
      buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    }
  }

  void commit() override {
    if (file_.committed()) return;
    flush();
    file_.commit();
  }

 private:
  void flush() {
    if (buffer_.empty()) return;
    write_fully(buffer_);
    buffer_.clear();
  }

  void write_fully(std::span<const std::byte> bytes) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::write(file_.fd(), bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        file_.fail("write failed at offset " + std::to_string(written_));
      }
      done += static_cast<std::size_t>(n);
      written_ += static_cast<std::uint64_t>(n);
    }
  }

  TempFile file_;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0;
};

class PositionalFileSink final : public PositionalSink {
 public:
  PositionalFileSink(std::filesystem::path target, Overwrite overwrite, std::filesystem::path temp)
      : file_(std::move(target), overwrite, std::move(temp)) {}

  const std::string& name() const noexcept override { return file_.name(); }
  const std::filesystem::path& temp_path() const noexcept override { return file_.temp(); }

  void resize(std::uint64_t size) override {
    if (::ftruncate(file_.fd(), static_cast<off_t>(size)) != 0) file_.fail("cannot size the output to " + std::to_string(size) + " bytes");
  }

  void write_at(std::uint64_t offset, std::span<const std::byte> bytes) override {
    if (file_.committed()) internal_error("write after commit on " + name());
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::pwrite(file_.fd(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        file_.fail("write failed at offset " + std::to_string(offset + done));
      }
      done += static_cast<std::size_t>(n);
    }
  }

  void commit() override { file_.commit(); }

 private:
  TempFile file_;
};

}  // namespace

std::unique_ptr<ByteSink> open_file_sink(const std::filesystem::path& target, Overwrite overwrite,
                                         const std::filesystem::path& temp, OutputKind replaces) {
  return std::make_unique<FileSink>(target, overwrite, temp, replaces);
}

std::unique_ptr<PositionalSink> open_positional_sink(const std::filesystem::path& target, Overwrite overwrite,
                                                     const std::filesystem::path& temp) {
  return std::make_unique<PositionalFileSink>(target, overwrite, temp);
}

}  // namespace ckpt
