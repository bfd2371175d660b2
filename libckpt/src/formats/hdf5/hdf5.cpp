// SPDX-License-Identifier: Apache-2.0
// ckpt/formats/hdf5.hpp: the HDF5 module (module.cpp) loaded on first use. It is looked for at
//   $FSDP_HDF5_MODULE, then where the build put it, then <exe>/../lib/fsdp-tools/ and <exe>/.
#include "ckpt/formats/hdf5.hpp"

#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/error.hpp"
#include "ckpt/test_hooks.hpp"
#include "formats/driver.hpp"
#include "formats/hdf5/api.hpp"

// Present in sanitizer builds only.
extern "C" void __sanitizer_set_death_callback(void (*callback)()) __attribute__((weak));

namespace ckpt {
namespace {

struct Loaded {
  const detail::Hdf5Api* api = nullptr;
  std::string why;  // when api is null
};

const Loaded& loaded() {
  static const Loaded l = [] {
    Loaded out;
#if !CKPT_HAS_HDF5
    out.why = "this build has no HDF5 support (FSDP_WITH_HDF5=OFF)";
#else
    std::vector<std::filesystem::path> candidates;
    if (const char* env = std::getenv("FSDP_HDF5_MODULE"); env && *env) candidates.emplace_back(env);
    candidates.emplace_back(CKPT_HDF5_MODULE_BUILD_PATH);
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      candidates.push_back(exe.parent_path() / "../lib/fsdp-tools" / CKPT_HDF5_MODULE_NAME);
      candidates.push_back(exe.parent_path() / CKPT_HDF5_MODULE_NAME);
    }
    // Beside the shared object libckpt is linked into, where that is not the program (the Python
    // module fsdp_tools, installed with a copy beside it).
    Dl_info self{};
    if (::dladdr(reinterpret_cast<void*>(&loaded), &self) && self.dli_fname && *self.dli_fname) {
      candidates.push_back(std::filesystem::path(self.dli_fname).parent_path() / CKPT_HDF5_MODULE_NAME);
    }
    for (const auto& c : candidates) {
      if (!std::filesystem::exists(c, ec)) continue;
      void* h = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        out.why = std::string("cannot load ") + c.string() + ": " + ::dlerror();
        break;
      }
      auto entry = reinterpret_cast<const detail::Hdf5Api* (*)()>(::dlsym(h, "ckpt_hdf5_api"));
      const detail::Hdf5Api* api = entry ? entry() : nullptr;
      if (!api || api->version != detail::kHdf5ApiVersion) {
        out.why = c.string() + " is not this build's HDF5 module";
        break;
      }
      out.api = api;  // the module stays loaded for the life of the process
      return out;
    }
    if (out.why.empty()) out.why = std::string("the HDF5 module ") + CKPT_HDF5_MODULE_NAME + " is not installed beside this program";
#endif
    return out;
  }();
  return l;
}

const detail::Hdf5Api& api_for(const std::filesystem::path& file) {
  const Loaded& l = loaded();
  if (!l.api) throw Error(ErrorKind::kUnsupported, file.string(), std::nullopt, "HDF5 is not available: " + l.why);
  return *l.api;
}

// NOTE [libhdf5 in a child]: libhdf5 1.10 is not safe on malformed files: fuzzing its reader
// finds heap overflows inside libhdf5 within a thousand inputs (tests/fuzz/fuzz_hdf5.cpp,
// testdata/bad/hdf5/). A file's structure is therefore read by a forked child, which sends back
// what the index needs (each dataset's name, dtype, shape and byte range); a crash, a hang or
// memory corruption there stays there and becomes a clean error, and the bytes themselves are
// read by this process through the ordinary (bounds-checked) sources.
class Wire {
 public:
  void u64(std::uint64_t v) { out_.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void str(const std::string& s) {
    u64(s.size());
    out_ += s;
  }
  const std::string& bytes() const noexcept { return out_; }

 private:
  std::string out_;
};

class Unwire {
 public:
  Unwire(const std::string& in, const std::filesystem::path& file) : in_(in), file_(file) {}
  std::uint64_t u64() {
    need(8);
    std::uint64_t v = 0;
    std::memcpy(&v, in_.data() + at_, 8);
    at_ += 8;
    return v;
  }
  std::string str() {
    const std::uint64_t n = u64();
    need(n);
    std::string s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  bool done() const noexcept { return at_ == in_.size(); }

 private:
  void need(std::uint64_t n) const {
    if (n > in_.size() - at_) throw Error(ErrorKind::kInternal, file_.string(), std::nullopt, "the HDF5 reader's answer is cut short");
  }
  const std::string& in_;
  const std::filesystem::path& file_;
  std::size_t at_ = 0;
};

enum : std::uint64_t { kAnswerOk = 1, kAnswerError = 2 };

std::string encode(const Checkpoint& c) {
  Wire w;
  w.u64(kAnswerOk);
  w.str(c.writer);
  w.u64(c.metadata.size());
  for (const auto& [k, v] : c.metadata) {
    w.str(k);
    w.str(v);
  }
  w.u64(c.tensors.size());
  for (const TensorEntry& t : c.tensors) {
    w.str(t.name);
    w.u64(static_cast<std::uint64_t>(t.dtype));
    w.u64(t.shape.size());
    for (std::int64_t d : t.shape) w.u64(static_cast<std::uint64_t>(d));
    const ChunkLocation loc = t.chunks.at(0).location.value();
    w.u64(loc.offset);
    w.u64(loc.length);
  }
  return w.bytes();
}

std::string encode(const Error& e) {
  Wire w;
  w.u64(kAnswerError);
  w.u64(static_cast<std::uint64_t>(e.kind()));
  w.u64(e.offset().has_value());
  w.u64(e.offset().value_or(0));
  w.str(e.message());
  return w.bytes();
}

Checkpoint decode(const std::string& answer, const std::filesystem::path& file) {
  Unwire r(answer, file);
  const std::uint64_t tag = r.u64();
  if (tag == kAnswerError) {
    const auto kind = static_cast<ErrorKind>(r.u64());
    const bool has_offset = r.u64() != 0;
    const std::uint64_t offset = r.u64();
    throw Error(kind, file.string(), has_offset ? std::optional(offset) : std::nullopt, r.str());
  }
  if (tag != kAnswerOk) throw Error(ErrorKind::kInternal, file.string(), std::nullopt, "the HDF5 reader's answer is not one");
  Checkpoint c;
  c.format = Format::kHdf5;
  c.root = file;
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(file, ec);
  c.files.push_back({file.filename().string(), file, size});
  c.writer = r.str();
  for (std::uint64_t i = 0, n = r.u64(); i < n; ++i) {
    std::string k = r.str();
    c.metadata.emplace_back(std::move(k), r.str());
  }
  for (std::uint64_t i = 0, n = r.u64(); i < n; ++i) {
    TensorEntry t;
    t.name = r.str();
    t.dtype = static_cast<DType>(r.u64());
    for (std::uint64_t d = 0, dims = r.u64(); d < dims; ++d) t.shape.push_back(static_cast<std::int64_t>(r.u64()));
    ChunkLocation loc;
    loc.offset = r.u64();
    loc.length = r.u64();
    if (loc.length != t.nbytes() || loc.offset > size || loc.length > size - loc.offset) {
      throw Error(ErrorKind::kFormat, file.string(), loc.offset,
                  "dataset '" + t.name + "': its " + std::to_string(t.nbytes()) + " bytes at [" + std::to_string(loc.offset) + ", " +
                      std::to_string(loc.offset + loc.length) + ") do not lie inside the file (" + std::to_string(size) + " bytes)");
    }
    t.position = c.tensors.size();
    t.chunks.push_back(Chunk{std::vector<std::int64_t>(t.shape.size(), 0), t.shape, loc});
    c.tensors.push_back(std::move(t));
  }
  if (!r.done()) throw Error(ErrorKind::kInternal, file.string(), std::nullopt, "the HDF5 reader's answer has trailing bytes");
  return c;
}

constexpr auto kChildTimeout = std::chrono::seconds(120);

Checkpoint open_in_child(const detail::Hdf5Api& api, const std::filesystem::path& file) {
  int fds[2];
  if (::pipe(fds) != 0) throw Error(ErrorKind::kIo, file.string(), std::nullopt, std::string("pipe: ") + std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error(ErrorKind::kIo, file.string(), std::nullopt, std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::close(fds[0]);
    // The child's death is reported by its status: not by handlers this process installed (a
    // fuzzer's or a sanitizer's, which would report the parent's input as the crash).
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE}) ::signal(sig, SIG_DFL);
    if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(nullptr);
    test_hooks::crash_point("hdf5-child");  // tests: libhdf5 dying mid-read
    std::string answer;
    try {
      answer = encode(api.open(file));
    } catch (const Error& e) {
      answer = encode(e);
    } catch (const std::exception& e) {
      answer = encode(Error(ErrorKind::kFormat, file.string(), std::nullopt, e.what()));
    }
    for (std::size_t at = 0; at < answer.size();) {
      const ssize_t n = ::write(fds[1], answer.data() + at, answer.size() - at);
      if (n <= 0 && errno != EINTR) ::_exit(3);
      if (n > 0) at += static_cast<std::size_t>(n);
    }
    ::_exit(0);  // no atexit handlers, no destructors: the parent's state is the parent's
  }
  ::close(fds[1]);
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + kChildTimeout;
  bool timed_out = false;
  char buf[65536];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{fds[0], POLLIN, 0};
    const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    answer.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    throw Error(ErrorKind::kFormat, file.string(), std::nullopt,
                "libhdf5 did not finish reading its structure within " + std::to_string(kChildTimeout.count()) + " s (a malformed file?)");
  }
  if (WIFSIGNALED(status) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw Error(ErrorKind::kFormat, file.string(), std::nullopt,
                "libhdf5 crashed reading its structure (" +
                    (WIFSIGNALED(status) ? std::string("signal ") + std::to_string(WTERMSIG(status)) : "exit status " + std::to_string(WEXITSTATUS(status))) +
                    "): the file is malformed or hostile; nothing was read from it");
  }
  return decode(answer, file);
}

}  // namespace

bool hdf5_available() noexcept { return loaded().api != nullptr; }

std::string hdf5_unavailable_reason() { return loaded().why; }

std::vector<std::uint64_t> create_hdf5_layout(const std::filesystem::path& file, const std::vector<Hdf5Dataset>& datasets,
                                              const std::vector<std::pair<std::string, std::string>>& attributes) {
  return api_for(file).create_layout(file, datasets, attributes);
}

Checkpoint open_hdf5_checkpoint(const std::filesystem::path& file) { return open_in_child(api_for(file), file); }

namespace formats {

const Driver kHdf5Driver{
    "HDF5",
    [](const Probe& p) {
      constexpr std::string_view kSignature("\x89HDF\r\n\x1a\n", 8);
      const bool hdf5 = !p.directory && p.head.size() >= kSignature.size() &&
                        std::memcmp(p.head.data(), kSignature.data(), kSignature.size()) == 0;
      return hdf5 ? Format::kHdf5 : Format::kUnknown;
    },
    [](const std::filesystem::path& path, MetaTrees) { return open_hdf5_checkpoint(path); },
};

}  // namespace formats
}  // namespace ckpt
