// SPDX-License-Identifier: Apache-2.0
// The ByteSource implementations: pread files, mmap files, memory (owned or borrowed) and windows.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"

namespace ckpt {
namespace {

[[noreturn]] void throw_errno(const std::string& name, std::string_view what, std::optional<std::uint64_t> offset = {}) {
  throw Error(ErrorKind::kIo, name, offset, std::string(what) + ": " + std::strerror(errno));
}

int open_readonly(const std::filesystem::path& path, std::uint64_t& size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno(path.string(), "cannot open");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw_errno(path.string(), "cannot stat");
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw Error(ErrorKind::kIo, path.string(), std::nullopt, "is a directory, not a file");
  }
  size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::filesystem::path& path) : name_(path.string()) { fd_ = open_readonly(path, size_); }
  ~FileSource() override { ::close(fd_); }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return size_; }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    std::size_t done = 0;
    while (done < out.size()) {
      ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_errno(name_, "read failed", offset + done);
      }
      if (n == 0) throw Error(ErrorKind::kIo, name_, offset + done, "file shrank while reading");
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  std::string name_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

class SpanSource : public ByteSource {
 public:
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return data_.size(); }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    if (!out.empty()) std::memcpy(out.data(), data_.data() + offset, out.size());
  }
  std::optional<std::span<const std::byte>> view(std::uint64_t offset, std::uint64_t length) const override {
    if (offset > data_.size() || length > data_.size() - offset) return std::nullopt;
    return data_.subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(length));
  }

 protected:
  std::string name_;
  std::span<const std::byte> data_;
};

class MmapSource final : public SpanSource {
 public:
  explicit MmapSource(const std::filesystem::path& path) {
    name_ = path.string();
    std::uint64_t size = 0;
    int fd = open_readonly(path, size);
    if (size > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw_errno(name_, "cannot mmap");
      }
      map_ = p;
      data_ = std::span<const std::byte>(static_cast<const std::byte*>(p), static_cast<std::size_t>(size));
    }
    ::close(fd);
  }
  ~MmapSource() override {
    if (map_) ::munmap(map_, data_.size());
  }
  MmapSource(const MmapSource&) = delete;
  MmapSource& operator=(const MmapSource&) = delete;

  void release(std::uint64_t offset, std::uint64_t length) const override {
    if (!map_ || offset >= data_.size()) return;
    const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t end = std::min<std::uint64_t>(data_.size(), offset + length) / page * page;
    const std::uint64_t begin = (offset + page - 1) / page * page;
    if (begin >= end) return;
    // Clean pages of a private read-only mapping: dropping them loses nothing.
    ::madvise(static_cast<std::byte*>(map_) + begin, static_cast<std::size_t>(end - begin), MADV_DONTNEED);
  }

 private:
  void* map_ = nullptr;
};

class MemorySource final : public SpanSource {
 public:
  MemorySource(std::vector<std::byte> bytes, std::string name) : bytes_(std::move(bytes)) {
    name_ = std::move(name);
    data_ = bytes_;
  }
  MemorySource(std::span<const std::byte> bytes, std::string name) {
    name_ = std::move(name);
    data_ = bytes;
  }

 private:
  std::vector<std::byte> bytes_;
};

class SubSource final : public ByteSource {
 public:
  SubSource(SourcePtr parent, std::uint64_t offset, std::uint64_t length, std::string_view member)
      : parent_(std::move(parent)), offset_(offset), length_(length) {
    parent_->check_range(offset, length, "window '" + std::string(member) + "'");
    name_ = parent_->name() + "[" + std::string(member) + "]";
  }
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return length_; }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    parent_->read_at(offset_ + offset, out);
  }
  std::optional<std::span<const std::byte>> view(std::uint64_t offset, std::uint64_t length) const override {
    if (offset > length_ || length > length_ - offset) return std::nullopt;
    return parent_->view(offset_ + offset, length);
  }
  Window window() const noexcept {
    Window w = resolve_window(*parent_);
    return {w.root, w.offset + offset_};
  }

 private:
  SourcePtr parent_;
  std::uint64_t offset_;
  std::uint64_t length_;
  std::string name_;
};

}  // namespace

std::optional<std::span<const std::byte>> ByteSource::view(std::uint64_t, std::uint64_t) const { return std::nullopt; }
void ByteSource::release(std::uint64_t, std::uint64_t) const {}

void ByteSource::check_range(std::uint64_t offset, std::uint64_t length, std::string_view what) const {
  const std::uint64_t n = size();
  if (offset > n || length > n - offset) {
    throw Error(ErrorKind::kFormat, name(), offset,
                std::string(what) + " of " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
                    " passes the end of the data (" + std::to_string(n) + " bytes)");
  }
}

std::span<const std::byte> ByteSource::whole(std::vector<std::byte>& owned) const {
  if (auto v = view(0, size())) return *v;
  owned = read_vector(0, size());
  return owned;
}

std::vector<std::byte> ByteSource::read_vector(std::uint64_t offset, std::uint64_t length) const {
  check_range(offset, length, "read");
  std::vector<std::byte> out(static_cast<std::size_t>(length));
  read_at(offset, out);
  return out;
}

SourcePtr open_file(const std::filesystem::path& path) { return std::make_shared<FileSource>(path); }
SourcePtr open_mmap(const std::filesystem::path& path) { return std::make_shared<MmapSource>(path); }
SourcePtr memory_source(std::vector<std::byte> bytes, std::string name) {
  return std::make_shared<MemorySource>(std::move(bytes), std::move(name));
}
SourcePtr borrowed_source(std::span<const std::byte> bytes, std::string name) {
  return std::make_shared<MemorySource>(bytes, std::move(name));
}
SourcePtr sub_source(SourcePtr parent, std::uint64_t offset, std::uint64_t length, std::string_view member) {
  return std::make_shared<SubSource>(std::move(parent), offset, length, member);
}

Window resolve_window(const ByteSource& source) noexcept {
  if (auto* sub = dynamic_cast<const SubSource*>(&source)) return sub->window();
  return {&source, 0};
}

void stream_range(const ByteSource& source, std::uint64_t offset, std::uint64_t length,
                  const std::function<void(std::span<const std::byte>)>& out) {
  constexpr std::uint64_t kPiece = std::uint64_t{8} << 20;
  source.check_range(offset, length, "copy");
  std::vector<std::byte> buf;
  for (std::uint64_t at = 0; at < length;) {
    const std::uint64_t n = std::min(kPiece, length - at);
    if (auto v = source.view(offset + at, n)) {
      out(*v);
    } else {
      buf.resize(static_cast<std::size_t>(n));
      source.read_at(offset + at, buf);
      out(buf);
    }
    at += n;
  }
}

void MemorySink::write(std::span<const std::byte> bytes) {
  if (committed_) internal_error("write after commit on " + name_);
  bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
}

bool resolves_inside(const std::filesystem::path& dir, const std::filesystem::path& file) {
  std::error_code ec;
  const std::filesystem::path d = std::filesystem::weakly_canonical(dir, ec);
  const std::filesystem::path f = std::filesystem::weakly_canonical(file, ec);
  if (ec) return true;
  auto [di, fi] = std::mismatch(d.begin(), d.end(), f.begin(), f.end());
  return di == d.end() && fi != f.end();
}

}  // namespace ckpt
