// SPDX-License-Identifier: Apache-2.0
// Hugging Face's conventions as drivers: an index that shards weights over files
// (`model.safetensors.index.json`, `pytorch_model.bin.index.json`), and a model folder as
// `save_pretrained` leaves it, read through the weights file it holds.
#include <array>
#include <string_view>

#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "formats/driver.hpp"
#include "formats/huggingface/weight_map.hpp"

namespace ckpt::formats {
namespace {

// A JSON object with a weight_map near its start: an index. Which shards it names tells its kind
// (safetensors files, or torch.save ".bin" files).
Format detect_index(const Probe& p) {
  if (p.directory) return Format::kUnknown;
  const std::string_view text(reinterpret_cast<const char*>(p.head.data()), p.head.size());
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || text[first] != '{' || text.find("\"weight_map\"") == std::string_view::npos) return Format::kUnknown;
  const auto at = text.find("\"weight_map\"");
  const bool bins = text.find(".bin\"", at) != std::string_view::npos && text.find(".safetensors\"", at) == std::string_view::npos;
  return bins ? Format::kTorchSaveIndex : Format::kSafetensorsIndex;
}

Checkpoint open_index(const std::filesystem::path& path, MetaTrees) { return detail::open_weight_map(path); }

// What save_pretrained writes, in the order transformers prefers them.
struct Weights {
  std::string_view file;
  Format format;
};
constexpr std::array<Weights, 4> kWeights{{{"model.safetensors.index.json", Format::kSafetensorsIndex},
                                           {"model.safetensors", Format::kSafetensors},
                                           {"pytorch_model.bin.index.json", Format::kTorchSaveIndex},
                                           {"pytorch_model.bin", Format::kTorchSave}}};

const Weights* weights_in(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const Weights& w : kWeights) {
    if (std::filesystem::is_regular_file(dir / w.file, ec)) return &w;
  }
  return nullptr;
}

Checkpoint open_folder(const std::filesystem::path& dir, MetaTrees trees) {
  const Weights* w = weights_in(dir);
  if (!w) throw Error(ErrorKind::kFormat, dir.string(), std::nullopt, "no weights file (model.safetensors[.index.json], pytorch_model.bin[.index.json])");
  const std::filesystem::path file = dir / w->file;
  switch (w->format) {
    case Format::kSafetensorsIndex: return open_safetensors_index_checkpoint(file);
    case Format::kSafetensors: return open_safetensors_checkpoint(file);
    case Format::kTorchSaveIndex: return open_torch_save_index_checkpoint(file);
    default: return open_torch_save_checkpoint(file, trees);
  }
}

}  // namespace

const Driver kHuggingFaceIndexDriver{"Hugging Face index", detect_index, open_index};

const Driver kHuggingFaceFolderDriver{
    "Hugging Face model folder",
    [](const Probe& p) {
      const Weights* w = p.directory ? weights_in(p.path) : nullptr;
      return w ? w->format : Format::kUnknown;
    },
    open_folder,
};

}  // namespace ckpt::formats
