// SPDX-License-Identifier: Apache-2.0
// FileSink: the atomic file output every writer uses.
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

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"

namespace ckpt {
namespace {

constexpr std::size_t kBufferSize = std::size_t{1} << 20;

class FileSink final : public ByteSink {
 public:
  FileSink(std::filesystem::path target, Overwrite overwrite, std::filesystem::path temp)
      : target_(std::move(target)), temp_(std::move(temp)), overwrite_(overwrite), name_(target_.string()) {
    std::error_code ec;
    if (overwrite_ == Overwrite::kNo && std::filesystem::exists(target_, ec)) {
      throw Error(ErrorKind::kInvalidArgument, name_, std::nullopt, "output exists already (use --force to replace it)");
    }
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC;
    if (temp_.empty()) {
      temp_ = target_;
      temp_ += ".tmp." + std::to_string(::getpid());
      flags |= O_EXCL;
    } else {
      flags |= O_TRUNC;  // a fixed temporary name (.metadata.tmp) left by a dead writer is replaced
    }
    fd_ = ::open(temp_.c_str(), flags, 0644);
    if (fd_ < 0) fail("cannot create temporary file " + temp_.string());
    buffer_.reserve(kBufferSize);
  }
  ~FileSink() override {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  const std::string& name() const noexcept override { return name_; }
  std::uint64_t offset() const noexcept override { return written_ + buffer_.size(); }

  void write(std::span<const std::byte> bytes) override {
    if (committed_) internal_error("write after commit on " + name_);
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
    if (committed_) return;
    flush();
    if (::fsync(fd_) != 0) fail("fsync failed");
    if (::close(fd_) != 0) {
      fd_ = -1;
      fail("close failed");
    }
    fd_ = -1;
    if (overwrite_ == Overwrite::kYes) {
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
    sync_directory();
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw Error(ErrorKind::kIo, name_, std::nullopt, what + ": " + std::strerror(errno));
  }

  void flush() {
    if (buffer_.empty()) return;
    write_fully(buffer_);
    buffer_.clear();
  }

  void write_fully(std::span<const std::byte> bytes) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("write failed at offset " + std::to_string(written_));
      }
      done += static_cast<std::size_t>(n);
      written_ += static_cast<std::uint64_t>(n);
    }
  }

  void sync_directory() {
    std::filesystem::path dir = target_.parent_path();
    if (dir.empty()) dir = ".";
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

  std::filesystem::path target_;
  std::filesystem::path temp_;
  Overwrite overwrite_;
  std::string name_;
  int fd_ = -1;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

}  // namespace

std::unique_ptr<ByteSink> open_file_sink(const std::filesystem::path& target, Overwrite overwrite,
                                         const std::filesystem::path& temp) {
  return std::make_unique<FileSink>(target, overwrite, temp);
}

}  // namespace ckpt
