// SPDX-License-Identifier: Apache-2.0
#include "formats/huggingface/dcp_storage_writer.hpp"

#include <cstdio>
#include <memory>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"

namespace ckpt::detail {
namespace {

// The dtypes hf_storage.py's _get_dtype maps; it reads any other safetensors dtype as float32.
bool reader_knows(DType d) {
  switch (d) {
    case DType::kFloat16:
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kBFloat16:
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64: return true;
    default: return false;
  }
}

std::string file_name(int rank) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-model-00001-of-00001.safetensors", rank + 1);
  return name;
}

// json.dumps of {fqn: {"saved_offsets": [...]}} with Python's default separators, in layout
// order; names are escaped as JSON strings.
std::string sharding_info(const DcpPlan& plan, const std::vector<std::pair<std::uint32_t, std::uint32_t>>& chunks) {
  auto quoted = [](std::string_view s) {
    std::string out = "\"";
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == '"' || c == '\\') {
        out += '\\';
        out += ch;
      } else if (c < 0x20) {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04x", c);
        out += esc;
      } else {
        out += ch;
      }
    }
    return out + "\"";
  };
  std::string out = "{";
  for (const auto& [t, k] : chunks) {
    if (out.size() > 1) out += ", ";
    out += quoted(plan.tensors[t].fqn) + ": {\"saved_offsets\": [";
    const DcpPlanChunk c = plan.chunks.get(plan.tensors[t], k);
    for (std::size_t d = 0; d < c.offsets.size(); ++d) out += (d ? ", " : "") + std::to_string(c.offsets[d]);
    out += "]}";
  }
  return out + "}";
}

}  // namespace

std::vector<HfStorageFile> plan_hf_storage_files(const DcpPlan& plan, const std::string& target) {
  std::vector<std::vector<std::pair<std::uint32_t, std::uint32_t>>> by_rank(static_cast<std::size_t>(plan.world_size));
  for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
    const DcpPlanTensor& tensor = plan.tensors[t];
    if (!reader_knows(tensor.dtype)) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "tensor '" + std::string(tensor.fqn) + "' is " + std::string(name(tensor.dtype)) +
                      ", which HuggingFaceStorageReader would read as float32 (it reads float16, float32, float64, bfloat16 and "
                      "8- to 64-bit ints); write a DCP directory instead, or --exclude it");
    }
    for (std::uint32_t k = 0; k < tensor.chunk_count; ++k) {
      auto& mine = by_rank[static_cast<std::size_t>(plan.chunks.get(tensor, k).rank)];
      if (!mine.empty() && mine.back().first == t) {
        throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                    "rank " + std::to_string(plan.chunks.get(tensor, k).rank) + " holds two chunks of '" + std::string(tensor.fqn) +
                        "', which one safetensors file cannot name apart");
      }
      mine.emplace_back(static_cast<std::uint32_t>(t), k);
    }
  }
  std::vector<HfStorageFile> files;
  for (std::size_t r = 0; r < by_rank.size(); ++r) {
    if (by_rank[r].empty()) continue;  // a rank with nothing to write writes no file
    std::vector<SafetensorsEntry> entries;
    for (const auto& [t, k] : by_rank[r]) {
      const DcpPlanTensor& tensor = plan.tensors[t];
      entries.push_back({std::string(tensor.fqn), tensor.dtype, Dims(plan.chunks.get(tensor, k).sizes), nullptr});
    }
    HfStorageFile f;
    f.rank = static_cast<int>(r);
    f.name = file_name(f.rank);
    f.layout = plan_safetensors(std::move(entries),
                                {{"DCP_SHARDING_INFO", sharding_info(plan, by_rank[r])}, {"DCP_VERSION", "1.0"}, {"format", "pt"}},
                                (std::filesystem::path(target) / f.name).string());
    for (const std::size_t i : f.layout.order) f.chunks.push_back(by_rank[r][i]);
    files.push_back(std::move(f));
  }
  return files;
}

void write_hf_storage_files(OutputFiles& out, const DcpPlan& plan, std::span<const HfStorageFile> files,
                            const CopyOptions& options) {
  std::vector<std::unique_ptr<PositionalSink>> sinks;
  std::vector<PositionalSink*> raw;
  std::vector<CopyTask> tasks;
  const std::uint64_t max_task = task_bytes(options.threads);
  for (const HfStorageFile& f : files) {
    sinks.push_back(out.positional(f.name));
    PositionalSink& sink = *sinks.back();
    raw.push_back(&sink);
    sink.resize(f.layout.size);
    std::uint64_t at = 0;
    f.layout.write_head([&](std::span<const std::byte> b) {
      sink.write_at(at, b);
      at += b.size();
    });
    const std::size_t first = tasks.size();
    for (std::size_t i = 0; i < f.chunks.size(); ++i) {
      plan.add_tasks(tasks, f.chunks[i].first, f.chunks[i].second, f.layout.begins[i], 0, max_task);
    }
    for (std::size_t i = first; i < tasks.size(); ++i) tasks[i].sink = sinks.size() - 1;
  }
  run_copy(raw, std::move(tasks), 0, options);  // safetensors keeps no CRC
  for (auto& s : sinks) s->commit();
}

}  // namespace ckpt::detail
