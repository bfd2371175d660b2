// SPDX-License-Identifier: Apache-2.0
// Output paths: what may be replaced (check_output in ckpt/io.hpp), what dead runs left beside an
// output, and how a finished output takes its name; the file system's Output (ckpt/output.hpp).
//
// NOTE [Atomic outputs] for directories (merge's Hugging Face shards, shard's DCP directory): built
// under a temporary name beside the output, then renamed into place; a replaced output is exchanged
// with the new one in one atomic step (renameat2 RENAME_EXCHANGE) and removed after, so that the
// output's name always holds one whole output. A file that replaces a directory takes the same
// path. And the rule that replacing an output never removes the input.
#pragma once

#include <filesystem>
#include <string>

#include "ckpt/io.hpp"

namespace ckpt::detail {

/// Throws kInvalidArgument when `output` is `input` or a directory that holds it.
void refuse_output_over_input(const std::filesystem::path& input, const std::filesystem::path& output);

/// Renames `built` (a file or a directory) to `output`; an existing `output` is exchanged with it
/// atomically and then removed (where the file system cannot exchange, moved aside first). The
/// caller has checked that `output` may be replaced (check_output). Throws kIo.
void move_into_place(const std::filesystem::path& built, const std::filesystem::path& output);

/// fsyncs a directory, so that the renames inside it survive a crash. Throws kIo.
void sync_dir(const std::filesystem::path& dir);

}  // namespace ckpt::detail
