// SPDX-License-Identifier: Apache-2.0
// Where an operation's output goes. merge and shard write through an Output: one file, or a
// directory of files, nothing of it under the output's name before it is whole. A format's writer
// writes a directory's files through OutputFiles and knows neither where they live nor how they
// are made visible. open_file_output puts the output in the file system (NOTE [Atomic outputs]);
// MemoryOutput keeps it in memory, for tests and for callers that want the bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckpt/io.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

/// Files made by name in one place, each atomic on its own (nothing under its name before its
/// sink's commit()). Thread-safe: several files may be open and written at once.
class OutputFiles {
 public:
  virtual ~OutputFiles() = default;
  /// New file `name`, written at known offsets. Throws kIo.
  virtual std::unique_ptr<PositionalSink> positional(const std::string& name) = 0;
  /// New file `name`, written in order; until committed it goes by `temp` where that is given and
  /// the files live in the file system (DCP's `.metadata.tmp`). Throws kIo.
  virtual std::unique_ptr<ByteSink> sequential(const std::string& name, const std::string& temp = {}) = 0;
  /// The size of committed file `name`. Throws kIo when there is none.
  virtual std::uint64_t size_of(const std::string& name) const = 0;
};

/// An operation's output: written either as one file (file()) or as a directory (directory(), then
/// commit_directory()), never both.
class Output {
 public:
  virtual ~Output() = default;
  /// The output's name in results and messages: its path, for one in the file system.
  virtual const std::filesystem::path& path() const noexcept = 0;
  /// Whether path() is where the output is written, in the file system (what libhdf5, which
  /// writes files by name, and several processes writing one DCP directory need).
  virtual bool in_file_system() const noexcept = 0;
  /// Throws kInvalidArgument unless an output of `kind` may be put at path() (check_output). Only
  /// reads.
  virtual void check(OutputKind kind) const = 0;
  /// Before anything is written: check(), then removes what dead runs left beside the output,
  /// noting each on `progress` (which may be null).
  virtual void prepare(OutputKind kind, Progress* progress) = 0;
  /// The output as one file: committing the sink puts it in place. Throws kIo.
  virtual std::unique_ptr<PositionalSink> file() = 0;
  /// The output as a directory, empty at the first call; its files are under a temporary name
  /// until commit_directory(). Throws kIo.
  virtual OutputFiles& directory() = 0;
  /// Puts the directory, its files committed, in the output's place. An output destroyed before
  /// this removes what its directory holds. Throws kIo.
  virtual void commit_directory() = 0;
};

/// The output at `path` in the file system. Overwrite::kYes lets it replace what check_output
/// allows; the replaced output stays whole under its name until the new one takes it.
std::unique_ptr<Output> open_file_output(const std::filesystem::path& path, Overwrite overwrite);

/// The files of directory `dir`, which exists, each written under a temporary name and renamed
/// (replacing a file of the same name). For writers that fill a directory in place (write_dcp,
/// several processes sharing one output's directory).
std::unique_ptr<OutputFiles> directory_files(const std::filesystem::path& dir);

/// An output kept in memory: no file system is touched.
class MemoryOutput final : public Output {
 public:
  explicit MemoryOutput(std::filesystem::path name = "<memory>");
  ~MemoryOutput() override;
  const std::filesystem::path& path() const noexcept override { return name_; }
  bool in_file_system() const noexcept override { return false; }
  void check(OutputKind) const override {}
  void prepare(OutputKind, Progress*) override {}
  std::unique_ptr<PositionalSink> file() override;
  OutputFiles& directory() override;
  void commit_directory() override;

  /// The committed output: the one file under the name "", or the directory's files by name;
  /// nothing before it is committed.
  const std::map<std::string, std::vector<std::byte>>& files() const noexcept { return committed_; }
  /// A committed file as a source (named `<output name>/<name>`), for reading it back. Throws
  /// kInvalidArgument when there is none.
  SourcePtr source(const std::string& name = {}) const;

 private:
  class Files;
  std::filesystem::path name_;
  std::unique_ptr<Files> directory_;
  std::mutex mutex_;  // guards committed_ against a file() sink committing
  std::map<std::string, std::vector<std::byte>> committed_;
};

}  // namespace ckpt
