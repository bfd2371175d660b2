# SPDX-License-Identifier: Apache-2.0
# Third-party packages, all from Debian 12 (scripts/setup installs them).
find_package(Threads REQUIRED)
find_package(zstd CONFIG REQUIRED)
# The shared library: Debian's static one is not position-independent, and the Python module
# links libckpt into a shared object.
if(TARGET zstd::libzstd_shared)
  set(FSDP_ZSTD zstd::libzstd_shared)
else()
  set(FSDP_ZSTD zstd::libzstd_static)
endif()
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBDEFLATE REQUIRED IMPORTED_TARGET libdeflate)
find_package(ZLIB REQUIRED)   # crc32_combine; libdeflate has no combine
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
if(FSDP_WITH_HDF5)
  find_package(HDF5 REQUIRED COMPONENTS C)
endif()
if(FSDP_BUILD_TESTS)
  find_path(FSDP_CATCH2_INCLUDE catch2/catch.hpp REQUIRED)
  list(APPEND CMAKE_MODULE_PATH /usr/lib/cmake/Catch2)
  include(Catch)
  find_program(FSDP_TORCH_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
endif()
if(FSDP_WITH_PYTHON)
  # Debian's /usr/bin/python3, whose numpy and python3-torch the module's tests use.
  set(Python_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "the Python the module is built for")
  find_package(Python 3 REQUIRED COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG REQUIRED)
endif()
if(FSDP_WITH_TORCH)
  find_package(Torch CONFIG REQUIRED)
endif()
