# SPDX-License-Identifier: Apache-2.0
# INTERFACE target fsdp_warnings; linked PRIVATE so nothing leaks to consumers.
add_library(fsdp_warnings INTERFACE)
target_compile_options(fsdp_warnings INTERFACE
  -Wall -Wextra -Wshadow -Wconversion -Wsign-conversion -Wnon-virtual-dtor -Wpedantic
  $<$<BOOL:${FSDP_WERROR}>:-Werror>)
