// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <memory>

#include "index/file_checks.hpp"

namespace ckpt::detail {

/// The record CRCs of every torch.save zip archive among a checkpoint's files (verify --deep).
std::shared_ptr<const FileChecks> torch_save_file_checks();

}  // namespace ckpt::detail
