// SPDX-License-Identifier: Apache-2.0
#include <cstring>
#include <functional>

#include "ckpt/error.hpp"
#include "ckpt/output.hpp"

namespace ckpt {
namespace {

using Commit = std::function<void(std::string name, std::vector<std::byte> bytes)>;

class MemoryPositionalSink final : public PositionalSink {
 public:
  MemoryPositionalSink(std::string name, std::string file, Commit commit)
      : name_(std::move(name)), file_(std::move(file)), commit_(std::move(commit)) {}
  const std::string& name() const noexcept override { return name_; }
  const std::filesystem::path& temp_path() const noexcept override { return no_path_; }
  void resize(std::uint64_t size) override {
    const std::lock_guard lock(mutex_);
    bytes_.resize(size);
  }
  void write_at(std::uint64_t offset, std::span<const std::byte> bytes) override {
    const std::lock_guard lock(mutex_);
    if (offset + bytes.size() > bytes_.size()) bytes_.resize(offset + bytes.size());
    if (!bytes.empty()) std::memcpy(bytes_.data() + offset, bytes.data(), bytes.size());
  }
  void commit() override { commit_(std::move(file_), std::move(bytes_)); }

 private:
  std::string name_, file_;
  Commit commit_;
  std::mutex mutex_;
  std::vector<std::byte> bytes_;
  const std::filesystem::path no_path_;
};

class MemoryByteSink final : public ByteSink {
 public:
  MemoryByteSink(std::string name, std::string file, Commit commit) : name_(std::move(name)), file_(std::move(file)), commit_(std::move(commit)) {}
  const std::string& name() const noexcept override { return name_; }
  void write(std::span<const std::byte> bytes) override { bytes_.insert(bytes_.end(), bytes.begin(), bytes.end()); }
  using ByteSink::write;
  std::uint64_t offset() const noexcept override { return bytes_.size(); }
  void commit() override { commit_(std::move(file_), std::move(bytes_)); }

 private:
  std::string name_, file_;
  Commit commit_;
  std::vector<std::byte> bytes_;
};

}  // namespace

// A directory's files until commit_directory() hands them to the output.
class MemoryOutput::Files final : public OutputFiles {
 public:
  explicit Files(std::string prefix) : prefix_(std::move(prefix)) {}
  std::unique_ptr<PositionalSink> positional(const std::string& name) override {
    return std::make_unique<MemoryPositionalSink>(prefix_ + name, name, commit());
  }
  std::unique_ptr<ByteSink> sequential(const std::string& name, const std::string&) override {
    return std::make_unique<MemoryByteSink>(prefix_ + name, name, commit());
  }
  std::uint64_t size_of(const std::string& name) const override {
    const std::lock_guard lock(mutex_);
    const auto it = files_.find(name);
    if (it == files_.end()) throw Error(ErrorKind::kIo, prefix_ + name, std::nullopt, "no such file was written");
    return it->second.size();
  }
  std::map<std::string, std::vector<std::byte>> take() {
    const std::lock_guard lock(mutex_);
    return std::move(files_);
  }

 private:
  Commit commit() {
    return [this](std::string name, std::vector<std::byte> bytes) {
      const std::lock_guard lock(mutex_);
      files_[std::move(name)] = std::move(bytes);
    };
  }
  std::string prefix_;
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<std::byte>> files_;
};

MemoryOutput::MemoryOutput(std::filesystem::path name) : name_(std::move(name)) {}
MemoryOutput::~MemoryOutput() = default;

std::unique_ptr<PositionalSink> MemoryOutput::file() {
  return std::make_unique<MemoryPositionalSink>(name_.string(), std::string(), [this](std::string name, std::vector<std::byte> bytes) {
    const std::lock_guard lock(mutex_);
    committed_[std::move(name)] = std::move(bytes);
  });
}

OutputFiles& MemoryOutput::directory() {
  if (!directory_) directory_ = std::make_unique<Files>(name_.string() + "/");
  return *directory_;
}

void MemoryOutput::commit_directory() {
  if (!directory_) internal_error("commit_directory before directory()");
  std::map<std::string, std::vector<std::byte>> files = directory_->take();
  const std::lock_guard lock(mutex_);
  committed_ = std::move(files);
  directory_.reset();
}

SourcePtr MemoryOutput::source(const std::string& name) const {
  const auto it = committed_.find(name);
  if (it == committed_.end()) {
    throw Error(ErrorKind::kInvalidArgument, name_.string(), std::nullopt, "holds no committed file '" + name + "'");
  }
  return borrowed_source(it->second, name.empty() ? name_.string() : name_.string() + "/" + name);
}

}  // namespace ckpt
