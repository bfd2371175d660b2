# SPDX-License-Identifier: Apache-2.0
# Helpers for tests/: unit-test executables and interop tests that run PyTorch as the oracle.
set(FSDP_SHARED_TESTDATA "${PROJECT_SOURCE_DIR}/../shared/testdata-real" CACHE PATH
    "checkpoints written by other people's PyTorch (optional; tests skip without it)")

# fsdp_add_unit_tests(NAME SOURCES... LIBS...): one Catch2 executable, each TEST_CASE its own CTest entry.
function(fsdp_add_unit_tests name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${FSDP_CATCH2_INCLUDE} ${PROJECT_SOURCE_DIR}/tests)
  target_link_libraries(${name} PRIVATE fsdp_settings ${ARG_LIBS})
  target_compile_definitions(${name} PRIVATE
    FSDP_TESTDATA_DIR="${PROJECT_SOURCE_DIR}/testdata"
    FSDP_SHARED_TESTDATA_DIR="${FSDP_SHARED_TESTDATA}")
  catch_discover_tests(${name} PROPERTIES SKIP_RETURN_CODE 77)
endfunction()
