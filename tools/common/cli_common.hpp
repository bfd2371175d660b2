// SPDX-License-Identifier: Apache-2.0
// What every tool's command line shares: --version text, the footer, parsing with exit code 2 for
// usage errors, and the byte-size parser (kB/MB/GB decimal, KiB/MiB/GiB binary).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/dtype.hpp"
#include "ckpt/ops/filter.hpp"
#include "common/usage_error.hpp"

namespace fsdp_tools {

/// "<program> <version> (<git describe>)".
std::string version_text(std::string_view program);

/// Sets the description, the "See <program>(1)." footer and --version on `app`.
/// Every tool's App: its description, footer, --version, and the shared --help layout (each
/// option's kind of value, range and default; options added afterwards capture their defaults).
void setup_app(CLI::App& app, std::string_view program, std::string_view description);

/// A bash or zsh completion script for `app` (its options and subcommands, files for the rest),
/// from the same definitions --help prints; every tool prints it with the hidden option
/// `--completion bash|zsh` that setup_app adds, and the build installs what it prints.
std::string completion_script(const CLI::App& app, std::string_view shell);
/// Marks an option whose default only means "not given" (its description says what happens
/// then): --help shows no default for it. Returns `opt`.
CLI::Option* no_default(CLI::Option* opt);

/// The checkpoint format a file name's extension names: "safetensors" (.safetensors), "hdf5"
/// (.h5, .hdf5), "torch" (.pt, .pth, .bin, .ckpt); nullptr for any other name.
const char* format_named_by(const std::string& path);

/// Parses argv; returns std::nullopt to go on, or the exit code: 0 after --help/--version, 2 after
/// a usage error (message on stderr).
std::optional<int> parse(CLI::App& app, int argc, const char* const* argv);

/// "512", "64MB", "1.5GiB" -> bytes. Throws CLI::ValidationError on anything else.
std::uint64_t parse_byte_size(std::string_view text);

/// The names --dtype accepts (bf16, fp16, fp32, fp64 and their torch spellings).
std::vector<std::string> float_dtype_names();
/// One of float_dtype_names() -> the dtype.
ckpt::DType parse_float_dtype(std::string_view name);

/// The options every tool that writes a checkpoint shares.
struct WriteFlags {
  std::vector<std::string> include, exclude;  ///< parsed by CLI11; their order comes from filters_in_order()
  std::vector<std::string> rename;            ///< s/REGEX/REPLACEMENT/[g], in order
  std::string strip_prefix;
  bool dry_run = false;
  bool force = false;
  bool verify = false;
  unsigned threads = 0;
  bool quiet = false;
  bool json = false;
};
/// Adds --include, --exclude, --dry-run (`plan` says what it prints), -f/--force, --verify, -j/--threads,
/// -q/--quiet and --json.
void add_write_flags(CLI::App& app, WriteFlags& flags, const std::string& plan);
/// --strip-prefix and --rename as ckpt::EntryRenames; a malformed rename is a usage error
/// (CLI::ValidationError).
ckpt::EntryRenames renames_of(const WriteFlags& flags);

/// Runs `translate` (options -> library options, checks across options); a CLI::Error or
/// UsageError it throws is a usage error: printed as parse() prints one, and 2 is returned.
std::optional<int> usage_errors(std::string_view program, const std::function<void()>& translate);

/// Tests only: arms FSDP_TEST_CRASH_AT (ckpt/test_hooks.hpp) and returns FSDP_TEST_COPY_DELAY_MS
/// (slow each copy down so that a test can interrupt it), 0 when unset.
unsigned test_hooks_from_environment();

/// "[2, 3]", as the tools print shapes.
std::string shape_text(const std::vector<std::int64_t>& shape);

/// --include and --exclude in the order argv gives them (CLI11 keeps each option's values apart).
std::vector<ckpt::EntryFilter> filters_in_order(int argc, const char* const* argv);

}  // namespace fsdp_tools
