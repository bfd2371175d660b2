// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the HDF5 reader (our checks over libhdf5's parse); every tensor it accepts
// must be readable within the file. libhdf5 itself is not instrumented: coverage guides through
// our code, and a crash inside libhdf5 counts as a crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <string>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/hdf5.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/dev/shm/fuzz-hdf5-" + std::to_string(::getpid()) + ".h5";
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size) std::fwrite(data, 1, size, f);
    std::fclose(f);
  } else {
    return 0;
  }
  try {
    const ckpt::Checkpoint c = ckpt::open_hdf5_checkpoint(path);
    const ckpt::ChunkReader reader(c, ckpt::FileAccess::kRead);
    for (const auto& t : c.tensors) {
      for (const auto& chunk : t.chunks) {
        const ckpt::ChunkData d = reader.read(t, chunk);
        if (d.storage->size() > 0) (void)d.storage->read_vector(0, std::min<std::uint64_t>(d.storage->size(), 4096));
      }
    }
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  return 0;
}
