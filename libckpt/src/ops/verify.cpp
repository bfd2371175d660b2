// SPDX-License-Identifier: Apache-2.0
// verify: every check a reader can make, every problem reported (docs/formats/dcp.md#checks).
#include <nlohmann/json.hpp>
#include <ostream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/ops/validate.hpp"
#include "ckpt/sharding.hpp"
#include "ckpt/text.hpp"
#include "index/file_checks.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

using Problem = VerifyProblem;

// An error as a problem row: its own source when it names one, else `fallback`.
Problem problem_of(const Error& e, const std::string& fallback) {
  std::string m = e.message();
  for (const auto& ctx : e.context()) m += " (while " + ctx + ")";
  return {e.source().empty() ? fallback : e.source(), e.offset(), std::move(m)};
}

class Verifier {
 public:
  Verifier(const Checkpoint& c, VerifyDepth depth, Progress& progress) : c_(c), reader_(c, FileAccess::kReadSmallItemsWhole), depth_(depth), progress_(progress) {}

  void run() {
    index_problems(c_, [&](VerifyProblem p) { problems_.push_back(std::move(p)); });
    if (const auto& u = c_.unreferenced_storage; !u.empty()) {
      add(c_.root.string(), std::nullopt,
          "storage_data: " + std::to_string(u.size()) + " storage_data entries belong to no chunk (first: '" + u.front() + "')");
    }
    std::uint64_t total = 0;
    if (depth_ == VerifyDepth::kDeep) {
      for (const auto& f : c_.files) total += f.size.value_or(0);
      progress_.start("verifying", total);
    }
    for (const auto& t : c_.tensors) check_tensor(t);
    for (const auto& o : c_.objects) check_object(o);
    if (depth_ == VerifyDepth::kDeep && c_.file_checks) {
      guarded(c_.root.string(), [&] { c_.file_checks->check(c_, reader_, progress_); });
    }
    if (depth_ == VerifyDepth::kDeep) progress_.finish();
  }

  const std::vector<Problem>& problems() const { return problems_; }
  std::size_t items_checked() const { return items_; }

 private:
  void add(std::string source, std::optional<std::uint64_t> offset, std::string message) {
    problems_.push_back({std::move(source), offset, std::move(message)});
  }
  template <typename Fn>
  void guarded(const std::string& context, Fn&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      problems_.push_back(problem_of(e, context));
    }
  }

  // The data behind each chunk whose storage the index places inside its file (index_problems
  // has reported the others).
  void check_tensor(const TensorEntry& t) {
    if (!checked_numel(t.shape)) return;
    for (const Chunk& ch : t.chunks) {
      if (!ch.location || !location_in_file(c_, *ch.location)) continue;
      ++items_;
      guarded(c_.files[ch.location->file].path.string(), [&] {
        ChunkData d = reader_.read(t, ch);
        if (depth_ == VerifyDepth::kDeep) deep_item(*ch.location, d);
      });
    }
  }

  void check_object(const ObjectEntry& o) {
    if (!o.item || !location_in_file(c_, *o.item)) return;
    ++items_;
    guarded(c_.files[o.item->file].path.string(), [&] {
      (void)reader_.object_value(o);
      if (depth_ == VerifyDepth::kDeep) deep_item(*o.item, std::nullopt);
    });
  }

  // Reads every byte of the item: the checksums its format records, or the tensor data.
  void deep_item(const ChunkLocation& loc, const std::optional<ChunkData>& data) {
    std::uint64_t read = 0;
    if (loc.encoding == ChunkEncoding::kItem) {
      reader_.check_checksums(loc);
    } else if (data) {
      // The bar advances piece by piece, so that a large tensor moves it.
      stream_range(*data->storage, 0, data->storage->size(), [&](std::span<const std::byte> piece) {
        read += piece.size();
        progress_.advance(piece.size());
      });
    }
    if (loc.length > read) progress_.advance(loc.length - read);
  }

  const Checkpoint& c_;
  ChunkReader reader_;
  VerifyDepth depth_;
  Progress& progress_;
  std::vector<Problem> problems_;
  std::size_t items_ = 0;
};

}  // namespace

std::string to_string(const VerifyProblem& p) {
  return escape_name(p.source) + ": " + (p.offset ? "offset " + std::to_string(*p.offset) + ": " : std::string()) + escape_name(p.message);
}

VerifyReport check_checkpoint(const VerifyOptions& options, Progress& progress) {
  VerifyReport r;
  try {
    const Checkpoint c = open_checkpoint(options.path);
    r.format = c.format;
    r.tensors = c.tensors.size();
    r.objects = c.objects.size();
    r.files = c.files.size();
    Verifier v(c, options.depth, progress);
    v.run();
    r.problems = v.problems();
    r.items = v.items_checked();
  } catch (const Error& e) {
    r.problems.push_back(problem_of(e, options.path.string()));
  }
  return r;
}

bool verify(const VerifyOptions& options, std::ostream& out, Progress& progress) {
  const VerifyReport r = check_checkpoint(options, progress);
  const std::vector<Problem>& problems = r.problems;
  const bool ok = r.ok();
  if (options.format == OutputFormat::kJson) {
    nlohmann::ordered_json j{{"schema", 1}, {"path", options.path.string()}, {"ok", ok},
                             {"deep", options.depth == VerifyDepth::kDeep}};
    if (r.format) {
      j["format"] = std::string(to_string(*r.format));
      j["checked"] = {{"tensors", r.tensors}, {"objects", r.objects}, {"files", r.files}, {"items", r.items}};
    }
    j["problems"] = nlohmann::ordered_json::array();
    for (const auto& p : problems) {
      j["problems"].push_back({{"source", p.source}, {"offset", p.offset ? nlohmann::ordered_json(*p.offset) : nlohmann::ordered_json(nullptr)},
                               {"message", p.message}});
    }
    out << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
    return ok;
  }
  for (const auto& p : problems) out << "problem: " << to_string(p) << "\n";
  if (ok) {
    out << "ok: " << escape_name(options.path.string()) << ": " << r.tensors << " tensors, " << r.objects
        << " other entries, " << r.files << " files, " << r.items << " items checked"
        << (options.depth == VerifyDepth::kDeep ? ", every byte read" : "") << "\n";
  } else {
    out << problems.size() << " problem" << (problems.size() == 1 ? "" : "s") << " found in " << escape_name(options.path.string()) << "\n";
  }
  return ok;
}

}  // namespace ckpt
