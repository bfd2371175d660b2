// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the zip reader and the torch.save reader (zip archives and the legacy format).
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "zip/zip_reader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto src = ckpt::borrowed_source(bytes, "fuzz.pt");
  try {
    ckpt::detail::ZipReader zip(src);
    for (const auto& e : zip.entries()) {
      try {
        zip.verify_crc(e);
      } catch (const ckpt::Error& err) {
        if (err.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
      }
    }
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  try {
    auto f = ckpt::read_torch_save(src);
    for (const auto& s : f.storages) (void)s.data->read_vector(0, s.data->size());
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  return 0;
}
