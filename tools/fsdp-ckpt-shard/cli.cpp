// SPDX-License-Identifier: Apache-2.0
#include "fsdp-ckpt-shard/cli.hpp"

#include <charconv>
#include <filesystem>

#include "common/cli_common.hpp"

namespace fsdp_tools {

std::unique_ptr<CLI::App> make_shard_app(ShardCliOptions& o) {
  auto app = std::make_unique<CLI::App>();
  app->name("fsdp-ckpt-shard");
  setup_app(*app, "fsdp-ckpt-shard",
            "Shard a checkpoint (a torch.save or safetensors file, or a DCP/Lightning directory of any world size) into a "
            "DCP directory for N ranks, laid out as FSDP writes it, streaming, in bounded memory.");
  app->add_option("input", o.input, "checkpoint to shard (any format fsdp-ckpt-inspect reads)")->required()->check(CLI::ExistingPath);
  app->add_option("-o,--output", o.output, "output directory")->required();
  app->add_option("-n,--world-size", o.world_size, "number of ranks to shard for")->required()->check(CLI::Range(1, 1 << 20));
  app->add_option("--layout", o.layout, "fsdp: dim-0 torch.chunk pieces (FSDP1 sharded state dict); dtensor: DTensor Shard(0), every rank")
      ->check(CLI::IsMember({"fsdp", "dtensor"}));
  app->add_option("--format", o.format,
                  "dcp: a DCP directory; hf-safetensors: DCP's Hugging Face storage, a safetensors file a rank, as "
                  "HuggingFaceStorageWriter(save_sharded=True) writes it (tensors only)")
      ->check(CLI::IsMember({"dcp", "hf-safetensors"}));
  app->add_option("--replicate", o.replicate, "keep tensors whose FQN matches GLOB whole, written once (repeatable)")->allow_extra_args(false);
  app->add_option("--files-per-rank", o.files_per_rank, "data files per rank, as DCP's thread_count writes them")->check(CLI::Range(1, 1024));
  app->add_option("--compress", o.compress, "write items with the stream.zstd/1 transform: zstd (level 3) or zstd:LEVEL (1-19); default: uncompressed");
  app->add_option("--dtype", o.dtype, "cast the model's floating tensors to bf16, fp16, fp32 or fp64 (round to nearest even)")
      ->check(CLI::IsMember(float_dtype_names()));
  app->add_option("--cast-include", o.cast_include, "with --dtype, also cast the floating tensors matching GLOB (optimizer state, say); repeatable");
  app->add_flag("--strict-cast", o.strict_cast, "with --dtype, fail (writing nothing) when a cast turns finite values into inf or non-zeros into 0");
  app->add_option("--key", o.key, "input that is not DCP: put every entry under this top-level key (e.g. model)");
  app->add_option("--max-memory", o.max_memory, "the most memory one copy may need (a gathered row, a compressed item)");
  app->add_option("--timeout", o.timeout, "distributed: seconds process 0 waits for the others")->check(CLI::PositiveNumber);
  add_write_flags(*app, o.flags, "entries, chunks, output files");
  return app;
}

namespace {

/// shard writes a DCP directory: an OUTPUT that names a file of a checkpoint format is refused.
void check_output_name(const std::string& output) {
  if (format_named_by(output)) {
    throw CLI::ValidationError("--output", "'" + output + "' names a " + std::filesystem::path(output).extension().string() +
                                           " file, but fsdp-ckpt-shard writes a DCP directory: name the directory");
  }
}

int env_int(const std::map<std::string, std::string>& env, const std::string& name) {
  const std::string& v = env.at(name);
  int out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size()) throw CLI::ValidationError(name, "'" + v + "' is not an integer");
  return out;
}

}  // namespace

ckpt::ShardOptions to_shard(const ShardCliOptions& o, std::vector<ckpt::EntryFilter> filters, const std::map<std::string, std::string>& env) {
  check_output_name(o.output);
  ckpt::ShardOptions s;
  s.world_size = o.world_size;
  s.layout = o.layout == "dtensor" ? ckpt::ShardLayout::kDtensor : ckpt::ShardLayout::kFsdp;
  s.replicate = o.replicate;
  s.files_per_rank = o.files_per_rank;
  if (o.format == "hf-safetensors") {
    s.format = ckpt::ShardFormat::kHfSafetensors;
    if (o.files_per_rank != 1) throw CLI::ValidationError("--files-per-rank", "applies to --format dcp only");
    if (!o.compress.empty()) throw CLI::ValidationError("--compress", "applies to --format dcp only");
  }
  if (!o.compress.empty()) {
    if (o.compress.rfind("zstd", 0) != 0 || (o.compress.size() > 4 && o.compress[4] != ':')) {
      throw CLI::ValidationError("--compress", "'" + o.compress + "' is not zstd or zstd:LEVEL");
    }
    s.compression = ckpt::DcpCompression::kZstd;
    if (o.compress.size() > 5) {
      const std::string level = o.compress.substr(5);
      auto [p, ec] = std::from_chars(level.data(), level.data() + level.size(), s.zstd_level);
      if (ec != std::errc() || p != level.data() + level.size() || s.zstd_level < 1 || s.zstd_level > 19) {
        throw CLI::ValidationError("--compress", "zstd level '" + level + "' is not in 1-19");
      }
    }
  }
  if (!o.dtype.empty()) s.dtype = parse_float_dtype(o.dtype);
  s.cast_include = o.cast_include;
  s.cast_check = o.strict_cast ? ckpt::CastCheck::kStrict : ckpt::CastCheck::kReport;
  if ((!o.cast_include.empty() || o.strict_cast) && o.dtype.empty()) {
    throw CLI::ValidationError(o.strict_cast ? "--strict-cast" : "--cast-include", "applies with --dtype only");
  }
  s.filters = std::move(filters);
  s.renames = renames_of(o.flags);
  if (!o.key.empty()) s.key = o.key;
  s.max_memory = parse_byte_size(o.max_memory);
  if (s.max_memory == 0) throw CLI::ValidationError("--max-memory", "must be more than 0 bytes");
  s.overwrite = o.flags.force ? ckpt::Overwrite::kYes : ckpt::Overwrite::kNo;
  s.threads = o.flags.threads;
  s.verify = o.flags.verify ? ckpt::Verify::kChecksums : ckpt::Verify::kNo;
  s.report_entries = o.flags.json || o.flags.dry_run;  // the text output of a real shard lists files only
  s.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.timeout * 1000));
  // torchrun (and a hand-made launch) set RANK and WORLD_SIZE; srun sets SLURM_PROCID/SLURM_NTASKS.
  for (const auto& [rank, size] : {std::pair{"RANK", "WORLD_SIZE"}, std::pair{"SLURM_PROCID", "SLURM_NTASKS"}}) {
    if (env.count(rank) && env.count(size)) {
      s.process_index = env_int(env, rank);
      s.process_count = env_int(env, size);
      if (s.process_count < 1 || s.process_index < 0 || s.process_index >= s.process_count) {
        throw CLI::ValidationError(rank, std::string(rank) + "=" + env.at(rank) + " is not a rank of " + size + "=" + env.at(size));
      }
      break;
    }
  }
  if (s.format == ckpt::ShardFormat::kHfSafetensors && s.process_count > 1) {
    throw CLI::ValidationError("--format", "hf-safetensors is written by one process; unset RANK/WORLD_SIZE");
  }
  return s;
}

}  // namespace fsdp_tools
