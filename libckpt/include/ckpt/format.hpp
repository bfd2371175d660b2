// SPDX-License-Identifier: Apache-2.0
// Which checkpoint format a path holds, decided from its content, never from its name.
#pragma once

#include <filesystem>
#include <string_view>

namespace ckpt {

enum class Format {
  kTorchSave,
  kTorchSaveIndex,
  kSafetensors,
  kSafetensorsIndex,
  kDcp,
  kLightningSharded,
  kDcpSafetensors,  ///< DCP's Hugging Face storage: safetensors files with DCP_SHARDING_INFO, no .metadata
  kHdf5,
  kUnknown,
};

/// "torch-save", "safetensors", "dcp", ... (the names `fsdp-ckpt-inspect --json` prints).
std::string_view to_string(Format format) noexcept;

/// Whether `format` is a DCP directory (Lightning's sharded folder is one with a meta.pt).
constexpr bool is_dcp(Format format) noexcept { return format == Format::kDcp || format == Format::kLightningSharded; }

/// Looks at the first bytes of a file, or at the entries of a directory. Throws ckpt::Error kIo
/// when `path` cannot be read.
Format detect_format(const std::filesystem::path& path);

}  // namespace ckpt
