// SPDX-License-Identifier: Apache-2.0
// stats: per-tensor statistics, each chunk read once, tensors spread over threads.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <thread>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/text.hpp"
#include "ops/elements.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

struct TensorStats {
  const TensorEntry* tensor = nullptr;
  bool numeric = false;
  bool integral = false;  ///< an integer dtype: min, max and max_abs exact (detail::integer_value)
  std::uint64_t count = 0, nan = 0, inf = 0;
  long double min = std::numeric_limits<long double>::infinity(), max = -std::numeric_limits<long double>::infinity();
  long double sum = 0, sumsq = 0;
  long double max_abs = 0;
  std::uint64_t finite = 0;

  void add(long double x) {
    ++count;
    if (std::isnan(x)) {
      ++nan;
      return;
    }
    if (std::isinf(x)) {
      ++inf;
    } else {
      ++finite;
      sum += x;
      sumsq += x * x;
    }
    min = std::min(min, x);
    max = std::max(max, x);
    max_abs = std::max(max_abs, std::fabs(x));
  }
  // Mean and standard deviation over the finite values (population std, as torch.std(unbiased=False)).
  double mean() const { return finite ? static_cast<double>(sum / static_cast<long double>(finite)) : std::nan(""); }
  double stddev() const {
    if (!finite) return std::nan("");
    const long double m = sum / static_cast<long double>(finite);
    const long double var = sumsq / static_cast<long double>(finite) - m * m;
    return static_cast<double>(std::sqrt(std::max<long double>(var, 0)));
  }
};

/// `x` for the table: an integer exactly, a float to 6 significant digits.
std::string num(long double x, bool integral = false) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (integral) return detail::integer_text(x);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g", static_cast<double>(x));
  return buf;
}
/// `x` for JSON: an integer as a JSON integer (exactly, int64 or uint64), a float as a number,
/// nan and inf as null.
nlohmann::ordered_json jnum(long double x, bool integral = false) {
  if (!std::isfinite(x)) return nullptr;
  if (integral) return detail::integer_json<nlohmann::ordered_json>(x);
  return static_cast<double>(x);
}

}  // namespace

void stats(const StatsOptions& options, std::ostream& out, Progress& progress) {
  const Checkpoint c = open_checkpoint(options.path);
  require_match(c, options.tensor_glob, GlobOver::kTensors);
  const ChunkReader reader(c, FileAccess::kReadSmallItemsWhole);
  std::vector<TensorStats> results;
  std::uint64_t total = 0;
  for (const auto& t : c.tensors) {
    if (!detail::glob_match(options.tensor_glob, t.name)) continue;
    TensorStats s;
    s.tensor = &t;
    s.numeric = detail::is_numeric(t.dtype);
    s.integral = detail::is_integral(t.dtype);
    results.push_back(s);
    total += t.nbytes();
  }
  std::sort(results.begin(), results.end(), [](const auto& a, const auto& b) { return a.tensor->name < b.tensor->name; });
  progress.start("stats", total);
  std::atomic<std::size_t> next{0};
  std::mutex error_mutex, progress_mutex;
  std::optional<Error> first_error;
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < results.size();) {
      TensorStats& s = results[i];
      if (!s.numeric) continue;
      try {
        for (const Chunk& ch : s.tensor->chunks) {
          const ChunkData d = reader.read(*s.tensor, ch);
          detail::for_each_element(d, [&](std::uint64_t, const std::byte* p) {
            s.add(s.integral ? detail::integer_value(d.dtype, p) : detail::to_double(d.dtype, p));
          });
          std::lock_guard lock(progress_mutex);
          std::uint64_t bytes = element_size(d.dtype);
          for (auto x : ch.sizes) bytes *= static_cast<std::uint64_t>(x);
          progress.advance(bytes);
        }
      } catch (Error& e) {
        e.add_context("reading '" + s.tensor->name + "'");
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = e;
        next = results.size();
      }
    }
  };
  unsigned n = options.threads ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  n = static_cast<unsigned>(std::min<std::size_t>(n, std::max<std::size_t>(results.size(), 1)));
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < n; ++k) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  progress.finish();
  if (first_error) throw *first_error;

  if (options.format == OutputFormat::kJson) {
    nlohmann::ordered_json j{{"schema", 1}, {"path", options.path.string()}, {"tensors", nlohmann::ordered_json::array()}};
    for (const auto& s : results) {
      nlohmann::ordered_json x{{"name", s.tensor->name}, {"dtype", std::string(name(s.tensor->dtype))}, {"numel", s.tensor->numel()}};
      if (s.numeric) {
        x["min"] = s.count ? jnum(s.min, s.integral) : nullptr;
        x["max"] = s.count ? jnum(s.max, s.integral) : nullptr;
        x["mean"] = jnum(s.mean());
        x["std"] = jnum(s.stddev());
        x["max_abs"] = s.count ? jnum(s.max_abs, s.integral) : nullptr;
        x["nan"] = s.nan;
        x["inf"] = s.inf;
      } else {
        x["unsupported"] = "statistics are not computed for this dtype";
      }
      j["tensors"].push_back(std::move(x));
    }
    out << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
    return;
  }
  std::size_t w = 4;
  for (const auto& s : results) w = std::max(w, detail::text_width(escape_name(s.tensor->name)));
  using detail::pad;
  out << pad("NAME", w) << pad("DTYPE", 10) << pad("NUMEL", 10) << pad("MIN", 12) << pad("MAX", 12) << pad("MEAN", 12)
      << pad("STD", 12) << pad("MAXABS", 12) << pad("NAN", 6) << "INF\n";
  for (const auto& s : results) {
    out << pad(escape_name(s.tensor->name), w) << pad(std::string(name(s.tensor->dtype)), 10) << pad(std::to_string(s.tensor->numel()), 10);
    if (!s.numeric) {
      out << "(not computed for this dtype)\n";
      continue;
    }
    const bool any = s.count > 0;
    out << pad(any ? num(s.min, s.integral) : "-", 12) << pad(any ? num(s.max, s.integral) : "-", 12) << pad(num(s.mean()), 12)
        << pad(num(s.stddev()), 12) << pad(any ? num(s.max_abs, s.integral) : "-", 12) << pad(std::to_string(s.nan), 6) << s.inf << "\n";
  }
}

}  // namespace ckpt
