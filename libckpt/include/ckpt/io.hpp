// SPDX-License-Identifier: Apache-2.0
// Bytes in and bytes out. Every format reads through a ByteSource (positional, const, so one
// source serves many threads) and writes through a ByteSink (atomic for files: a temporary name,
// fsync and rename on commit(), removed when abandoned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ckpt {

/// A read-only, random-access sequence of bytes with a name for error messages.
///
/// Thread-safe: every operation is const and positional.
class ByteSource {
 public:
  virtual ~ByteSource() = default;

  /// The name errors use: a path, or `parent[member]` for a window.
  virtual const std::string& name() const noexcept = 0;
  virtual std::uint64_t size() const noexcept = 0;

  /// Fills `out` with the bytes at [`offset`, `offset + out.size()`). Throws ckpt::Error kFormat
  /// (naming this source and `offset`) when the range passes the end, kIo when the OS fails.
  virtual void read_at(std::uint64_t offset, std::span<std::byte> out) const = 0;

  /// The bytes at [`offset`, `offset + length`) without a copy, when they are already in memory
  /// (memory and mmap sources); std::nullopt otherwise or when the range is out of bounds.
  virtual std::optional<std::span<const std::byte>> view(std::uint64_t offset, std::uint64_t length) const;

  /// A hint that [`offset`, `offset + length`) will not be read again soon: a mapped source gives
  /// the whole pages inside it back to the system (they are read again if needed); others ignore it.
  virtual void release(std::uint64_t offset, std::uint64_t length) const;

  /// All of this source's bytes: a view where they are in memory, else read into `owned` (which
  /// then holds them for as long as the span is used).
  std::span<const std::byte> whole(std::vector<std::byte>& owned) const;

  /// Reads [`offset`, `offset + length`) into a new buffer, after checking the range against
  /// size() (so a length read from a file cannot make us allocate more than the file holds).
  std::vector<std::byte> read_vector(std::uint64_t offset, std::uint64_t length) const;

  /// Throws kFormat "<what> at [begin, end) passes the end of the data (size bytes)" unless the
  /// range lies inside this source.
  void check_range(std::uint64_t offset, std::uint64_t length, std::string_view what) const;
};

using SourcePtr = std::shared_ptr<const ByteSource>;

/// Opens `path` for positional reads (pread). Throws kIo naming the path.
SourcePtr open_file(const std::filesystem::path& path);
/// Maps `path` read-only; view() then never copies. Throws kIo naming the path.
SourcePtr open_mmap(const std::filesystem::path& path);
/// A source that owns `bytes`.
SourcePtr memory_source(std::vector<std::byte> bytes, std::string name = "<memory>");
/// A source over memory that the caller keeps alive for as long as the source lives.
SourcePtr borrowed_source(std::span<const std::byte> bytes, std::string name = "<memory>");
/// The window [`offset`, `offset + length`) of `parent`, named `<parent>[<member>]`. Offsets in
/// its errors count from the window's first byte. Throws kFormat if the window passes the end.
SourcePtr sub_source(SourcePtr parent, std::uint64_t offset, std::uint64_t length, std::string_view member);

/// Where a SubSource window sits in its parent, for callers that want to read the parent directly
/// (the copy engine does, to issue one large read).
struct Window {
  const ByteSource* root;    ///< the outermost source that holds the bytes
  std::uint64_t offset;      ///< where the window starts inside `root`
};
/// The outermost source and offset behind `source` (itself and 0 for a non-window source).
Window resolve_window(const ByteSource& source) noexcept;

/// The copy engine's inner loop: hands [`offset`, `offset + length`) of `source` to `out` in
/// pieces of at most 8 MiB, without a copy where the source is in memory. Throws what the source
/// throws.
void stream_range(const ByteSource& source, std::uint64_t offset, std::uint64_t length,
                  const std::function<void(std::span<const std::byte>)>& out);

/// Removes what dead writers left beside `target`: `<target>.tmp.<pid>` and `<target>.old.<pid>`
/// files and directories whose writer no longer runs (a run killed with
/// SIGKILL; a process that is a zombie, or whose pid now belongs to a process started after the
/// file was last written, counts as dead). A live writer's are never touched. Every sink calls it
/// before it creates its own temporary file. Returns what it removed, so that a tool can say so.
std::vector<std::filesystem::path> remove_stale_temps(const std::filesystem::path& target) noexcept;

/// Whether `file`, named inside directory `dir`, also resolves inside it once symbolic links are
/// followed (a missing file counts as inside: it is reported where it is read). Readers refuse a
/// file that leads out, so that nothing outside a checkpoint directory is ever read.
bool resolves_inside(const std::filesystem::path& dir, const std::filesystem::path& file);

/// Whether a writer may replace what is at its output path (`--force`); see check_output.
enum class Overwrite { kNo, kYes };

/// What a writer puts at its output path.
enum class OutputKind {
  kFile,                  ///< one file: torch.save, safetensors, HDF5
  kDcpDirectory,          ///< a DCP directory: .metadata, *.distcp, Lightning's meta.pt, Megatron's common.pt
  kSafetensorsDirectory,  ///< Hugging Face shards: *.safetensors and their *.safetensors.index.json
  kHuggingFaceFolder,     ///< those shards and the model's config.json (kHuggingFaceConfigName)
};

/// The model's configuration in a Hugging Face model folder.
inline constexpr const char* kHuggingFaceConfigName = "config.json";

/// Refuses to write at `output` unless nothing is there or, with Overwrite::kYes, what is there may
/// be replaced: a file, a symbolic link (itself, not what it points to), an empty directory, or a
/// directory that holds nothing but what a writer of `kind` writes (NOTE [What --force replaces]).
/// Only reads. Throws kInvalidArgument naming what is in the way.
void check_output(const std::filesystem::path& output, OutputKind kind, Overwrite overwrite);

/// Puts the finished output `built` (a file or a directory beside `output`) in `output`'s place:
/// renamed there, or, when `output` exists (check_output has allowed replacing it), exchanged with
/// it in one atomic step and the old one removed, so that `output` always names one whole output
/// (NOTE [Atomic outputs]). Throws kIo.
void replace_output(const std::filesystem::path& built, const std::filesystem::path& output);

/// A sequential byte writer. Nothing a sink writes is visible under its final name before commit().
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual const std::string& name() const noexcept = 0;
  /// Appends `bytes`. Throws kIo.
  virtual void write(std::span<const std::byte> bytes) = 0;
  /// The number of bytes written so far.
  virtual std::uint64_t offset() const noexcept = 0;
  /// Makes the output durable and visible. After commit() the sink takes no more writes.
  virtual void commit() = 0;

  void write(const void* data, std::size_t size) {
    write(std::span<const std::byte>(static_cast<const std::byte*>(data), size));
  }
};

/// Writes `<target>.tmp.<pid>` beside `target`; commit() flushes, fsyncs, and moves it to
/// `target` (atomically; with Overwrite::kNo it fails if `target` appeared meanwhile) and fsyncs
/// the directory. Destroying the sink without commit() removes the temporary file.
/// Throws kIo; kInvalidArgument when check_output(`target`, `replaces`, `overwrite`) refuses.
/// `temp` names the temporary file instead (DCP writes `.metadata` through `.metadata.tmp`).
/// `replaces`: the kind of directory at `target` that the file may replace with Overwrite::kYes
/// (a full checkpoint replacing a sharded one); kFile: an empty one only.
std::unique_ptr<ByteSink> open_file_sink(const std::filesystem::path& target, Overwrite overwrite,
                                         const std::filesystem::path& temp = {}, OutputKind replaces = OutputKind::kFile);

/// A file written at known offsets, by many threads at once (the copy engine). Atomic like
/// open_file_sink: nothing is visible under the target name before commit().
class PositionalSink {
 public:
  virtual ~PositionalSink() = default;
  virtual const std::string& name() const noexcept = 0;
  /// The temporary file the bytes go to until commit() (a library that writes files by name,
  /// libhdf5, lays out the file there first).
  virtual const std::filesystem::path& temp_path() const noexcept = 0;
  /// Sets the file's size (the copy engine knows it before it writes anything). Throws kIo.
  virtual void resize(std::uint64_t size) = 0;
  /// Writes `bytes` at `offset`. Thread-safe. Throws kIo.
  virtual void write_at(std::uint64_t offset, std::span<const std::byte> bytes) = 0;
  /// fsync, move into place, fsync the directory. Throws kIo, or kInvalidArgument as open_file_sink.
  virtual void commit() = 0;
};

/// As open_file_sink, for positional writes.
std::unique_ptr<PositionalSink> open_positional_sink(const std::filesystem::path& target, Overwrite overwrite,
                                                     const std::filesystem::path& temp = {});

/// A sink into memory, for tests and for building small records.
class MemorySink final : public ByteSink {
 public:
  explicit MemorySink(std::string name = "<memory>") : name_(std::move(name)) {}
  const std::string& name() const noexcept override { return name_; }
  void write(std::span<const std::byte> bytes) override;
  using ByteSink::write;
  std::uint64_t offset() const noexcept override { return bytes_.size(); }
  void commit() override { committed_ = true; }
  bool committed() const noexcept { return committed_; }
  const std::vector<std::byte>& bytes() const noexcept { return bytes_; }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::string name_;
  std::vector<std::byte> bytes_;
  bool committed_ = false;
};

}  // namespace ckpt
