// SPDX-License-Identifier: Apache-2.0
// NOTE [Giving freed memory back]: an operation on a large checkpoint works in phases (collect,
// place, plan, write), each building what the next needs and freeing what it no longer does.
// glibc's malloc keeps freed small blocks in its heaps for reuse, and a heap's pages stay resident
// while any block above them lives; so a phase that frees many small blocks may still hold
// them while the next phase's blocks (of other sizes) take fresh pages, and the peak RSS
// approaches the two phases' sum. Between
// phases the operation asks malloc to hand the free pages back (malloc_trim, all arenas, their
// inner free pages too), so the peak is the larger phase, not the sum. The checkpoint tools also
// fix malloc's mapping threshold
// (fsdp_tools::map_large_blocks), so that a large block freed is given back at once.
#pragma once

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ckpt::detail {

/// Returns the pages of freed heap memory to the system; nothing on a C library without it.
inline void give_back_freed_memory() noexcept {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

}  // namespace ckpt::detail
