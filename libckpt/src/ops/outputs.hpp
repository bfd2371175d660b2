// SPDX-License-Identifier: Apache-2.0
// NOTE [Atomic outputs] for directories (merge's Hugging Face shards, shard's DCP directory):
// built under a temporary name beside the output, then renamed into place; a replaced output is
// moved aside first and removed only after the new one is in place. And the rule that replacing
// an output never removes the input.
#pragma once

#include <filesystem>

namespace ckpt::detail {

/// Throws kInvalidArgument when `output` is `input` or a directory that holds it.
void refuse_output_over_input(const std::filesystem::path& input, const std::filesystem::path& output);

/// `output` + `suffix`, emptied and created. Throws kIo.
std::filesystem::path fresh_dir(const std::filesystem::path& output, const std::string& suffix);

/// Renames `built` to `output`; an existing `output` is moved aside first and removed after.
/// Throws kIo.
void move_dir_into_place(const std::filesystem::path& built, const std::filesystem::path& output);

/// fsyncs a directory, so that the renames inside it survive a crash. Throws kIo.
void sync_dir(const std::filesystem::path& dir);

}  // namespace ckpt::detail
