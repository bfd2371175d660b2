// SPDX-License-Identifier: Apache-2.0
// The .metadata interpreter behind open_dcp, callable on bytes (the fuzz target uses it).
#pragma once

#include <filesystem>
#include <functional>
#include <span>
#include <string>

#include "ckpt/checkpoint.hpp"

namespace ckpt::detail {

/// Parses `.metadata` bytes (named `source` in errors) into `checkpoint`, whose `root` must be the
/// directory the file names are relative to. Touches no data file. `release(n)`: bytes before n
/// are not needed for now; they are read again later (pickle::ParseOptions::on_scanned), so it
/// may only drop what comes back when read, as the pages of a file mapping do.
void read_dcp_metadata(std::span<const std::byte> bytes, const std::string& source, Checkpoint& checkpoint,
                       MetaTrees trees = MetaTrees::kDrop, const std::function<void(std::uint64_t)>& release = {});

}  // namespace ckpt::detail
