// SPDX-License-Identifier: Apache-2.0
#include "fsdp-ckpt-merge/cli.hpp"

#include <filesystem>

#include "ckpt/cast.hpp"
#include "ckpt/open.hpp"
#include "common/cli_common.hpp"
#include "fsdp-ckpt-merge/hf_config.hpp"

namespace fsdp_tools {

std::unique_ptr<CLI::App> make_merge_app(MergeCliOptions& o) {
  auto app = std::make_unique<CLI::App>();
  app->name("fsdp-ckpt-merge");
  setup_app(*app, "fsdp-ckpt-merge",
            "Merge a sharded checkpoint (DCP or Lightning directory) into one full file: torch.save, safetensors "
            "(one file, or Hugging Face shards with an index), streaming, in bounded memory.");
  app->add_option("input", o.input, "sharded checkpoint directory (any format fsdp-ckpt-inspect reads)")->required()->check(CLI::ExistingPath);
  no_default(app->add_option("-o,--output", o.output, "output file (a directory with --max-shard-size; default: INPUT.consolidated, a torch.save file)"));
  app->add_option("--format", o.format, "torch, safetensors or hdf5 (default: from OUTPUT's extension, else torch)")
      ->check(CLI::IsMember({"torch", "safetensors", "hdf5"}));
  app->add_option("--layout", o.layout, "torch output: nested by planner_data, as dcp_to_torch_save writes it, or flat {fqn: value}")
      ->check(CLI::IsMember({"nested", "flat"}));
  app->add_option("--key", o.key, "safetensors: write the tensors under this top-level key (default: model, when there is one)");
  app->add_option("--dtype", o.dtype, "cast the model's floating tensors to bf16, fp16, fp32 or fp64 (round to nearest even)")
      ->check(CLI::IsMember(float_dtype_names()));
  app->add_option("--cast-include", o.cast_include, "with --dtype, also cast the floating tensors matching GLOB (optimizer state, say); repeatable");
  app->add_flag("--strict-cast", o.strict_cast, "with --dtype, fail (writing nothing) when a cast turns finite values into inf or non-zeros into 0");
  app->add_flag("--model-only", o.model_only, "keep only the top-level key 'model'");
  app->add_option("--max-shard-size", o.max_shard_size, "safetensors: write Hugging Face shards of at most SIZE (5GB, 500MiB) into the OUTPUT directory");
  app->add_flag("--hf-config", o.hf_config,
                "safetensors: also write Hugging Face's config.json (beside OUTPUT, or in it with --max-shard-size) for an "
                "fsdp-train --model llama checkpoint, from its training configuration");
  add_write_flags(*app, o.flags, "entries, bytes, output files");
  return app;
}

ckpt::MergeOptions to_merge(const MergeCliOptions& o, std::vector<ckpt::EntryFilter> filters) {
  ckpt::MergeOptions m;
  const char* named = format_named_by(o.output);
  std::string format = o.format;
  if (format.empty()) {
    format = !o.max_shard_size.empty() ? "safetensors" : named ? named : "torch";
  } else if (named && named != format) {  // an extension that names another format
    throw CLI::ValidationError("--format", o.format + " contradicts OUTPUT '" + o.output + "', whose extension is " + named + "'s: rename one");
  }
  m.format = format == "safetensors" ? ckpt::MergeFormat::kSafetensors : format == "hdf5" ? ckpt::MergeFormat::kHdf5 : ckpt::MergeFormat::kTorch;
  m.layout = o.layout == "flat" ? ckpt::MergeLayout::kFlat : ckpt::MergeLayout::kNested;
  if (!o.key.empty()) {
    if (m.format != ckpt::MergeFormat::kSafetensors) throw CLI::ValidationError("--key", "applies to safetensors output only");
    m.key = o.key;
  }
  if (!o.dtype.empty()) {
    m.dtype = parse_float_dtype(o.dtype);
    m.cast_include = o.cast_include;
    m.cast_check = o.strict_cast ? ckpt::CastCheck::kStrict : ckpt::CastCheck::kReport;
  } else if (!o.cast_include.empty() || o.strict_cast) {
    throw CLI::ValidationError(o.strict_cast ? "--strict-cast" : "--cast-include", "applies with --dtype only");
  }
  m.filters = std::move(filters);
  m.renames = renames_of(o.flags);
  m.model_only = o.model_only;
  if (!o.max_shard_size.empty()) {
    if (m.format != ckpt::MergeFormat::kSafetensors) throw CLI::ValidationError("--max-shard-size", "applies to safetensors output only");
    m.max_shard_size = parse_byte_size(o.max_shard_size);
    if (*m.max_shard_size == 0) throw CLI::ValidationError("--max-shard-size", "must be more than 0 bytes");
  }
  if (o.hf_config && m.format != ckpt::MergeFormat::kSafetensors) throw CLI::ValidationError("--hf-config", "applies to safetensors output only");
  m.overwrite = o.flags.force ? ckpt::Overwrite::kYes : ckpt::Overwrite::kNo;
  m.threads = o.flags.threads;
  m.verify = o.flags.verify ? ckpt::Verify::kChecksums : ckpt::Verify::kNo;
  m.report_entries = o.flags.json || o.flags.dry_run;  // the text output of a real merge lists files only
  return m;
}

std::string merge_output(const MergeCliOptions& o, const ckpt::MergeOptions& m) {
  if (o.output.empty()) {
    std::string in = o.input;
    while (in.size() > 1 && in.back() == '/') in.pop_back();
    if (m.format != ckpt::MergeFormat::kTorch || m.max_shard_size) {
      throw CLI::ValidationError("--output", "is needed with --format and --max-shard-size (the default, INPUT.consolidated, is a torch.save file)");
    }
    return in + ".consolidated";
  }
  const std::filesystem::path out(o.output);
  const std::string ext = out.extension().string();
  if (m.max_shard_size) {
    if (format_named_by(o.output) || ext == ".json") {
      throw CLI::ValidationError("--output", "'" + o.output + "' names a " + ext + " file, but --max-shard-size writes a directory of safetensors shards: name the directory (" +
                                             out.stem().string() + ")");
    }
  } else if (o.output.back() == '/') {
    const char* name = m.format == ckpt::MergeFormat::kSafetensors ? "model.safetensors" : m.format == ckpt::MergeFormat::kHdf5 ? "model.h5" : "model.pt";
    throw CLI::ValidationError("--output", "'" + o.output + "' names a directory, and this merge writes one file: give its name (" + o.output + name +
                                           "), or --max-shard-size for a directory of safetensors shards");
  }
  return o.output;
}

ckpt::WriteResult run_merge(const MergeCliOptions& o, ckpt::MergeOptions m) {
  const ckpt::Checkpoint input = ckpt::open_checkpoint(o.input);
  if (o.hf_config) m.hf_config = llama_hf_config(input, m.dtype);
  return ckpt::merge(input, o.output, m, o.flags.dry_run);
}

}  // namespace fsdp_tools
