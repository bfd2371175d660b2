// SPDX-License-Identifier: Apache-2.0
// inspect: what a checkpoint holds, from headers and metadata alone (no tensor byte is read).
// Writes a human summary and table, or one JSON object (schema 1, see fsdp-ckpt-inspect(1)), to
// the stream it is given; the library never prints on its own.
#pragma once

#include <filesystem>
#include <iosfwd>

namespace ckpt {

enum class OutputFormat { kText, kJson };

struct InspectOptions {
  std::filesystem::path path;
  OutputFormat format = OutputFormat::kText;
};

/// Throws ckpt::Error: kFormat for bad data (naming the file and offset), kUnsupported for a
/// format this build cannot read yet, kIo when the path cannot be read.
void inspect(const InspectOptions& options, std::ostream& out);

/// `name` with control characters, backslashes and invalid UTF-8 escaped (\n, \x1b, \\), so that
/// a hostile name cannot move the cursor or forge lines.
std::string escape_name(std::string_view name);

}  // namespace ckpt
