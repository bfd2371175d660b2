// SPDX-License-Identifier: Apache-2.0
// run_tool: the one place where exceptions become messages and exit codes (0 ok, 1 runtime error).
#pragma once

#include <functional>
#include <string_view>

namespace fsdp_tools {

/// Runs `body`; prints `<program>: error: <what>` to stderr and returns 1 on any exception.
/// `body` returns the exit status (0, or 1 for "verification failed" style results).
int run_tool(std::string_view program, const std::function<int()>& body);

/// For the checkpoint tools, whose large blocks (a plan's vectors, an index's arrays) live for
/// one phase each: every malloc block of 128 KiB or more gets its own mapping, given back to the
/// system when freed. glibc otherwise raises its mapping threshold to the size of each mapped
/// block freed (up to 32 MiB), after which such vectors come from the heap, whose pages stay
/// resident once freed; a later phase then takes fresh pages beside them (NOTE [Giving freed
/// memory back] in libckpt/src/memory.hpp), and the peak is two phases' sum. Not for
/// fsdp-train, whose LibTorch tensors would each be mapped and unmapped.
void map_large_blocks();

/// For tools that write: the first SIGINT or SIGTERM asks the copy engine to stop
/// (ckpt::request_cancel), so that the tool removes what it started and exits 130; a second one
/// ends the process at once.
void cancel_on_signals();

}  // namespace fsdp_tools
