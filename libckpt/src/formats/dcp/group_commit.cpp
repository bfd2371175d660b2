// SPDX-License-Identifier: Apache-2.0
#include "formats/dcp/group_commit.hpp"

#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "ckpt/copy.hpp"
#include "ckpt/error.hpp"
#include "text_helpers.hpp"

namespace ckpt::detail {
namespace {

std::string done_marker(int p) { return ".shard-done." + std::to_string(p); }
std::string failed_marker(int p) { return ".shard-failed." + std::to_string(p); }

void write_marker(const std::filesystem::path& dir, const std::string& name, const nlohmann::json& j) {
  const std::string text = j.dump();
  auto sink = open_file_sink(dir / name, Overwrite::kYes);
  sink->write(text.data(), text.size());
  sink->commit();
}

std::optional<nlohmann::json> read_marker(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // still being written by a process that is not atomic (never ours)
  }
}

}  // namespace

std::string dcp_plan_fingerprint(const DcpPlan& plan, const std::string& source, int process_count) {
  std::ostringstream s;
  s << source << '|' << plan.world_size << '|' << plan.files_per_rank << '|' << static_cast<int>(plan.compression) << '|' << process_count;
  for (const auto& t : plan.tensors) {
    s << '|' << t.fqn << ':' << name(t.dtype);
    for (std::size_t k = 0; k < t.chunk_count; ++k) {
      const DcpPlanChunk ch = plan.chunks.get(t, k);
      s << ':' << ch.rank << '@' << shape_text(ch.offsets) << shape_text(ch.sizes);
    }
  }
  for (const auto& o : plan.objects) s << '|' << o.fqn << ':' << o.rank << ':' << o.item->size();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016zx", std::hash<std::string>{}(s.str()));
  return hex;
}

DcpGroupCommit::DcpGroupCommit(std::filesystem::path dir, int process_index, int process_count, std::string fingerprint,
                               std::chrono::milliseconds timeout)
    : dir_(std::move(dir)), index_(process_index), count_(process_count), fingerprint_(std::move(fingerprint)), timeout_(timeout) {}

void DcpGroupCommit::begin() const {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw Error(ErrorKind::kIo, dir_.string(), std::nullopt, "cannot create the output directory: " + ec.message());
  std::filesystem::remove(dir_ / done_marker(index_), ec);
  std::filesystem::remove(dir_ / failed_marker(index_), ec);
}

void DcpGroupCommit::done(const std::vector<DcpItem>& items) const {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& it : items) {
    nlohmann::json x{{"fqn", it.fqn}, {"chunk", it.chunk_index}, {"file", it.file}, {"offset", it.offset}, {"length", it.length}};
    x["offsets"] = it.tensor ? nlohmann::json(std::vector<std::int64_t>(it.offsets.begin(), it.offsets.end())) : nlohmann::json(nullptr);
    a.push_back(std::move(x));
  }
  write_marker(dir_, done_marker(index_), {{"plan", fingerprint_}, {"items", std::move(a)}});
}

void DcpGroupCommit::failed(const std::string& error) const {
  write_marker(dir_, failed_marker(index_), {{"plan", fingerprint_}, {"error", error}});
}

std::vector<DcpItem> DcpGroupCommit::wait_for_others() {
  std::vector<DcpItem> items;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int p = 1; p < count_; ++p) {
    for (;;) {
      if (auto f = read_marker(dir_ / failed_marker(p)); f && f->value("plan", "") == fingerprint_) {
        throw Error(ErrorKind::kIo, dir_.string(), std::nullopt,
                    "process " + std::to_string(p) + " of " + std::to_string(count_) + " failed (" + f->value("error", "") +
                        "); no .metadata was written");
      }
      if (auto d = read_marker(dir_ / done_marker(p)); d && d->value("plan", "") == fingerprint_) {
        for (const auto& x : (*d)["items"]) {
          names_.push_back(x["fqn"].get<std::string>());
          names_.push_back(x["file"].get<std::string>());
          const std::string& file = names_.back();
          const std::string& fqn = names_[names_.size() - 2];
          DcpItem it{fqn, false, {}, x["chunk"], file, x["offset"], x["length"]};
          if (!x["offsets"].is_null()) {
            it.tensor = true;
            it.offsets = offsets_.emplace_back(x["offsets"].get<std::vector<std::int64_t>>());
          }
          items.push_back(it);
        }
        break;
      }
      if (cancel_requested()) throw Error(ErrorKind::kCancelled, dir_.string(), std::nullopt, "interrupted; no .metadata was written");
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error(ErrorKind::kIo, dir_.string(), std::nullopt,
                    "process " + std::to_string(p) + " of " + std::to_string(count_) + " did not finish within " +
                        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout_).count()) +
                        " s (no completion marker); no .metadata was written");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return items;
}

}  // namespace ckpt::detail
