// SPDX-License-Identifier: Apache-2.0
// What a format records over whole files beyond its chunks and items (a torch.save archive's
// record CRCs): the driver that opened a checkpoint puts its checks in Checkpoint::file_checks,
// and verify --deep runs them. The index itself knows no format.
#pragma once

#include "ckpt/checkpoint.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

class FileChecks {
 public:
  virtual ~FileChecks() = default;
  /// Checks every checksum the files of `c` record, reading them through `reader` and advancing
  /// `progress` by the bytes read. Throws kFormat, naming the file and offset, at the first that
  /// does not match.
  virtual void check(const Checkpoint& c, const ChunkReader& reader, Progress& progress) const = 0;
};

}  // namespace ckpt
