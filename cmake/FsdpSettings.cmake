# SPDX-License-Identifier: Apache-2.0
# INTERFACE target fsdp_settings: language level, PIC, visibility, sanitizers. Linked PRIVATE.
add_library(fsdp_settings INTERFACE)
target_compile_features(fsdp_settings INTERFACE cxx_std_20)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
set(CMAKE_CXX_VISIBILITY_PRESET hidden)
set(CMAKE_VISIBILITY_INLINES_HIDDEN ON)
if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "build type" FORCE)
endif()
find_program(FSDP_CCACHE ccache)
if(FSDP_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${FSDP_CCACHE})
endif()
if(FSDP_SANITIZE)
  target_compile_options(fsdp_settings INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer
                                                 -fno-sanitize-recover=undefined)
  target_link_options(fsdp_settings INTERFACE -fsanitize=address,undefined)
endif()
if(FSDP_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "FSDP_FUZZ needs clang (libFuzzer); configure with CXX=clang++")
  endif()
  # Instrument everything for coverage; the fuzz executables add -fsanitize=fuzzer (the driver).
  target_compile_options(fsdp_settings INTERFACE -fsanitize=fuzzer-no-link,address,undefined
                                                 -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  target_link_options(fsdp_settings INTERFACE -fsanitize=address,undefined)
endif()
