// SPDX-License-Identifier: Apache-2.0
// ckpt::Checkpoint, the format-neutral index every reader builds and every operation consumes
// (DESIGN.md): tensor entries with their chunk grid and where each chunk's bytes are, object
// entries (non-tensor values) as lossless pickle trees or as the location of a DCP bytes item,
// and provenance. Opening reads headers and metadata only; ChunkReader resolves a chunk's bytes
// when they are first needed.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/dims.hpp"
#include "ckpt/dtype.hpp"
#include "ckpt/format.hpp"
#include "ckpt/io.hpp"
#include "ckpt/key_paths.hpp"
#include "ckpt/pickle.hpp"

namespace ckpt {

/// Whether opening keeps the raw .metadata pickle tree.
enum class MetaTrees { kDrop, kKeep };

/// A file the checkpoint consists of or references.
struct CheckpointFile {
  std::string relative;                ///< as the metadata names it ("__0_0.distcp")
  std::filesystem::path path;          ///< where it is
  std::optional<std::uint64_t> size;   ///< std::nullopt when the file is missing
  /// The file's bytes where they are not read from `path` (an output kept in memory, read back);
  /// null: opened at `path`.
  SourcePtr source = nullptr;
};

/// How a chunk's bytes are stored at its location.
enum class ChunkEncoding : std::uint8_t {
  kRaw,   ///< the elements themselves (safetensors; a torch.save storage record)
  kItem,  ///< an item in its format's own encoding, read through Checkpoint::items (a DCP tensor item)
};

/// Where a chunk's bytes are. NOTE [Compact chunks] (dims.hpp): there is one per chunk, so what
/// few chunks have (transforms, a view's strides and storage offset) is kept out of line in one
/// shared, immutable block; a reader gives every chunk with the same transforms the same block.
struct ChunkLocation {
  std::uint64_t offset = 0;             ///< absolute offset in the file
  std::uint64_t length = 0;             ///< bytes at offset (after transforms, for DCP)
  std::uint32_t file = 0;               ///< index into Checkpoint::files
  ChunkEncoding encoding = ChunkEncoding::kRaw;

  struct Layout {
    std::vector<std::string> transforms;  ///< the format's transform descriptors, innermost first (DCP: "stream.zstd/1")
    std::vector<std::int64_t> strides;    ///< kRaw: element strides; empty means C-contiguous
    std::int64_t storage_offset;          ///< kRaw: first element, in elements from `offset` (0 when not given)
    std::uint32_t crc32;                  ///< kRaw in a torch.save file: the storage record's recorded CRC-32 (0: none)
  };
  /// A shared, immutable Layout with its count in its own block: one pointer wide, where a
  /// std::shared_ptr is two (NOTE [Compact chunks]).
  class LayoutPtr {
   public:
    LayoutPtr() noexcept = default;
    explicit LayoutPtr(Layout layout) : b_(new Block{std::move(layout), {1}}) {}
    LayoutPtr(const LayoutPtr& o) noexcept : b_(o.b_) {
      if (b_) b_->refs.fetch_add(1, std::memory_order_relaxed);
    }
    LayoutPtr(LayoutPtr&& o) noexcept : b_(std::exchange(o.b_, nullptr)) {}
    LayoutPtr& operator=(LayoutPtr o) noexcept {
      std::swap(b_, o.b_);
      return *this;
    }
    ~LayoutPtr() {
      if (b_ && b_->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete b_;
    }
    const Layout* get() const noexcept { return b_ ? &b_->layout : nullptr; }
    const Layout* operator->() const noexcept { return get(); }
    const Layout& operator*() const noexcept { return b_->layout; }
    explicit operator bool() const noexcept { return b_ != nullptr; }

   private:
    struct Block {
      Layout layout;
      std::atomic<std::uint32_t> refs;
    };
    Block* b_ = nullptr;
  };
  LayoutPtr layout;  ///< null: no transforms, C-contiguous, from `offset`

  const std::vector<std::string>& transforms() const noexcept { return layout ? layout->transforms : kNone.transforms; }
  const std::vector<std::int64_t>& strides() const noexcept { return layout ? layout->strides : kNone.strides; }
  std::int64_t storage_offset() const noexcept { return layout ? layout->storage_offset : 0; }
  std::uint32_t crc32() const noexcept { return layout ? layout->crc32 : 0; }

 private:
  static inline const Layout kNone{};
};

/// A ChunkLocation or none: std::optional's interface in ChunkLocation's own size, "none" being
/// an encoding no location has (NOTE [Compact chunks]).
class OptionalLocation {
 public:
  OptionalLocation() noexcept { reset(); }
  OptionalLocation(std::nullopt_t) noexcept { reset(); }  // NOLINT(google-explicit-constructor)
  OptionalLocation(ChunkLocation l) : l_(std::move(l)) {}  // NOLINT(google-explicit-constructor)
  OptionalLocation& operator=(std::nullopt_t) noexcept {
    reset();
    return *this;
  }
  OptionalLocation& operator=(ChunkLocation l) {
    l_ = std::move(l);
    return *this;
  }
  bool has_value() const noexcept { return l_.encoding != kNoLocation; }
  explicit operator bool() const noexcept { return has_value(); }
  const ChunkLocation& operator*() const noexcept { return l_; }
  ChunkLocation& operator*() noexcept { return l_; }
  const ChunkLocation* operator->() const noexcept { return &l_; }
  ChunkLocation* operator->() noexcept { return &l_; }
  const ChunkLocation& value() const {
    if (!has_value()) throw std::bad_optional_access();
    return l_;
  }
  ChunkLocation& emplace() {
    l_ = ChunkLocation{};
    return l_;
  }
  void reset() noexcept {
    l_ = ChunkLocation{};
    l_.encoding = kNoLocation;
  }

 private:
  static constexpr auto kNoLocation = static_cast<ChunkEncoding>(0xff);
  ChunkLocation l_;
};

/// One box of a tensor: [offsets, offsets + sizes) in every dimension.
struct Chunk {
  Dims offsets;  ///< NOTE [Compact chunks] (dims.hpp)
  Dims sizes;
  OptionalLocation location;  ///< none: the metadata gives no storage for it
};

struct TensorEntry {
  std::string name;  ///< FQN (DCP), key path joined with '.' (torch.save), tensor name (safetensors)
  std::size_t position = 0;  ///< among all entries, tensors and objects, in the order the format stores them
  DType dtype = DType::kFloat32;
  bool requires_grad = false;
  Dims shape;  ///< global shape
  std::vector<Chunk> chunks;
  std::uint64_t numel() const noexcept;
  std::uint64_t nbytes() const noexcept { return numel() * element_size(dtype); }
};

/// A non-tensor value: `value` when it is known (torch.save leaves, meta.pt), `item` when it is an
/// item still to be read through Checkpoint::items (a DCP bytes item).
struct ObjectEntry {
  std::string name;
  std::size_t position = 0;  ///< as TensorEntry::position
  pickle::ValuePtr value;
  OptionalLocation item;
};

class ItemDecoder;  // index/item_decoder.hpp: what a format's driver gives for its items
class FileChecks;   // index/file_checks.hpp: the checksums a format records over whole files

struct Checkpoint {
  Format format = Format::kUnknown;
  std::string writer;                 ///< the writer it looks like: "torch 1.13", "torch >= 2.3", ...
  std::optional<int> world_size;      ///< DCP: the number of ranks whose files it names
  std::filesystem::path root;         ///< the file or directory opened
  std::vector<CheckpointFile> files;
  std::vector<TensorEntry> tensors;   ///< in the order the format stores them
  std::vector<ObjectEntry> objects;
  std::vector<std::pair<std::string, std::string>> metadata;  ///< user metadata: key, rendering
  /// DCP: FQNs of storage_data entries that no chunk or bytes entry uses (verify reports them).
  std::vector<std::string> unreferenced_storage;
  std::vector<std::string> notes;     ///< provenance details ("Metadata has extra attribute 'mcore_data'")
  /// Raw metadata trees by name ("meta.pt", "common.pt"; with MetaTrees::kKeep also ".metadata",
  /// or a torch.save file's whole tree under its file name).
  std::vector<std::pair<std::string, pickle::ValuePtr>> meta_trees;
  /// DCP: planner_data, FQN -> path of keys (str or int), when the checkpoint has it. torch.save:
  /// the same for each leaf reached through dicts and lists (TorchSaveFile::key_paths), so that
  /// merge rebuilds the nesting.
  KeyPaths planner_data;
  /// How this checkpoint's items (ChunkEncoding::kItem, ObjectEntry::item) are read; set by the
  /// driver that opened it, null for formats without items.
  std::shared_ptr<const ItemDecoder> items;
  /// The checksums its files record beyond chunks and items (verify --deep); set by the driver,
  /// null for formats that record none.
  std::shared_ptr<const FileChecks> file_checks;

  const TensorEntry* find_tensor(std::string_view name) const noexcept;
};

/// A chunk's elements, resolved: the bytes that hold them and their layout.
struct ChunkData {
  SourcePtr storage;                  ///< the bytes the view indexes into
  DType dtype;
  std::vector<std::int64_t> shape;    ///< == the chunk's sizes
  std::vector<std::int64_t> strides;  ///< element strides (C-contiguous filled in)
  std::int64_t storage_offset = 0;    ///< first element
  /// `storage`'s CRC-32 as its archive records it (a DCP tensor item's storage record, a torch.save
  /// file's); 0 when none is recorded (safetensors, HDF5).
  std::uint32_t crc32 = 0;
};

/// How ChunkReader opens files: mapped (fast random reads; pages read count toward RSS), with
/// pread (the copy engine: memory bounded by its buffers), or with pread where each DCP item of up
/// to 64 KiB is read whole at once (one read instead of one per zip record; for callers that read
/// an item and let it go: verify, diff, stats).
enum class FileAccess { kMap, kRead, kReadSmallItemsWhole };

/// The most bytes an object item may decode to (a zstd frame that expands past it is refused):
/// far more than any optimizer's param_groups or RNG state, far less than the machine's memory.
constexpr std::uint64_t kMaxObjectItem = std::uint64_t{256} << 20;

/// Reads chunk data and items. Opens each file once, on first use. Thread-safe.
class ChunkReader {
 public:
  explicit ChunkReader(const Checkpoint& checkpoint, FileAccess access = FileAccess::kMap);
  /// Throws kFormat/kMismatch naming the file and offset when an item does not decode or does not
  /// agree with the metadata (dtype, shape), kIo when a file cannot be opened.
  ChunkData read(const TensorEntry& tensor, const Chunk& chunk) const;
  /// The bytes at `location`, its format's transforms undone (decoding at most `max_decoded`
  /// bytes; read() bounds a tensor item by its chunk's bytes plus 1 MiB).
  SourcePtr item(const ChunkLocation& location, std::uint64_t max_decoded = kMaxObjectItem) const;
  /// The value an object item holds, or the entry's known value.
  pickle::ValuePtr object_value(const ObjectEntry& entry) const;
  /// Checks every checksum an item at `location` records over its bytes (nothing for kRaw).
  void check_checksums(const ChunkLocation& location) const;
  SourcePtr file(std::size_t index) const;
  const Checkpoint& checkpoint() const noexcept { return checkpoint_; }

 private:
  const ItemDecoder& decoder() const;
  const Checkpoint& checkpoint_;
  FileAccess access_;
  mutable std::mutex mutex_;
  mutable std::map<std::size_t, SourcePtr> open_;
};

/// C-contiguous strides for `shape`.
std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape);

/// Elements [begin, end) of `tensor`, flattened in C order, as its dtype's bytes: read from the
/// chunks that hold them, and of each only the bytes of those elements, a row at a time (an
/// encoded item is decoded whole first). Elements no chunk holds are zeros. Throws what read()
/// throws, and kInvalidArgument for a range past the tensor's end.
std::vector<std::byte> read_elements(const ChunkReader& reader, const TensorEntry& tensor, std::uint64_t begin, std::uint64_t end);
/// The same into `out`, which holds (end - begin) elements. It is cleared first only where the
/// chunks' parts in the range do not add up to it exactly (in an index require_valid_index passes,
/// chunks neither overlap nor leave holes): a caller may pass memory it has not initialized.
void read_elements(const ChunkReader& reader, const TensorEntry& tensor, std::uint64_t begin, std::uint64_t end, std::span<std::byte> out);

}  // namespace ckpt
