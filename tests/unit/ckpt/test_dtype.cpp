// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <set>

#include "ckpt/dtype.hpp"

TEST_CASE("the dtype table is consistent", "[ckpt][dtype]") {
  std::set<std::string_view> names, classes, codes;
  for (const auto& row : ckpt::all_dtypes()) {
    CHECK(&ckpt::info(row.dtype) == &row);
    CHECK(names.insert(row.name).second);
    CHECK(ckpt::dtype_from_torch_name(row.name) == row.dtype);
    CHECK(ckpt::dtype_from_torch_name("torch." + std::string(row.name)) == row.dtype);
    if (!row.storage_class.empty()) {
      CHECK(classes.insert(row.storage_class).second);
      CHECK(ckpt::dtype_from_storage_class(row.storage_class) == row.dtype);
    }
    if (!row.safetensors.empty()) {
      CHECK(codes.insert(row.safetensors).second);
      CHECK(ckpt::dtype_from_safetensors(row.safetensors) == row.dtype);
    }
    CHECK(row.element_size >= 1);
  }
  CHECK(ckpt::element_size(ckpt::DType::kBFloat16) == 2);
  CHECK(ckpt::element_size(ckpt::DType::kComplex128) == 16);
  CHECK(ckpt::dtype_from_torch_name("half") == ckpt::DType::kFloat16);
  CHECK(ckpt::dtype_from_storage_class("BFloat16Storage") == ckpt::DType::kBFloat16);
  CHECK_FALSE(ckpt::dtype_from_torch_name("float128"));
  CHECK_FALSE(ckpt::dtype_from_safetensors("F128"));
}
