// SPDX-License-Identifier: Apache-2.0
#include "fsdp-ckpt-inspect/cli.hpp"

#include <charconv>

#include "common/cli_common.hpp"

namespace fsdp_tools {

InspectCommand InspectApp::command() const {
  if (verify->parsed()) return InspectCommand::kVerify;
  if (stats->parsed()) return InspectCommand::kStats;
  if (diff->parsed()) return InspectCommand::kDiff;
  return InspectCommand::kInspect;
}

InspectApp make_inspect_app(InspectCliOptions& o) {
  InspectApp a;
  a.app = std::make_unique<CLI::App>();
  CLI::App& app = *a.app;
  app.name("fsdp-ckpt-inspect");
  setup_app(app, "fsdp-ckpt-inspect",
            "Show what a checkpoint holds (DCP or Lightning directory, torch.save, safetensors, Hugging Face folder), "
            "without loading tensor data; verify, summarize and compare checkpoints.");
  app.add_option("path", o.path, "checkpoint to inspect; the format is detected from its content")->check(CLI::ExistingPath);
  app.add_flag("--json", o.json, "print one JSON object (schema 1) instead of the table");
  app.add_option("--tensor", o.tensor_glob, "show only entries matching this glob, with their whole chunk grid");
  app.add_flag("--meta", o.meta, "also print meta.pt, common.pt, .metadata and non-tensor items as trees");
  app.add_flag("--summary", o.summary, "print the summary alone, without the table of entries");
  app.add_flag("--files", o.all_files, "list every data file (past " + std::to_string(ckpt::kFoldFiles) + " the summary counts them)");
  app.add_flag("--bytes", o.exact_bytes, "sizes in bytes (default: KiB, MiB, GiB)");
  no_default(app.add_option_function<std::string>(
                    "--values", [&o](const std::string& n) { o.values = n.empty() ? "all" : n; },
                    "with --tensor: print each matching tensor's values in C order, reading only their bytes: the first N (default: all)"))
      ->expected(0, 1)
      ->type_name("[N]");
  app.require_subcommand(0, 1);

  a.verify = app.add_subcommand("verify", "check that a checkpoint is complete and readable; exit 1 on any problem");
  a.verify->add_option("path", o.verify_path, "checkpoint to verify")->required()->check(CLI::ExistingPath);
  a.verify->add_flag("--deep", o.deep, "also read every byte, checking CRC-32s where the format records them");
  a.verify->add_flag("--json", o.json, "print one JSON object instead of text");
  a.verify->add_flag("-q,--quiet", o.quiet, "print errors only besides the report: no progress bar or notes");

  a.stats = app.add_subcommand("stats", "per-tensor min, max, mean, std, max-abs, NaN and Inf counts");
  a.stats->add_option("path", o.stats_path, "checkpoint to read")->required()->check(CLI::ExistingPath);
  a.stats->add_option("--tensor", o.tensor_glob, "only tensors matching this glob");
  no_default(a.stats->add_option("-j,--threads", o.threads, "threads to use (default: the machine's cores)"))->check(CLI::Range(1u, 1024u));
  a.stats->add_flag("--json", o.json, "print one JSON object instead of the table");
  a.stats->add_flag("-q,--quiet", o.quiet, "print errors only besides the report: no progress bar or notes");

  a.diff = app.add_subcommand("diff", "compare two checkpoints of any formats; exit 1 when they differ");
  a.diff->add_option("a", o.diff_a, "first checkpoint")->required()->check(CLI::ExistingPath);
  a.diff->add_option("b", o.diff_b, "second checkpoint")->required()->check(CLI::ExistingPath);
  a.diff->add_option("--atol", o.atol, "absolute tolerance (default 0)")->check(CLI::NonNegativeNumber);
  a.diff->add_option("--rtol", o.rtol, "relative tolerance (default 0)")->check(CLI::NonNegativeNumber);
  a.diff->add_option("--include", o.include, "compare only A's entries matching GLOB, as merge selects (repeatable, in order with --exclude)");
  a.diff->add_option("--exclude", o.exclude, "leave out A's entries matching GLOB, as merge does");
  a.diff->add_flag("--model-only", o.model_only, "compare only the entries under the top-level key 'model'");
  a.diff->add_option("--key", o.key, "compare A's tensors under this top-level key by their names below it (as merge writes safetensors)");
  a.diff->add_option("--map-prefix", o.map_prefix, "FROM=TO: compare an A name that starts with FROM as TO and the rest (repeatable)");
  a.diff->add_flag("--json", o.json, "print one JSON object instead of text");
  a.diff->add_flag("-q,--quiet", o.quiet, "print errors only besides the report: no progress bar or notes");

  app.callback([&app, &o] {
    if (app.get_subcommands().empty() && o.path.empty()) throw CLI::RequiredError("path");
  });
  return a;
}

static ckpt::OutputFormat format_of(const InspectCliOptions& o) { return o.json ? ckpt::OutputFormat::kJson : ckpt::OutputFormat::kText; }

ckpt::InspectOptions to_inspect(const InspectCliOptions& o) {
  if (o.summary && !o.tensor_glob.empty()) throw CLI::ValidationError("--summary", "shows no entries; --tensor selects entries to show");
  ckpt::InspectOptions i{o.path, format_of(o), o.tensor_glob, o.meta, o.summary, o.all_files, o.exact_bytes, std::nullopt};
  if (!o.values.empty()) {
    if (o.tensor_glob.empty()) throw CLI::ValidationError("--values", "needs --tensor NAME (the tensors whose values to print)");
    if (o.values == "all") {
      i.values = ckpt::kAllValues;
    } else {
      std::uint64_t n = 0;
      const auto [end, ec] = std::from_chars(o.values.data(), o.values.data() + o.values.size(), n);
      if (ec != std::errc() || end != o.values.data() + o.values.size()) throw CLI::ValidationError("--values", "'" + o.values + "' is not a count");
      i.values = n;
    }
  }
  return i;
}
ckpt::VerifyOptions to_verify(const InspectCliOptions& o) {
  return {o.verify_path, o.deep ? ckpt::VerifyDepth::kDeep : ckpt::VerifyDepth::kStructure, format_of(o)};
}
ckpt::StatsOptions to_stats(const InspectCliOptions& o) { return {o.stats_path, o.tensor_glob, format_of(o), o.threads}; }
ckpt::DiffOptions to_diff(const InspectCliOptions& o, std::vector<ckpt::EntryFilter> filters) {
  ckpt::DiffOptions d;
  d.a = o.diff_a;
  d.b = o.diff_b;
  d.atol = o.atol;
  d.rtol = o.rtol;
  d.format = format_of(o);
  d.filters = std::move(filters);
  d.model_only = o.model_only;
  if (!o.key.empty()) d.key = o.key;
  for (const std::string& m : o.map_prefix) {
    const std::size_t eq = m.find('=');
    if (eq == std::string::npos || eq == 0) throw CLI::ValidationError("--map-prefix", "'" + m + "' is not FROM=TO");
    d.map_prefix.emplace_back(m.substr(0, eq), m.substr(eq + 1));
  }
  return d;
}

}  // namespace fsdp_tools
