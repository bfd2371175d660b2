// SPDX-License-Identifier: Apache-2.0
#include "ckpt/format.hpp"

#include <cstring>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"
#include "ckpt/safetensors.hpp"
#include "ckpt/torch_save.hpp"
#include "formats/dcp_metadata.hpp"

namespace ckpt {

std::string_view to_string(Format format) noexcept {
  switch (format) {
    case Format::kTorchSave: return "torch-save";
    case Format::kSafetensors: return "safetensors";
    case Format::kSafetensorsIndex: return "safetensors-index";
    case Format::kDcp: return "dcp";
    case Format::kLightningSharded: return "lightning-sharded";
    case Format::kHdf5: return "hdf5";
    case Format::kUnknown: return "unknown";
  }
  return "unknown";
}

Format detect_format(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    // .metadata, or rank-local __N.metadata files (NOTE [Rank-local metadata]).
    const bool dcp = std::filesystem::exists(path / ".metadata", ec) || !detail::rank_local_metadata(path).empty();
    if (!dcp) return Format::kUnknown;
    return std::filesystem::exists(path / "meta.pt", ec) ? Format::kLightningSharded : Format::kDcp;
  }
  SourcePtr src = open_file(path);
  if (looks_like_torch_save(*src)) return Format::kTorchSave;
  if (looks_like_safetensors(*src)) return Format::kSafetensors;
  if (src->size() >= 8) {
    std::byte head[8];
    src->read_at(0, head);
    if (std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0) return Format::kHdf5;
  }
  // A JSON object with a weight_map: a sharded safetensors index.
  const auto n = std::min<std::uint64_t>(src->size(), 4096);
  auto head = src->read_vector(0, n);
  std::string_view text(reinterpret_cast<const char*>(head.data()), head.size());
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && text[first] == '{' && text.find("\"weight_map\"") != std::string_view::npos) {
    return Format::kSafetensorsIndex;
  }
  return Format::kUnknown;
}

}  // namespace ckpt
