// SPDX-License-Identifier: Apache-2.0
// The torch.save formats before the zip archive (docs/formats/torch_save.md#legacy-format): the
// pickle sequence of torch < 1.6 (and of `_use_new_zipfile_serialization=False` since), read; the
// tar of torch < 0.4, refused by name.
#pragma once

#include "ckpt/formats/torch_save.hpp"
#include "ckpt/io.hpp"

namespace ckpt::detail {

/// Whether `src` starts with the legacy format's first pickle: torch.save's magic number.
bool looks_like_legacy_torch_save(const ByteSource& src);

/// Reads a legacy torch.save file: its pickles (magic number, protocol version 1001, system info,
/// the object, the storage keys), then each listed storage as an 8-byte little-endian element
/// count and its bytes. Reads no storage bytes but the counts. Throws kFormat at the offset of
/// what is wrong, kUnsupported for big-endian data and for storage views (torch < 0.4).
TorchSaveFile read_legacy_torch_save(SourcePtr src);

/// Throws, saying what `src` is instead, when it is a torch.save of a format we do not read (the
/// tar of torch < 0.4: kUnsupported) or a bare pickle without torch.save's magic number (kFormat).
/// Returns otherwise.
void refuse_other_torch_save(const ByteSource& src);

}  // namespace ckpt::detail
