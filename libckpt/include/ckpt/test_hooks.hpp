// SPDX-License-Identifier: Apache-2.0
// Crash points, for the crash-consistency tests only (tests/faults): the library names the steps
// of its commit protocols (a copy task written, a file about to be renamed into place, .metadata
// about to be written, a directory about to replace the old one, ...); a test makes the process
// SIGKILL itself at the N-th time it reaches one, then checks that the old output or a complete
// new one is there. Tools enable it from FSDP_TEST_CRASH_AT; nothing else does.
#pragma once

#include <string_view>

namespace ckpt::test_hooks {

/// `spec` is "NAME" or "NAME:N": die (SIGKILL) the N-th time (default the first) the point NAME
/// is reached. An empty spec disables it. Not thread-safe: call before any work starts.
void set_crash_point(std::string_view spec);

/// Marks the point NAME. Costs one branch while no crash point is set.
void crash_point(std::string_view name) noexcept;

}  // namespace ckpt::test_hooks
