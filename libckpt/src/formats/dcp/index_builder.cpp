// SPDX-License-Identifier: Apache-2.0
#include "formats/dcp/index_builder.hpp"

#include <functional>
#include <stdexcept>

#include "ckpt/error.hpp"

namespace ckpt::detail {

std::string chunk_problem(const std::string& fqn, const Dims& shape, const Chunk& ch) {
  if (ch.offsets.size() != shape.size() || ch.sizes.size() != shape.size()) {
    return "chunk of '" + fqn + "' has " + std::to_string(ch.offsets.size()) + "-d offsets and " +
           std::to_string(ch.sizes.size()) + "-d sizes for a " + std::to_string(shape.size()) + "-d tensor";
  }
  for (std::size_t d = 0; d < shape.size(); ++d) {
    // Each term is non-negative (the readers check), so the sum is compared without overflow.
    if (ch.sizes[d] > shape[d] || ch.offsets[d] > shape[d] - ch.sizes[d]) {
      return "chunk of '" + fqn + "' spans [" + std::to_string(ch.offsets[d]) + ", " +
             std::to_string(static_cast<std::uint64_t>(ch.offsets[d]) + static_cast<std::uint64_t>(ch.sizes[d])) +
             ") in dimension " + std::to_string(d) + ", past the tensor's size " + std::to_string(shape[d]);
    }
  }
  return {};
}

void DcpIndexBuilder::fail(std::uint64_t at, const std::string& message) const {
  throw Error(ErrorKind::kFormat, source_, at, message);
}

void DcpIndexBuilder::add_tensor(TensorEntry t, std::uint64_t at) {
  t.position = c_.tensors.size() + c_.objects.size();
  add_fqn(t.name, true, c_.tensors.size(), at);
  c_.tensors.push_back(std::move(t));
}

void DcpIndexBuilder::add_bytes(const std::string& fqn, std::uint64_t at) {
  const std::size_t position = c_.tensors.size() + c_.objects.size();
  add_fqn(fqn, false, c_.objects.size(), at);
  c_.objects.push_back(ObjectEntry{fqn, position, nullptr, std::nullopt});
}

void DcpIndexBuilder::add_fqn(const std::string& fqn, bool tensor, std::size_t index, std::uint64_t at) {
  if (!entries_.insert(fqn, Placed{tensor, index})) fail(at, "state_dict_metadata names '" + fqn + "' twice");
  if (tensor) next_chunk_.push_back(0);
}

std::uint32_t DcpIndexBuilder::file_index(std::string_view name, std::uint64_t at) {
  // Items of one file mostly follow each other: the file named last first.
  if (last_file_ < c_.files.size() && c_.files[last_file_].relative == name) return last_file_;
  if (auto it = file_by_name_.find(name); it != file_by_name_.end()) return last_file_ = it->second;  // checked when first met
  std::filesystem::path p(name);
  bool bad = name.empty() || p.is_absolute() || name.find('\0') != std::string_view::npos || name.front() == '/';
  for (const auto& part : p) bad = bad || part == "..";
  if (bad) fail(at, "relative_path '" + std::string(name) + "' leaves the checkpoint directory (absolute or with '..')");
  CheckpointFile f;
  f.relative = name;
  f.path = c_.root / p;
  if (!resolves_inside(c_.root, f.path)) {
    fail(at, "relative_path '" + std::string(name) + "' is a symbolic link that leads outside the checkpoint directory");
  }
  std::error_code ec;
  const auto sz = std::filesystem::file_size(f.path, ec);
  if (!ec) f.size = sz;
  c_.files.push_back(std::move(f));
  const auto index = static_cast<std::uint32_t>(c_.files.size() - 1);
  file_by_name_.emplace(std::string(name), index);
  return last_file_ = index;
}

ChunkLocation::LayoutPtr DcpIndexBuilder::layout(std::vector<std::string> transforms) {
  if (!last_layout_ || last_layout_->transforms != transforms) {
    last_layout_ = ChunkLocation::LayoutPtr(ChunkLocation::Layout{std::move(transforms), {}, 0, 0});
  }
  return last_layout_;
}

void DcpIndexBuilder::add_storage(std::string_view fqn, bool tensor, Dims offsets, ChunkLocation loc, std::uint64_t at) {
  if (!place(fqn, tensor, offsets, loc, at) &&
      !pending_.emplace(Key{std::string(fqn), tensor, std::move(offsets)}, Pending{std::move(loc), at}).second) {
    fail(at, "storage_data names an entry at the same offsets twice");
  }
}

// Gives `loc` to the chunk (or bytes entry) `fqn` names, when that is known already: false
// when it is not (storage_data may come first). A chunk given two locations is an error.
bool DcpIndexBuilder::place(std::string_view fqn, bool tensor, const Dims& offsets, const ChunkLocation& loc, std::uint64_t at) {
  const std::optional<Placed> found = find_entry(fqn);
  if (!found || found->tensor != tensor) return false;
  if (!tensor) {
    ObjectEntry& o = c_.objects[found->index];
    if (o.item) fail(at, "storage_data names an entry at the same offsets twice");
    o.item = loc;
    return true;
  }
  // Chunks are usually listed in storage_data in their own order: try the one after the last
  // placed first.
  TensorEntry& t = c_.tensors[found->index];
  std::uint32_t& hint = next_chunk_[found->index];
  const std::size_t n = t.chunks.size();
  bool taken = false;
  for (std::size_t step = 0; step < n; ++step) {
    const std::size_t i = (hint + step) % n;
    Chunk& ch = t.chunks[i];
    if (ch.offsets != offsets) continue;
    if (ch.location) {
      taken = true;
      continue;
    }
    ch.location = loc;
    hint = static_cast<std::uint32_t>(i + 1);
    return true;
  }
  if (taken) fail(at, "storage_data names an entry at the same offsets twice");
  return false;
}

// storage_data lists each rank's items in the order of the entries, as a rule (a rank holds one
// chunk of each tensor): the tensor after the one placed last, and that one, are tried before the
// table. Names are unique among all entries, so a tensor of that name is the one the table would
// give. Neighbours' names mostly share a long prefix: their ends are compared first.
std::optional<DcpIndexBuilder::Placed> DcpIndexBuilder::find_entry(std::string_view fqn) {
  auto same = [&](const std::string& name) {
    const std::size_t n = name.size();
    return n == fqn.size() && (n == 0 || name[n - 1] == fqn[n - 1]) && std::string_view(name) == fqn;
  };
  for (const std::size_t i : {last_tensor_ + 1, last_tensor_}) {
    if (i < c_.tensors.size() && same(c_.tensors[i].name)) {
      last_tensor_ = i;
      return Placed{true, i};
    }
  }
  const std::optional<Placed> found = entries_.find(fqn);
  if (found && found->tensor) last_tensor_ = found->index;
  return found;
}

void DcpIndexBuilder::finish() {
  for (const auto& [key, p] : pending_) {
    if (!place(key.fqn, key.tensor, key.offsets, p.location, p.offset)) c_.unreferenced_storage.push_back(key.fqn);
  }
  pending_.clear();
  if (const auto& u = c_.unreferenced_storage; !u.empty()) {
    c_.notes.push_back(std::to_string(u.size()) + " storage_data entries belong to no chunk (first: '" + u.front() + "')");
  }
}

void DcpIndexBuilder::set_writer(std::string_view root_module, bool has_storage_meta, const std::string* version) {
  std::string w = root_module == "torch.distributed._shard.checkpoint.metadata" ? "torch 1.13 (torch.distributed._shard.checkpoint)"
                                                                                 : "torch >= 2.0";
  if (has_storage_meta) w = "torch >= 2.4";
  if (version) w += ", DCP version " + *version;
  c_.writer = std::move(w);
}

std::optional<DcpIndexBuilder::Placed> DcpIndexBuilder::EntryIndex::find(std::string_view fqn) const {
  if (slots_.empty()) return std::nullopt;
  for (std::size_t i = std::hash<std::string_view>{}(fqn) & mask();; i = (i + 1) & mask()) {
    if (slots_[i] == 0) return std::nullopt;
    const Placed p = decode(slots_[i]);
    if (name(p) == fqn) return p;
  }
}

bool DcpIndexBuilder::EntryIndex::insert(std::string_view fqn, Placed p) {
  if (find(fqn)) return false;
  if (p.index + 1 >= kTensor) throw std::length_error("more than 2^31 checkpoint entries");
  if (2 * (count_ + 1) > slots_.size()) grow();
  put(fqn, encode(p));
  ++count_;
  return true;
}

void DcpIndexBuilder::EntryIndex::put(std::string_view fqn, std::uint32_t v) {
  std::size_t i = std::hash<std::string_view>{}(fqn) & mask();
  while (slots_[i] != 0) i = (i + 1) & mask();
  slots_[i] = v;
}

void DcpIndexBuilder::EntryIndex::grow() {
  std::vector<std::uint32_t> old(std::max<std::size_t>(64, 2 * slots_.size()), 0);
  old.swap(slots_);
  for (std::uint32_t v : old) {
    if (v != 0) put(name(decode(v)), v);
  }
}

}  // namespace ckpt::detail
