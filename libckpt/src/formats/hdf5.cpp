// SPDX-License-Identifier: Apache-2.0
// ckpt/hdf5.hpp: the HDF5 module (hdf5_module.cpp) loaded on first use. It is looked for at
//   $FSDP_HDF5_MODULE, then where the build put it, then <exe>/../lib/fsdp-tools/ and <exe>/.
#include "ckpt/hdf5.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "ckpt/error.hpp"
#include "formats/hdf5_api.hpp"

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

}  // namespace

bool hdf5_available() noexcept { return loaded().api != nullptr; }

std::string hdf5_unavailable_reason() { return loaded().why; }

std::vector<std::uint64_t> create_hdf5_layout(const std::filesystem::path& file, const std::vector<Hdf5Dataset>& datasets,
                                              const std::vector<std::pair<std::string, std::string>>& attributes) {
  return api_for(file).create_layout(file, datasets, attributes);
}

Checkpoint open_hdf5_checkpoint(const std::filesystem::path& file) { return api_for(file).open(file); }

}  // namespace ckpt
