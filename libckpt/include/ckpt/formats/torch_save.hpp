// SPDX-License-Identifier: Apache-2.0
// torch.save files: a zip archive (docs/formats/torch_save.md) of stored records under one folder,
//   <archive>/data.pkl              protocol-2 pickle of the saved object; each storage is a
//                                   persistent id ('storage', <storage class>, <key>, <location>, <numel>)
//   <archive>/data/<key>            the storage's raw bytes, numel × element size, little-endian
//   <archive>/version               "3\n"   (required)
//   <archive>/byteorder             "little" | "big"   (optional, torch ≥ 2.1)
//   <archive>/.format_version, .storage_alignment, .data/serialization_id   (optional, ignored)
// Tensors are `torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
// requires_grad, backward_hooks[, metadata])` (v3 adds a dtype for storages without a legacy
// class), Parameters `_rebuild_parameter(tensor, requires_grad, hooks)` (docs/formats/torch_save.md#rebuild-calls).
// Checks on read (docs/formats/torch_save.md#reader-checks): one folder for all records; `version` present, an integer in
// [1, 10]; `byteorder` little (big is refused as unsupported); every storage record exists and
// holds exactly numel × element size bytes; one dtype per storage; every view inside its storage:
// storage_offset + Σ (size_i − 1)·stride_i < numel, sizes and strides ≥ 0.
// The legacy format (torch < 1.6, or _use_new_zipfile_serialization=False) is read too: a sequence
// of pickles, then the storages' bytes (docs/formats/torch_save.md#legacy-format); the tar format of
// torch < 0.4 is refused by name.
// What we write loads with torch.load(weights_only=True): protocol 2, GLOBAL only, the globals of docs/formats/torch_save.md#weights-only-globals.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/dtype.hpp"
#include "ckpt/io.hpp"
#include "ckpt/pickle.hpp"

namespace ckpt {

/// One storage record.
struct TorchStorage {
  std::string key;        ///< the record is `data/<key>`
  DType dtype;
  std::uint64_t numel;    ///< elements of `dtype`
  std::string location;   ///< "cpu", "cuda:0", ...
  SourcePtr data;         ///< the record's bytes (a window of the file, no copy)
  std::uint32_t crc32 = 0;  ///< the record's CRC-32 as the archive's central directory gives it (0: not recorded)
};

/// One tensor found in the object tree.
struct TorchTensor {
  std::string name;                 ///< keys from the top-level object joined with '.' ("model.0.weight")
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> stride; ///< in elements
  std::int64_t storage_offset = 0;  ///< in elements
  std::size_t storage = 0;          ///< index into TorchSaveFile::storages
  bool requires_grad = false;
  bool is_parameter = false;
  pickle::ValuePtr node;            ///< the rebuild call (or _rebuild_parameter) in the tree

  std::uint64_t numel() const noexcept;
  bool is_contiguous() const noexcept;
};

struct TorchSaveFile {
  bool legacy = false;                 ///< the legacy format: no archive, records or version
  std::string archive_name;            ///< the folder all records share
  std::vector<std::string> records;    ///< record names (without the folder), in archive order
  int version = 0;
  pickle::ValuePtr root;               ///< the saved object, lossless
  std::vector<TorchStorage> storages;  ///< in order of first reference
  std::vector<TorchTensor> tensors;    ///< in pickle order; a tensor referenced twice appears twice
  /// The other leaves of the tree (ints, strings, objects of other classes), named like tensors.
  std::vector<std::pair<std::string, pickle::ValuePtr>> objects;
  std::map<std::string, std::size_t> storage_index;  ///< key -> index
  /// Leaf name -> the str keys that lead to it from the root, for the leaves reached through
  /// str-keyed dicts alone: how to rebuild the nesting the name flattens.
  std::map<std::string, std::vector<pickle::ValuePtr>> key_paths;
};

/// Reads the archive (or the legacy format's pickles), the pickle and the layout of every tensor;
/// reads no tensor bytes. Throws ckpt::Error (kFormat, kUnsupported) naming the file or record and
/// the offset.
TorchSaveFile read_torch_save(SourcePtr source);

/// Whether `source` starts like a torch.save file: a zip archive ("PK\x03\x04") or the legacy
/// format's magic number.
bool looks_like_torch_save(const ByteSource& source);

/// Record layout to write.
enum class TorchSaveLayout {
  kCurrent,  ///< data.pkl, .format_version, .storage_alignment, byteorder, data/*, version (torch 2.x)
  kTorch113, ///< data.pkl, data/*, version (what torch 1.13 writes)
};

struct TorchSaveWriteOptions {
  std::string archive_name = "archive";  ///< what torch.save uses for streams
  TorchSaveLayout layout = TorchSaveLayout::kCurrent;
};

/// One member of a torch.save archive as it will be written: literal bytes (data.pkl, version,
/// ...) or a storage whose bytes come from elsewhere. A view into its TorchSaveRecords, valid
/// until a record is added to them.
struct TorchSaveRecord {
  std::string_view name;                   ///< the record, without the archive folder ("data/0")
  std::uint64_t size = 0;
  std::span<const std::byte> bytes;        ///< a literal record's bytes (none when `written`)
  bool storage = false;                    ///< a storage record: numel × element size bytes
  std::optional<std::uint32_t> written;    ///< a literal record whose bytes went out as they were made: their CRC-32
  /// A storage record's key (its name after "data/"); empty for a literal record.
  std::string_view storage_key() const noexcept { return storage ? name.substr(5) : std::string_view(); }
};

/// The records of a torch.save archive in archive order: data.pkl and the other literal records
/// before the storages, a storage record per storage, and `version`. A storage record is its size
/// and its name in one shared text, not a struct of strings: there is one per tensor, held for as
/// long as a merge's copy runs.
class TorchSaveRecords {
 public:
  std::size_t size() const noexcept { return head_.size() + sizes_.size() + tail_.size(); }
  TorchSaveRecord operator[](std::size_t i) const;

  /// A literal record: before the storages while there are none, after them once there are.
  void add_literal(std::string name, std::vector<std::byte> bytes, std::optional<std::uint32_t> written = std::nullopt,
                   std::uint64_t size = 0);
  /// A storage record "data/<key>", unless there is one of that key already (false then).
  bool add_storage(std::string_view key, std::uint64_t size);
  /// Orders the storage records by `less` on their keys.
  void sort_storages(const std::function<bool(std::string_view, std::string_view)>& less);
  /// Replaces literal record `i`'s bytes or, where they went out already, its size and CRC.
  void set_literal(std::size_t i, std::vector<std::byte> bytes, std::optional<std::uint32_t> written = std::nullopt,
                   std::uint64_t size = 0);

  class Iterator {
   public:
    Iterator(const TorchSaveRecords* r, std::size_t i) : r_(r), i_(i) {}
    TorchSaveRecord operator*() const { return (*r_)[i_]; }
    Iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator==(const Iterator& o) const { return i_ == o.i_; }

   private:
    const TorchSaveRecords* r_;
    std::size_t i_;
  };
  Iterator begin() const { return {this, 0}; }
  Iterator end() const { return {this, size()}; }

 private:
  struct Literal {
    std::string name;
    std::vector<std::byte> bytes;
    std::optional<std::uint32_t> written;
    std::uint64_t size = 0;
  };
  std::string_view storage_name(std::size_t s) const;
  std::vector<Literal> head_, tail_;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::uint32_t> name_ends_;  ///< into names_
  std::string names_;                     ///< "data/0data/1..."
  std::vector<std::uint32_t> slots_;      ///< the storages by key (NOTE [Open index])
};

/// The records of a torch.save archive of `root`, in archive order, with data.pkl pickled. The
/// copy engine lays them out with the zip layout and fills the storages; write_torch_save writes
/// them in order. `target` names the output in errors. Throws as write_torch_save does.
TorchSaveRecords plan_torch_save(const pickle::Value& root, const TorchSaveWriteOptions& options, const std::string& target);
/// The same for a tree too big to hold at once: each dict named in `streamed` is made batch by
/// batch while data.pkl is written (pickle::write_streamed), `persistent` the nodes shared
/// between batches (TorchSaveBuilder::shared_nodes()). data.pkl's bytes go to `pkl_out` in order
/// as they are made, not into its record, which gets their size and CRC-32 (`written`): merge
/// writes them straight into the output, at a data offset its size does not change (below 4 GiB).
/// The records equal plan_torch_save's of the whole tree otherwise.
TorchSaveRecords plan_torch_save_streamed(const pickle::Value& root,
                                          const std::unordered_map<const pickle::Value*, pickle::DictBatches>& streamed,
                                          const std::vector<pickle::ValuePtr>& persistent, const TorchSaveWriteOptions& options,
                                          const std::string& target, const std::function<void(std::span<const std::byte>)>& pkl_out);

/// Writes `root` as a torch.save archive. Each persistent id in the tree must be a torch storage
/// tuple; `storage_data(key)` gives its bytes, which must hold numel × element size bytes. Records
/// follow the order in which the pickle first references them. The sink is not committed.
/// Throws kInvalidArgument for a tree that is not a torch.save object.
void write_torch_save(ByteSink& sink, const pickle::Value& root,
                      const std::function<SourcePtr(const std::string& key)>& storage_data,
                      const TorchSaveWriteOptions& options = {});

/// Whether a TorchSaveBuilder keeps one key node per storage, shared by its views (torch.save's
/// bytes: a second view of a storage memo-references its key), or makes one per view. kPerView is
/// for a builder of very many storages of one view each (merge's output), whose key nodes would
/// otherwise stay for the builder's life, one per tensor. Two views of one
/// storage then write its key twice, a pickle torch.load reads alike.
enum class StorageKeys { kShared, kPerView };

/// Builds object trees of tensors for write_torch_save, the way torch.save pickles them.
class TorchSaveBuilder {
 public:
  explicit TorchSaveBuilder(StorageKeys keys = StorageKeys::kShared);
  /// A storage of `data.size() / element_size(dtype)` elements; returns its index. Its key is
  /// the index in decimal.
  std::size_t add_storage(DType dtype, SourcePtr data);
  /// A storage of `numel` elements whose bytes come later (the copy engine fills them after
  /// plan_torch_save); write() refuses a tree that uses it. Returns its index.
  std::size_t reserve_storage(DType dtype, std::uint64_t numel);
  /// The record key of storage `storage` ("data/<key>"): its index in decimal.
  std::string storage_key(std::size_t storage) const;
  /// A tensor view of storage `storage` (a `_rebuild_tensor_v2`/`_v3` call).
  pickle::ValuePtr tensor(std::size_t storage, std::vector<std::int64_t> shape, std::vector<std::int64_t> stride,
                          std::int64_t storage_offset = 0);
  /// A contiguous tensor over the whole storage, or its first numel(shape) elements.
  pickle::ValuePtr tensor(std::size_t storage, std::vector<std::int64_t> shape);
  /// An nn.Parameter around `tensor` (`_rebuild_parameter`).
  pickle::ValuePtr parameter(pickle::ValuePtr tensor, bool requires_grad = true);
  /// The nodes every tensor() shares (the persistent id's tag and location): what a streamed
  /// write keeps memoized across batches, as CPython's pickler does.
  std::vector<pickle::ValuePtr> shared_nodes() const { return {tag_, location_}; }
  /// Writes `root` with the storages added here.
  void write(ByteSink& sink, const pickle::Value& root, const TorchSaveWriteOptions& options = {}) const;

 private:
  struct Storage {
    std::uint64_t nbytes;
    DType dtype;
  };
  pickle::ValuePtr global(const std::string& module, const std::string& name);
  /// A key node for storage `storage`: its own with StorageKeys::kShared, a new one otherwise.
  pickle::ValuePtr key(std::size_t storage) const;
  StorageKeys key_nodes_;
  std::vector<Storage> storages_;
  std::vector<SourcePtr> data_;  ///< storage i's bytes, when i < size and it was added, not reserved
  std::vector<pickle::ValuePtr> keys_;  ///< StorageKeys::kShared: each storage's key node
  pickle::ValuePtr tag_, location_, hooks_global_;
  /// One node per global (the pickler memoizes globals by name, so sharing them changes no byte).
  std::map<std::string, pickle::ValuePtr, std::less<>> globals_;
};

/// Opens a torch.save file into the index: one raw chunk per tensor over its storage record (its
/// view kept), the other leaves as object entries, their key paths as planner_data. With
/// MetaTrees::kKeep the whole pickle tree is kept under the file's name.
Checkpoint open_torch_save_checkpoint(const std::filesystem::path& path, MetaTrees trees = MetaTrees::kDrop);

/// A Hugging Face `pytorch_model.bin.index.json`: its torch.save shards (file names inside the
/// index's directory) read as one checkpoint of their tensors; a tensor the weight_map names must be
/// in the shard it names.
Checkpoint open_torch_save_index_checkpoint(const std::filesystem::path& path);

/// The entry of tensor `t` of torch.save file `f`, whose bytes are file `file` of a checkpoint:
/// one raw chunk over its storage record, its view (offset, strides) kept. No bytes are read.
TensorEntry torch_save_tensor_entry(const TorchSaveFile& f, const TorchTensor& t, std::size_t file);

}  // namespace ckpt
