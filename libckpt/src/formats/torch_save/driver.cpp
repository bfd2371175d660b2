// SPDX-License-Identifier: Apache-2.0
// The torch.save driver: a zip archive of records, or the legacy format (ckpt/formats/torch_save.hpp),
// opened into the index, one raw chunk per tensor over its storage's bytes.
#include <algorithm>

#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "formats/driver.hpp"
#include "formats/torch_save/legacy.hpp"
#include "formats/torch_save/zip_checks.hpp"
#include "zip/zip_reader.hpp"

namespace ckpt {
namespace {

// The record CRCs of every torch.save zip archive among a checkpoint's files (a single file, or the
// shards of a pytorch_model.bin index); a legacy file records none.
class ZipChecks final : public FileChecks {
 public:
  void check(const Checkpoint& c, const ChunkReader& reader, Progress& progress) const override {
    for (std::size_t i = 0; i < c.files.size(); ++i) {
      if (!c.files[i].size) continue;
      const SourcePtr file = reader.file(i);
      if (!detail::starts_like_zip(*file)) continue;
      detail::ZipReader zip(file);
      for (const auto& e : zip.entries()) {
        zip.verify_crc(e);
        progress.advance(e.size);
      }
    }
  }
};

std::string torch_writer_guess(const std::vector<std::string>& records) {
  auto has = [&](std::string_view r) { return std::find(records.begin(), records.end(), r) != records.end(); };
  // docs/formats/torch_save.md, "Which release wrote it".
  if (has(".storage_alignment")) return "torch >= 2.6";
  if (has(".format_version") || has(".data/serialization_id")) return "torch >= 2.2";
  if (has("byteorder")) return "torch >= 2.1";
  return "torch 1.6 - 2.0";
}

}  // namespace

TensorEntry torch_save_tensor_entry(const TorchSaveFile& f, const TorchTensor& t, std::size_t file) {
  const TorchStorage& st = f.storages[t.storage];
  TensorEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  e.shape = t.shape;
  e.requires_grad = t.requires_grad;
  ChunkLocation loc;
  loc.file = static_cast<std::uint32_t>(file);
  loc.offset = resolve_window(*st.data).offset;
  loc.length = st.data->size();
  const bool strided = t.stride != contiguous_strides(t.shape);
  if (strided || t.storage_offset != 0 || st.crc32 != 0) {
    loc.layout = ChunkLocation::LayoutPtr(ChunkLocation::Layout{{}, strided ? t.stride : std::vector<std::int64_t>{}, t.storage_offset, st.crc32});
  }
  e.chunks.push_back({std::vector<std::int64_t>(t.shape.size(), 0), t.shape, loc});
  return e;
}

Checkpoint open_torch_save_checkpoint(const std::filesystem::path& path, MetaTrees trees) {
  SourcePtr src = open_mmap(path);
  TorchSaveFile f = read_torch_save(src);
  Checkpoint c;
  c.format = Format::kTorchSave;
  c.root = path;
  c.writer = f.legacy ? "the legacy format: torch < 1.6, or _use_new_zipfile_serialization=False" : torch_writer_guess(f.records);
  c.files.push_back({path.filename().string(), path, src->size()});
  for (const TorchTensor& t : f.tensors) {
    c.tensors.push_back(torch_save_tensor_entry(f, t, 0));
    c.tensors.back().position = c.tensors.size() - 1;
  }
  for (auto& [name, v] : f.objects) c.objects.push_back({name, c.tensors.size() + c.objects.size(), v, std::nullopt});
  for (auto& [name, keys] : f.key_paths) c.planner_data.add(name, pickle::make_tuple(keys));
  // The whole tree (for --meta) only when asked: the leaves already hold the objects they need,
  // and the rest is a node per tensor's rebuild call.
  if (trees == MetaTrees::kKeep) c.meta_trees.emplace_back(path.filename().string(), f.root);
  if (!f.legacy) c.file_checks = detail::torch_save_file_checks();
  return c;
}

std::shared_ptr<const FileChecks> detail::torch_save_file_checks() {
  static const auto checks = std::make_shared<const ZipChecks>();
  return checks;
}

namespace formats {

const Driver kTorchSaveDriver{
    "torch.save",
    [](const Probe& p) { return !p.directory && looks_like_torch_save(*p.file) ? Format::kTorchSave : Format::kUnknown; },
    open_torch_save_checkpoint,
    [](const Probe& p) {
      if (!p.directory) detail::refuse_other_torch_save(*p.file);  // says what it is instead
      return std::string();
    },
};

}  // namespace formats
}  // namespace ckpt
