// SPDX-License-Identifier: Apache-2.0
// A format driver: how one checkpoint format is recognised and opened into the index. The index
// (ckpt/checkpoint.hpp) knows no format; detection and opening walk the registry's list of
// drivers (formats/registry.cpp). A driver lives in formats/<name>/ with its reader and writer,
// decodes its own items (index/item_decoder.hpp), and registers with one line in the registry.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "ckpt/checkpoint.hpp"
#include "ckpt/format.hpp"
#include "ckpt/io.hpp"

namespace ckpt::formats {

/// What detection looks at: a directory, or a file with its first bytes at hand.
struct Probe {
  const std::filesystem::path& path;
  bool directory = false;
  const ByteSource* file = nullptr;   ///< null for a directory
  std::span<const std::byte> head;    ///< a file's first kHeadBytes bytes, fewer when it is shorter
};
inline constexpr std::size_t kHeadBytes = 4096;

struct Driver {
  std::string_view name;  ///< what the "not a checkpoint" error lists ("DCP directory")
  /// The format `probe` holds when it is this driver's, else Format::kUnknown. Reads nothing but
  /// the probe (and, for a directory, the names in it); throws only kIo.
  Format (*detect)(const Probe& probe);
  /// Opens a path detect() accepted. Throws ckpt::Error naming the file and offset.
  Checkpoint (*open)(const std::filesystem::path& path, MetaTrees trees);
  /// Why a path no driver accepts is nearly this format and what is missing ("a .metadata.tmp
  /// but no .metadata: the save died before it committed"); empty: nothing to say. May throw
  /// the error that says what the path is instead (a legacy torch.save file: kUnsupported).
  std::string (*near_miss)(const Probe& probe) = nullptr;
};

/// Every driver, in the order detection asks them.
std::span<const Driver* const> drivers();

/// Each format's driver, defined beside its reader.
extern const Driver kTorchSaveDriver;
extern const Driver kSafetensorsDriver;
extern const Driver kDcpDriver;
extern const Driver kHdf5Driver;
extern const Driver kHuggingFaceIndexDriver;
extern const Driver kHuggingFaceFolderDriver;
extern const Driver kDcpSafetensorsDriver;

}  // namespace ckpt::formats
