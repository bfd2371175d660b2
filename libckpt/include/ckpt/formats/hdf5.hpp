// SPDX-License-Identifier: Apache-2.0
// HDF5 files as fsdp-ckpt-merge writes them (through libhdf5; built when FSDP_WITH_HDF5 is on):
// one contiguous, unfiltered dataset per tensor, in groups by key path ('/' inside a key is
// written as %2F, '%' as %25), little-endian, with attributes
//   dtype   the torch dtype name ("float32", "bfloat16", ...)
//   shape   the torch shape (int64[]; also for 0-d tensors, which are scalar datasets)
// bool is stored as uint8, bfloat16 as uint16 (both named by the dtype attribute); float16 as
// IEEE half, which h5py reads as float16. The file is laid out by libhdf5 first (space allocated
// early, no fill), then the copy engine writes every dataset's bytes at the offset libhdf5 gives,
// so HDF5 output shares the one copy engine and its memory bound.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace ckpt {

/// Whether HDF5 can be used: the build has it and its module (libckpt_hdf5.so, which links
/// libhdf5) loads. Loaded on the first call of any function here, never at start-up.
bool hdf5_available() noexcept;
/// Why hdf5_available() is false (empty when it is true).
std::string hdf5_unavailable_reason();

struct Hdf5Dataset {
  std::vector<std::string> path;  ///< groups, then the dataset's name (unescaped)
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
};

/// Creates (truncates) `file` holding `datasets` with their attributes and the root attributes
/// `attributes`, without their data; returns the absolute offset of each dataset's bytes (0 for
/// an empty one). Throws kUnsupported for a dtype HDF5 output has no type for (complex, quantized,
/// float8, ...), kInvalidArgument for two datasets at one path, kIo when libhdf5 fails.
std::vector<std::uint64_t> create_hdf5_layout(const std::filesystem::path& file, const std::vector<Hdf5Dataset>& datasets,
                                              const std::vector<std::pair<std::string, std::string>>& attributes);

/// Reads the datasets of an HDF5 file (contiguous and unfiltered, as we write them) into a
/// Checkpoint: entries named by their path joined with '.', each one raw chunk. Throws kFormat
/// when libhdf5 cannot read it, kUnsupported for chunked or filtered datasets and unknown types.
Checkpoint open_hdf5_checkpoint(const std::filesystem::path& file);

}  // namespace ckpt
