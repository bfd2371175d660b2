// SPDX-License-Identifier: Apache-2.0
// The DCP writer's plan, shared by write_dcp (chunks given as bytes) and shard (chunks assembled
// from another checkpoint's chunks): which items each rank's files hold, in which order, and how
// each chunk's elements are made. Writing is split in two so that several processes can each
// write some ranks' files and one of them commit `.metadata` last (ops/shard.cpp):
//   plan_dcp_files -> write_dcp_files (any subset of the files) -> write_dcp_metadata.
// Uncompressed files are laid out from the plan (every item's size is known) and filled by the
// copy engine in one parallel run across all files; with stream.zstd/1 each item is streamed
// through one zstd frame, file by file, in bounded memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/copy.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/output.hpp"

namespace ckpt::detail {

/// A planned chunk: its rank and box, views of the plan's chunk table (DcpPlanChunks).
struct DcpPlanChunk {
  int rank = 0;
  std::span<const std::int64_t> offsets, sizes;
};

// A plan's FQNs are views of names its maker keeps for as long as the plan, never copies.
struct DcpPlanTensor {
  std::string_view fqn;
  std::size_t position = 0;  ///< order in state_dict_metadata, among tensors and objects
  DType dtype = DType::kFloat32;
  bool requires_grad = false;
  std::uint32_t chunk_count = 0;  ///< its chunks, in the order .metadata lists them, are in DcpPlan::chunks
  Dims shape;
  std::size_t first_chunk = 0, first_dim = 0;
};
static_assert(sizeof(DcpPlanTensor) <= 72, "a reshard plans one per tensor");

/// NOTE [Plan chunks]: every planned tensor's chunks in one table, a tensor's together and in
/// order: a rank each, and the offsets then sizes of each box, as many as the tensor has
/// dimensions. A reshard of 100,000 tensors plans 200,000 chunks or more; a vector of 56-byte
/// chunks per tensor cost twice as much (a vector, its heap block and malloc's header each).
class DcpPlanChunks {
 public:
  /// Appends a chunk to `t`. Chunks are added tensor after tensor: `t` has none yet, or its
  /// chunks are the last ones added. Throws kInvalidArgument when the box has not as many
  /// dimensions as `t`.
  void add(DcpPlanTensor& t, int rank, std::span<const std::int64_t> offsets, std::span<const std::int64_t> sizes);
  DcpPlanChunk get(const DcpPlanTensor& t, std::size_t k) const noexcept {
    const std::size_t n = t.shape.size();
    const std::int64_t* box = dims_.data() + t.first_dim + 2 * n * k;
    return {ranks_[t.first_chunk + k], {box, n}, {box + n, n}};
  }
  void set_rank(const DcpPlanTensor& t, std::size_t k, int rank) noexcept { ranks_[t.first_chunk + k] = rank; }
  /// Room for `chunks` chunks of `dims` offsets and sizes in all, so that the table is not grown
  /// by doubling (which holds both copies for a moment).
  void reserve(std::size_t chunks, std::size_t dims) {
    ranks_.reserve(chunks);
    dims_.reserve(dims);
  }

 private:
  std::vector<int> ranks_;
  std::vector<std::int64_t> dims_;
};

struct DcpPlanObject {
  std::string_view fqn;
  std::size_t position = 0;
  int rank = 0;
  SourcePtr item;  ///< the item's bytes before transforms: a torch.save archive of the value
};

struct DcpPlan {
  int world_size = 1;
  int files_per_rank = 1;
  DcpLayout layout = DcpLayout::kCurrent;
  DcpCompression compression = DcpCompression::kNone;
  int zstd_level = 3;
  std::vector<DcpPlanTensor> tensors;
  DcpPlanChunks chunks;  ///< the tensors' chunks
  std::vector<DcpPlanObject> objects;
  /// Set (one per tensor): which of each rank's files holds that tensor's chunks, bytes items in
  /// file 0; files_per_rank covers them all. Empty: plan_dcp_files splits as DCP does.
  std::vector<int> tensor_files;
  /// Adds the tasks that make the elements of chunk `chunk` of tensor `tensor` (C order, the
  /// tensor's dtype) at `base` in CRC group `group`, each task at most `max_task` bytes. One for
  /// the plan, not one per chunk: a reshard plans 300,000 chunks.
  std::function<void(std::vector<CopyTask>& tasks, std::size_t tensor, std::size_t chunk, std::uint64_t base, std::size_t group,
                     std::uint64_t max_task)>
      add_tasks;
  KeyPaths planner_data;  ///< FQN -> path (a tuple); others get (fqn,)
  /// When set, the paths used instead of planner_data, kept by the caller (a reshard's input's or
  /// a save's options), never copied.
  const KeyPaths* shared_paths = nullptr;
  const KeyPaths& paths() const noexcept { return shared_paths ? *shared_paths : planner_data; }
};

/// One data file and the items it holds, in write order (bytes items first, as DCP writes them).
struct DcpFilePlan {
  struct Ref {  // 12 bytes: a reshard plans one per chunk
    bool tensor = false;
    std::uint32_t index = 0;  ///< into DcpPlan::tensors or ::objects
    std::uint32_t chunk = 0;  ///< tensors: the tensor's chunk k (DcpPlanChunks::get)
  };
  int rank = 0;
  std::string name;  ///< "__{rank}_{n}.distcp"
  std::vector<Ref> items;
  std::uint64_t size = 0;  ///< before compression
};

/// Where one item went (a storage_data entry). Its FQN, offsets and file name are views of the
/// plan's (a reshard makes one item per chunk, so items must not own their names), or of what the
/// caller keeps for items it read elsewhere; they must outlive the item.
struct DcpItem {
  std::string_view fqn;
  bool tensor = false;
  std::span<const std::int64_t> offsets;  ///< a tensor item's chunk offsets
  std::size_t chunk_index = 0;
  std::string_view file;
  std::uint64_t offset = 0, length = 0;
};

/// Entries in state-dict order (by position; a plan's, or a checkpoint's) as 4-byte codes: tensor
/// i, or kObjectEntry | object j: one word per entry, not a tuple.
constexpr std::uint32_t kObjectEntry = 0x80000000u;
template <typename Tensors, typename Objects>
std::vector<std::uint32_t> entry_order(const Tensors& tensors, const Objects& objects) {
  if (tensors.size() >= kObjectEntry || objects.size() >= kObjectEntry) internal_error("entry_order: 2^31 entries or more");
  std::vector<std::uint32_t> order;
  order.reserve(tensors.size() + objects.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) order.push_back(static_cast<std::uint32_t>(i));
  for (std::size_t i = 0; i < objects.size(); ++i) order.push_back(kObjectEntry | static_cast<std::uint32_t>(i));
  auto position = [&](std::uint32_t c) { return c & kObjectEntry ? objects[c & ~kObjectEntry].position : tensors[c].position; };
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return position(a) < position(b); });
  return order;
}

/// Throws kInvalidArgument unless every tensor's chunks pass the checks PyTorch's coordinator
/// applies at save time (docs/formats/dcp.md#save-time-validation) and every rank and FQN is valid.
void validate_dcp_plan(const DcpPlan& plan);

/// Every rank's files, empty ones included. With files_per_rank K > 1, bytes items are dealt
/// round-robin and tensor items, largest first, each into the file with the fewest bytes so far
/// (DCP's thread_count split), unless the plan's tensor_files places them.
std::vector<DcpFilePlan> plan_dcp_files(const DcpPlan& plan);

/// Whether write_dcp_files returns where each item went, or (uncompressed) nothing: there an
/// item's place follows from the plan, and write_dcp_metadata(out, plan, files) makes them again
/// as it writes, so no list of every item is held through the copy. Compressed items' places
/// are known only once written, and are returned either way.
enum class ItemPlaces { kReturn, kFromPlan };

/// Writes `files` into `out`, each atomically, and returns
/// where each of their items went, in file order (see ItemPlaces). Throws what the tasks throw; a
/// file not committed is removed.
std::vector<DcpItem> write_dcp_files(OutputFiles& out, const DcpPlan& plan, std::span<const DcpFilePlan> files,
                                     const CopyOptions& copy, ItemPlaces places = ItemPlaces::kReturn);

/// Writes `.metadata` into `out`, through `.metadata.tmp` and a rename on a file system
/// (NOTE [.metadata last]).
void write_dcp_metadata(OutputFiles& out, const DcpPlan& plan, std::span<const DcpItem> items);
/// The same for every file of the plan (plan_dcp_files) written uncompressed: where each item went
/// follows from the plan alone, and is made as .metadata is written instead of held.
void write_dcp_metadata(OutputFiles& out, const DcpPlan& plan, std::span<const DcpFilePlan> files);

/// The bytes of a torch.save archive of `value` as a DCP bytes item holds it; storages named by
/// persistent ids in `value` come from `storage_data`.
std::vector<std::byte> bytes_item(const pickle::Value& value, DcpLayout layout,
                                  const std::function<SourcePtr(const std::string& key)>& storage_data = {});

}  // namespace ckpt::detail
