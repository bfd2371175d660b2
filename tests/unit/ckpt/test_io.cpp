// SPDX-License-Identifier: Apache-2.0
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"
#include "ckpt/output.hpp"
#include "io/cursor.hpp"
#include "support/error_matchers.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::ErrorKind;

TEST_CASE("memory and window sources check every range", "[ckpt][io]") {
  auto src = ckpt::memory_source(bytes_of("0123456789"), "mem");
  auto win = ckpt::sub_source(src, 2, 5, "member");
  CHECK(win->name() == "mem[member]");
  CHECK(win->size() == 5);
  std::byte b[3];
  win->read_at(1, b);
  CHECK(static_cast<char>(b[0]) == '3');
  REQUIRE(win->view(0, 5).has_value());
  CHECK_FALSE(win->view(3, 5).has_value());
  CHECK(ckpt::resolve_window(*win).offset == 2);
  REQUIRE_THROWS_MATCHES(win->read_at(4, b), ckpt::Error, IsCkptError(ErrorKind::kFormat, 4, "passes the end of the data (5 bytes)"));
  REQUIRE_THROWS_MATCHES(ckpt::sub_source(src, 8, 5, "x"), ckpt::Error, IsCkptError(ErrorKind::kFormat, 8, "window 'x'"));
  REQUIRE_THROWS_MATCHES(src->read_vector(4, ~std::uint64_t{0}), ckpt::Error, IsCkptError(ErrorKind::kFormat, 4, "passes the end"));
}

TEST_CASE("file and mmap sources read the same bytes", "[ckpt][io]") {
  TestDir dir;
  std::ofstream(dir / "f") << "hello world";
  for (auto src : {ckpt::open_file(dir / "f"), ckpt::open_mmap(dir / "f")}) {
    CHECK(src->size() == 11);
    CHECK(src->read_vector(6, 5) == bytes_of("world"));
  }
  REQUIRE_THROWS_MATCHES(ckpt::open_file(dir / "missing"), ckpt::Error, IsCkptError(ErrorKind::kIo, std::nullopt, "cannot open"));
  REQUIRE_THROWS_MATCHES(ckpt::open_file(dir.path()), ckpt::Error, IsCkptError(ErrorKind::kIo, std::nullopt, "is a directory"));
}

TEST_CASE("a file sink is atomic: nothing under the final name before commit, nothing left when abandoned", "[ckpt][io]") {
  TestDir dir;
  const auto target = dir / "out.bin";
  {
    auto sink = ckpt::open_file_sink(target, ckpt::Overwrite::kNo);
    sink->write("abc", 3);
    std::vector<std::byte> big(3u << 20, std::byte{7});
    sink->write(big);
    CHECK(sink->offset() == 3 + big.size());
    CHECK_FALSE(std::filesystem::exists(target));
  }  // abandoned
  CHECK_FALSE(std::filesystem::exists(target));
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()) == 0);

  auto sink = ckpt::open_file_sink(target, ckpt::Overwrite::kNo);
  sink->write("abc", 3);
  sink->commit();
  CHECK(read_all(target) == bytes_of("abc"));
  REQUIRE_THROWS_MATCHES(ckpt::open_file_sink(target, ckpt::Overwrite::kNo), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "output exists already"));
  auto again = ckpt::open_file_sink(target, ckpt::Overwrite::kYes);
  again->write("xy", 2);
  again->commit();
  CHECK(read_all(target) == bytes_of("xy"));
}

TEST_CASE("an output directory is whole or absent: built aside, in place on commit, removed when abandoned", "[ckpt][io]") {
  TestDir dir;
  const auto target = dir / "out";
  auto write = [](ckpt::OutputFiles& files, const std::string& name, const std::string& text) {
    auto sink = files.positional(name);
    sink->write_at(0, std::as_bytes(std::span(text)));
    sink->commit();
  };
  {
    const auto out = ckpt::open_file_output(target, ckpt::Overwrite::kNo);
    out->prepare(ckpt::OutputKind::kDcpDirectory, nullptr);
    write(out->directory(), "a.distcp", "abc");
    CHECK(out->directory().size_of("a.distcp") == 3);
    CHECK_FALSE(std::filesystem::exists(target));
  }  // abandoned
  CHECK(std::filesystem::is_empty(dir.path()));
  {
    const auto out = ckpt::open_file_output(target, ckpt::Overwrite::kNo);
    write(out->directory(), "a.distcp", "abc");
    out->commit_directory();
  }
  CHECK(read_all(target / "a.distcp") == bytes_of("abc"));
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()) == 1);
  const auto again = ckpt::open_file_output(target, ckpt::Overwrite::kNo);
  REQUIRE_THROWS_MATCHES(again->check(ckpt::OutputKind::kDcpDirectory), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "output exists already"));
}

TEST_CASE("a memory output holds nothing until committed, then each file by name", "[ckpt][io]") {
  ckpt::MemoryOutput out("mem");
  auto sink = out.file();
  sink->resize(4);
  sink->write_at(2, std::as_bytes(std::span("xyz", 3)));  // past the size set: it grows
  CHECK(out.files().empty());
  sink->commit();
  CHECK(out.files().at("") == std::vector<std::byte>{std::byte{0}, std::byte{0}, std::byte{'x'}, std::byte{'y'}, std::byte{'z'}});
  ckpt::MemoryOutput d("dir");
  auto meta = d.directory().sequential(".metadata", ".metadata.tmp");
  meta->write("m", 1);
  meta->commit();
  CHECK(d.directory().size_of(".metadata") == 1);
  REQUIRE_THROWS_MATCHES(d.directory().size_of("other"), ckpt::Error, IsCkptError(ErrorKind::kIo, std::nullopt, "no such file"));
  CHECK(d.files().empty());
  d.commit_directory();
  CHECK(d.files().size() == 1);
  CHECK(d.source(".metadata")->name() == "dir/.metadata");
}

TEST_CASE("the cursor names the source and the absolute offset", "[ckpt][io]") {
  auto data = bytes_of("\x01\x02\x03");
  ckpt::detail::Cursor c(data, "src", 100);
  CHECK(c.u16le() == 0x0201);
  CHECK(c.offset() == 102);
  REQUIRE_THROWS_MATCHES(c.u32le("length"), ckpt::Error, IsCkptError(ErrorKind::kFormat, 102, "length needs 4 bytes, only 1 remain"));
  REQUIRE_THROWS_MATCHES(ckpt::detail::checked_mul(1ull << 40, 1ull << 40, "s", 5, "size"), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, 5, "size overflows 64 bits"));
}

TEST_CASE("errors compose source, offset, message and context", "[ckpt][io]") {
  ckpt::Error e(ErrorKind::kFormat, "ck/__1_0.distcp[item 7]", 4096, "tensor data ends past the item");
  e.add_context("merging 'layers.0.w'").add_context("writing out.pt");
  CHECK(std::string(e.what()) ==
        "ck/__1_0.distcp[item 7]: offset 4096: tensor data ends past the item (while merging 'layers.0.w'; while writing out.pt)");
  REQUIRE_THROWS_MATCHES(ckpt::internal_error("x"), ckpt::Error, IsCkptError(ErrorKind::kInternal, std::nullopt, "please report"));
}

TEST_CASE("with --force an output replaces a file, an empty directory or an output of its kind, nothing else", "[ckpt][io]") {
  fsdp_test::TestDir dir;
  const auto p = dir.path();
  auto refused = [](const std::filesystem::path& out, ckpt::OutputKind kind) {
    try {
      ckpt::check_output(out, kind, ckpt::Overwrite::kYes);
    } catch (const ckpt::Error& e) {
      CHECK(e.kind() == ckpt::ErrorKind::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(refused(p / "absent", ckpt::OutputKind::kFile).empty());
  std::ofstream(p / "file") << "x";
  CHECK(refused(p / "file", ckpt::OutputKind::kDcpDirectory).empty());
  CHECK_THROWS_WITH(ckpt::check_output(p / "file", ckpt::OutputKind::kFile, ckpt::Overwrite::kNo), Catch::Contains("use --force"));
  std::filesystem::create_directory(p / "empty");
  CHECK(refused(p / "empty", ckpt::OutputKind::kFile).empty());
  std::filesystem::create_directory(p / "dcp");
  for (const char* f : {".metadata", ".metadata.tmp", "__0_0.distcp", "__1.metadata", "meta.pt", "common.pt", "metadata.json", "__1_0.distcp.tmp.77"}) {
    std::ofstream(p / "dcp" / f) << "x";
  }
  CHECK(refused(p / "dcp", ckpt::OutputKind::kDcpDirectory).empty());
  CHECK_THAT(refused(p / "dcp", ckpt::OutputKind::kSafetensorsDirectory), Catch::Contains("is not part of a directory of safetensors shards"));
  CHECK_THAT(refused(p / "dcp", ckpt::OutputKind::kFile), Catch::Contains("a file output cannot replace"));
  std::filesystem::create_directory(p / "dcp" / "sub");
  CHECK_THAT(refused(p / "dcp", ckpt::OutputKind::kDcpDirectory), Catch::Contains("'sub' (a directory)"));
  std::filesystem::create_directory(p / "hf");
  for (const char* f : {"model-00001-of-00002.safetensors", "model.safetensors.index.json"}) std::ofstream(p / "hf" / f) << "x";
  CHECK(refused(p / "hf", ckpt::OutputKind::kSafetensorsDirectory).empty());
  std::ofstream(p / "hf" / "config.json") << "{}";
  CHECK_THAT(refused(p / "hf", ckpt::OutputKind::kSafetensorsDirectory), Catch::Contains("'config.json'"));
  CHECK(refused(p / "hf", ckpt::OutputKind::kHuggingFaceFolder).empty());  // a merge that writes a config.json
  std::ofstream(p / "hf" / "README.md") << "notes";
  CHECK_THAT(refused(p / "hf", ckpt::OutputKind::kHuggingFaceFolder), Catch::Contains("'README.md', which is not part of a Hugging Face model folder"));
  std::filesystem::remove(p / "hf" / "README.md");
  // a file sink replaces a file, and a directory only when check_output allows it, once complete
  auto sink = ckpt::open_file_sink(p / "empty", ckpt::Overwrite::kYes);
  sink->write("new", 3);
  sink->commit();
  CHECK(std::filesystem::is_regular_file(p / "empty"));
  CHECK_THROWS(ckpt::open_file_sink(p / "hf", ckpt::Overwrite::kYes));
  CHECK(std::filesystem::exists(p / "hf" / "config.json"));
}

TEST_CASE("a dead writer's temporary files are removed and named; a live one's are kept", "[ckpt][io]") {
  fsdp_test::TestDir dir;
  const auto target = dir.path() / "out.pt";
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  std::ofstream(dir.path() / ("out.pt.tmp." + std::to_string(dead))) << "x";
  std::ofstream(dir.path() / ("out.pt.tmp." + std::to_string(::getpid()))) << "x";
  std::ofstream(dir.path() / "out.pt.tmp.notapid") << "x";
  const auto removed = ckpt::remove_stale_temps(target);
  REQUIRE(removed.size() == 1);
  CHECK(removed[0].filename() == "out.pt.tmp." + std::to_string(dead));
  CHECK(std::filesystem::exists(dir.path() / ("out.pt.tmp." + std::to_string(::getpid()))));
  CHECK(std::filesystem::exists(dir.path() / "out.pt.tmp.notapid"));
}
