// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "ckpt/io.hpp"

namespace ckpt::detail {

/// Throws kUnsupported, saying which, when `src` is a torch.save file of a format before the zip
/// archive (a bare pickle: torch < 1.6 or _use_new_zipfile_serialization=False; a tar: < 0.4).
void refuse_legacy_torch_save(const ByteSource& src);

}  // namespace ckpt::detail
