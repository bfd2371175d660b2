// SPDX-License-Identifier: Apache-2.0
// fsdp_tools._native: libckpt for Python (python/fsdp_tools/__init__.py is the module users
// import). Every call that reads files releases the GIL; every ckpt::Error becomes
// fsdp_tools.CheckpointError with the file, the offset and the message.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/cast.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/merge.hpp"
#include "ckpt/ops/validate.hpp"
#include "ckpt/ops/result.hpp"
#include "ckpt/ops/shard.hpp"
#include "fsdp-ckpt-inspect/cli.hpp"
#include "fsdp-ckpt-merge/cli.hpp"
#include "fsdp-ckpt-shard/cli.hpp"

namespace py = pybind11;

namespace {

// numpy's type for a dtype's elements: the dtype itself where numpy has it, else an unsigned
// integer of its width holding the bit patterns (bfloat16, the float8 kinds), named by the caller.
std::string numpy_format(ckpt::DType d) {
  using ckpt::DType;
  switch (d) {
    case DType::kBool: return "?";
    case DType::kUInt8: return "u1";
    case DType::kInt8: return "i1";
    case DType::kInt16: return "<i2";
    case DType::kInt32: return "<i4";
    case DType::kInt64: return "<i8";
    case DType::kUInt16: return "<u2";
    case DType::kUInt32: return "<u4";
    case DType::kUInt64: return "<u8";
    case DType::kFloat16: return "<f2";
    case DType::kFloat32: return "<f4";
    case DType::kFloat64: return "<f8";
    case DType::kComplex64: return "<c8";
    case DType::kComplex128: return "<c16";
    default: break;
  }
  switch (ckpt::element_size(d)) {
    case 1: return "u1";
    case 2: return "<u2";
    case 4: return "<u4";
    case 8: return "<u8";
    default: throw ckpt::Error(ckpt::ErrorKind::kUnsupported, std::string("tensors of dtype ") + std::string(ckpt::name(d)) + " have no numpy form");
  }
}

// An uninitialized C-contiguous numpy array.
py::array empty_array(const std::string& format, const ckpt::Dims& shape) {
  return py::array(py::dtype(format), std::vector<py::ssize_t>(shape.begin(), shape.end()));
}

std::span<std::byte> bytes_of(py::array& a) { return {static_cast<std::byte*>(a.mutable_data()), static_cast<std::size_t>(a.nbytes())}; }

class PyCheckpoint {
 public:
  explicit PyCheckpoint(std::string path) : path_(std::move(path)) {
    py::gil_scoped_release unlocked;
    c_ = std::make_unique<ckpt::Checkpoint>(ckpt::open_checkpoint(path_));
    // As every tool that reads tensors: checked arithmetic on every shape and range first (and so
    // chunks that neither overlap nor leave holes, which tensor() relies on).
    ckpt::require_valid_index(*c_);
    reader_ = std::make_unique<ckpt::ChunkReader>(*c_, ckpt::FileAccess::kRead);  // pread: no page faults on a mapping
  }

  // inspect --json of it (with meta: --meta, reopened keeping the metadata trees).
  std::string describe(bool meta) const {
    py::gil_scoped_release unlocked;
    ckpt::InspectOptions o;
    o.format = ckpt::OutputFormat::kJson;
    o.meta = meta;
    std::ostringstream out;
    if (meta) ckpt::inspect(ckpt::open_checkpoint(path_, ckpt::MetaTrees::kKeep), o, out);
    else ckpt::inspect(*c_, o, out);
    return out.str();
  }

  std::size_t size() const { return c_->tensors.size() + c_->objects.size(); }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& t : c_->tensors) out.push_back(t.name);
    for (const auto& o : c_->objects) out.push_back(o.name);
    return out;
  }

  bool contains(const std::string& name) const {
    if (c_->find_tensor(name)) return true;
    for (const auto& o : c_->objects) {
      if (o.name == name) return true;
    }
    return false;
  }

  // (array, dtype name): the tensor's elements, read from the bytes that hold them alone; with
  // float32, a floating dtype numpy lacks (bfloat16, float8) cast to float32.
  py::tuple tensor(const std::string& name, bool float32) const {
    const ckpt::TensorEntry* t = c_->find_tensor(name);
    if (!t) {
      throw ckpt::Error(ckpt::ErrorKind::kInvalidArgument, path_, std::nullopt,
                        contains(name) ? "'" + name + "' is not a tensor" : "no entry '" + name + "'");
    }
    const ckpt::DType dtype = t->dtype;
    const bool cast = float32 && ckpt::is_castable_float(dtype) && dtype != ckpt::DType::kFloat32 && dtype != ckpt::DType::kFloat64 &&
                      dtype != ckpt::DType::kFloat16;
    py::array out = empty_array(numpy_format(cast ? ckpt::DType::kFloat32 : dtype), t->shape);
    std::span<std::byte> to = bytes_of(out);
    {
      py::gil_scoped_release unlocked;
      if (cast) {
        ckpt::cast(ckpt::read_elements(*reader_, *t, 0, t->numel()), dtype, to, ckpt::DType::kFloat32);
      } else {
        ckpt::read_elements(*reader_, *t, 0, t->numel(), to);
      }
    }
    return py::make_tuple(out, std::string(ckpt::name(dtype)));
  }

  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  std::unique_ptr<ckpt::Checkpoint> c_;
  std::unique_ptr<ckpt::ChunkReader> reader_;
};

// verify's problems, each (source, offset or None, message).
std::vector<py::tuple> verify(const std::string& path, bool deep) {
  ckpt::VerifyReport report;
  {
    py::gil_scoped_release unlocked;
    ckpt::VerifyOptions o;
    o.path = path;
    o.depth = deep ? ckpt::VerifyDepth::kDeep : ckpt::VerifyDepth::kStructure;
    report = ckpt::check_checkpoint(o);
  }
  std::vector<py::tuple> out;
  for (const auto& p : report.problems) out.push_back(py::make_tuple(p.source, p.offset ? py::cast(*p.offset) : py::none(), p.message));
  return out;
}

// Progress to a Python callable, callback(done, total), at most every 0.1 s and at the end of a
// phase. A callback that raises, or stop(), makes the next report throw kCancelled, which stops
// the copy and removes what it wrote.
class PyProgress : public ckpt::Progress {
 public:
  explicit PyProgress(py::object callback) : callback_(std::move(callback)) {}
  void start(std::string_view, std::uint64_t total) override {
    std::lock_guard<std::mutex> lock(m_);
    total_ = total;
    done_ = 0;
  }
  void advance(std::uint64_t units) override {
    std::unique_lock<std::mutex> lock(m_);
    done_ += units;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ >= std::chrono::milliseconds(100)) {
      last_ = now;
      report(lock);
    }
    check();
  }
  void finish() override {
    std::unique_lock<std::mutex> lock(m_);
    report(lock);
    check();
  }
  void stop() noexcept { stop_ = true; }
  /// What the callback raised (null: nothing).
  std::exception_ptr raised() const {
    std::lock_guard<std::mutex> lock(m_);
    return raised_;
  }

 private:
  void report(std::unique_lock<std::mutex>&) {
    if (callback_.is_none() || raised_) return;
    py::gil_scoped_acquire locked;
    try {
      callback_(done_, total_);
    } catch (py::error_already_set&) {
      raised_ = std::current_exception();
      stop_ = true;
    }
  }
  void check() const {
    if (stop_) throw ckpt::Error(ckpt::ErrorKind::kCancelled, "stopped (the progress callback raised, or the interpreter was interrupted)");
  }

  py::object callback_;
  mutable std::mutex m_;
  std::uint64_t done_ = 0, total_ = 0;
  std::chrono::steady_clock::time_point last_{};
  std::exception_ptr raised_;
  std::atomic<bool> stop_{false};
};

// Runs `work` on a thread of its own while this one, holding the GIL a moment every 0.1 s, looks
// for Ctrl-C (Python's signal handler runs on the main thread only): then `progress` stops it.
// Rethrows what the callback raised, KeyboardInterrupt, or the work's own error.
void run_interruptibly(PyProgress& progress, const std::function<void()>& work) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::thread t([&] {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(m);
    done = true;
    cv.notify_all();
  });
  bool interrupted = false;
  for (;;) {
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> lock(m);
      if (cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return done; })) break;
    }
    if (!interrupted && PyErr_CheckSignals() != 0) {
      interrupted = true;  // the KeyboardInterrupt stays set until the work has stopped
      progress.stop();
    }
  }
  t.join();
  if (interrupted) throw py::error_already_set();
  if (auto raised = progress.raised()) std::rethrow_exception(raised);
  if (error) std::rethrow_exception(error);
}

// The tool's command line from `args` (what follows the program name): CLI11's errors and the
// tool's own checks become ValueError, worded as the tool words them.
std::vector<ckpt::EntryFilter> parse_like_tool(CLI::App& app, const char* program, const std::vector<std::string>& args) {
  std::vector<const char*> argv{program};
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    throw py::value_error(e.what());
  }
  return fsdp_tools::filters_in_order(static_cast<int>(argv.size()), argv.data());
}

// The tool's checks across options (`translate`), its CLI11 errors as ValueError.
template <class Translate>
auto checked(Translate&& translate) {
  try {
    return translate();
  } catch (const CLI::Error& e) {
    throw py::value_error(e.what());
  }
}

// Runs `write`, one libckpt operation over `options`, as the tool runs it (with its test hooks),
// reporting to `callback`: the tool's --json result.
template <class Options, class Write>
std::string write_like_tool(Options& options, py::object callback, Write&& write) {
  options.report_entries = true;
  options.task_delay_ms = fsdp_tools::test_hooks_from_environment();
  PyProgress progress(std::move(callback));
  options.progress = &progress;
  std::string json;
  run_interruptibly(progress, [&] { json = ckpt::to_json(write()); });
  return json;
}

// fsdp-ckpt-merge ARGS --json, in this process.
std::string merge_like_tool(const std::vector<std::string>& args, py::object callback) {
  fsdp_tools::MergeCliOptions o;
  auto app = fsdp_tools::make_merge_app(o);
  auto filters = parse_like_tool(*app, "fsdp-ckpt-merge", args);
  ckpt::MergeOptions m = checked([&] {
    ckpt::MergeOptions r = fsdp_tools::to_merge(o, std::move(filters));
    o.output = fsdp_tools::merge_output(o, r);
    return r;
  });
  return write_like_tool(m, std::move(callback), [&] { return fsdp_tools::run_merge(o, m); });
}

// fsdp-ckpt-shard ARGS --json, in this process (one process: no RANK of a launcher applies).
std::string shard_like_tool(const std::vector<std::string>& args, py::object callback) {
  fsdp_tools::ShardCliOptions o;
  auto app = fsdp_tools::make_shard_app(o);
  auto filters = parse_like_tool(*app, "fsdp-ckpt-shard", args);
  ckpt::ShardOptions sh = checked([&] { return fsdp_tools::to_shard(o, std::move(filters), {}); });
  return write_like_tool(sh, std::move(callback), [&] { return ckpt::shard(ckpt::open_checkpoint(o.input), o.output, sh, o.flags.dry_run); });
}

// fsdp-ckpt-inspect diff|stats ARGS --json, in this process: its report.
std::string inspect_like_tool(const std::vector<std::string>& args) {
  fsdp_tools::InspectCliOptions o;
  fsdp_tools::InspectApp a = fsdp_tools::make_inspect_app(o);
  auto filters = parse_like_tool(*a.app, "fsdp-ckpt-inspect", args);
  std::ostringstream out;
  if (a.command() == fsdp_tools::InspectCommand::kDiff) {
    ckpt::DiffOptions d = checked([&] { return fsdp_tools::to_diff(o, std::move(filters)); });
    py::gil_scoped_release unlocked;
    ckpt::diff(d, out);
  } else if (a.command() == fsdp_tools::InspectCommand::kStats) {
    const ckpt::StatsOptions st = fsdp_tools::to_stats(o);
    py::gil_scoped_release unlocked;
    ckpt::stats(st, out);
  } else {
    throw py::value_error("diff or stats");
  }
  return out.str();
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "libckpt for Python; import fsdp_tools instead";
  // The Python class (fsdp_tools.CheckpointError) is made by __init__.py and set here.
  // Leaked: a static py::object would be released after the interpreter is gone.
  static py::object& error_class = *new py::object();
  m.def("_set_error_class", [](py::object cls) { error_class = std::move(cls); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ckpt::Error& e) {
      if (!error_class) throw;
      py::object err = error_class(e.what(), e.source(), e.offset() ? py::cast(*e.offset()) : py::none(), e.message(),
                                   std::string(ckpt::to_string(e.kind())));
      PyErr_SetObject(error_class.ptr(), err.ptr());
    }
  });
  py::class_<PyCheckpoint>(m, "Checkpoint")
      .def(py::init<std::string>(), py::arg("path"))
      .def("describe", &PyCheckpoint::describe, py::arg("meta") = false)
      .def("names", &PyCheckpoint::names)
      .def("__len__", &PyCheckpoint::size)
      .def("contains", &PyCheckpoint::contains)
      .def("tensor", &PyCheckpoint::tensor, py::arg("name"), py::arg("float32") = false)
      .def_property_readonly("path", &PyCheckpoint::path);
  m.def("verify", &verify, py::arg("path"), py::arg("deep") = false);
  m.def("merge", &merge_like_tool, py::arg("args"), py::arg("progress") = py::none());
  m.def("shard", &shard_like_tool, py::arg("args"), py::arg("progress") = py::none());
  m.def("inspect", &inspect_like_tool, py::arg("args"));
}
