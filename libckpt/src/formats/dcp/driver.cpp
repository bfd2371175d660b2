// SPDX-License-Identifier: Apache-2.0
// The DCP driver: a directory with `.metadata` (or rank-local `__N.metadata` files), Lightning's
// when it also holds meta.pt; and how its items are read (docs/formats/dcp.md, "Items"): each is
// a whole torch.save archive holding one tensor or one object, maybe zstd-compressed.
#include "ckpt/error.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "codecs/zstd.hpp"
#include "formats/dcp/metadata.hpp"
#include "formats/driver.hpp"
#include "index/item_decoder.hpp"
#include "text_helpers.hpp"
#include "zip/zip_reader.hpp"

namespace ckpt {
namespace {

class DcpItems final : public ItemDecoder {
 public:
  SourcePtr undo_transforms(SourcePtr s, const ChunkLocation& loc, std::uint64_t max_decoded) const override {
    if (loc.transforms().size() > 1) {
      throw Error(ErrorKind::kUnsupported, s->name(), 0,
                  std::to_string(loc.transforms().size()) + " stacked transforms; at most one is supported (docs/formats/dcp.md, \"Transforms\")");
    }
    for (const std::string& t : loc.transforms()) {
      const std::string name = t.substr(0, t.find('/'));
      const std::string version = t.find('/') == std::string::npos ? "" : t.substr(t.find('/') + 1);
      if (name != "stream.zstd") {
        throw Error(ErrorKind::kUnsupported, s->name(), 0, "unknown transform '" + t + "' (only stream.zstd/1 is known)");
      }
      if (!version.empty() && version.substr(0, version.find('.')) != "1") {
        throw Error(ErrorKind::kUnsupported, s->name(), 0, "transform '" + t + "' has major version other than 1");
      }
      s = codecs::zstd_decode(s, max_decoded);
    }
    return s;
  }

  ChunkData tensor(const SourcePtr& it, const TensorEntry& tensor, const Chunk& chunk) const override {
    TorchSaveFile f = read_torch_save(it);
    if (f.tensors.size() != 1 || !f.tensors[0].name.empty()) {
      throw Error(ErrorKind::kFormat, it->name(), 0,
                  "tensor item of '" + tensor.name + "' holds " + std::to_string(f.tensors.size()) +
                      " tensors at its top level, expected one");
    }
    const TorchTensor& t = f.tensors[0];
    if (t.dtype != tensor.dtype) {
      throw Error(ErrorKind::kMismatch, it->name(), 0,
                  "item of '" + tensor.name + "' is " + std::string(name(t.dtype)) + ", the metadata says " +
                      std::string(name(tensor.dtype)));
    }
    if (t.shape != chunk.sizes) {
      throw Error(ErrorKind::kMismatch, it->name(), 0,
                  "item of '" + tensor.name + "' has shape " + detail::shape_text(t.shape) + ", the chunk " +
                      detail::shape_text(chunk.sizes));
    }
    ChunkData d;
    d.dtype = tensor.dtype;
    d.shape = chunk.sizes;
    d.storage = f.storages[t.storage].data;
    d.crc32 = f.storages[t.storage].crc32;
    d.strides = t.stride;
    d.storage_offset = t.storage_offset;
    return d;
  }

  pickle::ValuePtr object(const SourcePtr& item) const override { return read_torch_save(item).root; }

  void check_checksums(const SourcePtr& item) const override {
    detail::ZipReader zip(item);
    for (const auto& e : zip.entries()) zip.verify_crc(e);
  }
};

}  // namespace

std::shared_ptr<const ItemDecoder> detail::dcp_items() {
  static const auto kItems = std::make_shared<const DcpItems>();
  return kItems;
}

namespace formats {
namespace {

bool is_dcp_part(const std::string& name);
std::filesystem::path parent_of(const std::filesystem::path& p) { return p.parent_path().empty() ? std::filesystem::path(".") : p.parent_path(); }

Format detect_dcp(const Probe& p) {
  // A data file or .metadata given alone is claimed, so that opening it says to pass its
  // directory (a .distcp starts as a zip archive, but is many of them).
  if (!p.directory) return is_dcp_part(p.path.filename().string()) && detect_dcp(Probe{parent_of(p.path), true, nullptr, {}}) != Format::kUnknown
                               ? Format::kDcp
                               : Format::kUnknown;
  std::error_code ec;
  const bool dcp = std::filesystem::exists(p.path / ".metadata", ec) || !detail::rank_local_metadata(p.path).empty();
  if (!dcp) return Format::kUnknown;
  return std::filesystem::exists(p.path / "meta.pt", ec) ? Format::kLightningSharded : Format::kDcp;
}

bool is_dcp_part(const std::string& name) {
  if (name == ".metadata" || name == ".metadata.tmp") return true;
  if (name.ends_with(".distcp")) return true;
  return name.starts_with("__") && name.ends_with(".metadata");  // rank-local (NOTE [Rank-local metadata])
}

Checkpoint open_dcp_path(const std::filesystem::path& path, MetaTrees trees) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) {
    throw Error(ErrorKind::kFormat, path.string(), std::nullopt,
                "this file is part of the DCP checkpoint in " + parent_of(path).string() + ": pass the directory");
  }
  return open_dcp(path, trees);
}

std::string dcp_near_miss(const Probe& p) {
  std::error_code ec;
  if (!p.directory) return {};
  if (std::filesystem::exists(p.path / ".metadata.tmp", ec)) {
    return "directory has .metadata.tmp but no .metadata: the save died before it committed (incomplete checkpoint)";
  }
  for (const auto& e : std::filesystem::directory_iterator(p.path, ec)) {
    if (e.path().extension() == ".distcp") {
      return "directory has DCP data files (" + e.path().filename().string() + ") but no .metadata: the save did not commit (incomplete checkpoint)";
    }
  }
  return {};
}

}  // namespace

const Driver kDcpDriver{"DCP directory", detect_dcp, open_dcp_path, dcp_near_miss};

}  // namespace formats
}  // namespace ckpt
