// SPDX-License-Identifier: Apache-2.0
// What the HDF5 module (libckpt_hdf5.so, module.cpp) gives libckpt: one C entry point,
// ckpt_hdf5_api(), returning this table. Both sides are built together, so C++ types pass freely;
// the version guards against a stale module found on the search path.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/hdf5.hpp"

namespace ckpt::detail {

inline constexpr int kHdf5ApiVersion = 1;

struct Hdf5Api {
  int version;
  std::vector<std::uint64_t> (*create_layout)(const std::filesystem::path& file, const std::vector<Hdf5Dataset>& datasets,
                                              const std::vector<std::pair<std::string, std::string>>& attributes);
  Checkpoint (*open)(const std::filesystem::path& file);
};

}  // namespace ckpt::detail

extern "C" const ckpt::detail::Hdf5Api* ckpt_hdf5_api();
