// SPDX-License-Identifier: Apache-2.0
#include "interop/sample.hpp"

#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/dtype.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/formats/torch_save.hpp"

namespace fsdp_test {

using ckpt::DType;
using ckpt::pickle::ValuePtr;
namespace pk = ckpt::pickle;
using nlohmann::json;

std::vector<std::byte> sample_bytes(std::size_t s, std::size_t nbytes, bool is_bool) {
  std::vector<std::byte> b(nbytes);
  for (std::size_t j = 0; j < nbytes; ++j) {
    const std::size_t v = (j * 131 + s * 17 + 7) % 256;
    b[j] = static_cast<std::byte>(is_bool ? v % 2 : v);
  }
  return b;
}

namespace {

class Sample {
 public:
  std::size_t storage(DType dt, std::size_t numel) {
    const std::size_t idx = storages_.size();
    const std::size_t nbytes = numel * ckpt::element_size(dt);
    auto idx2 = builder_.add_storage(dt, ckpt::memory_source(sample_bytes(idx, nbytes, dt == DType::kBool)));
    storages_.push_back({{"dtype", ckpt::name(dt)}, {"nbytes", nbytes}});
    (void)idx2;
    return idx;
  }
  ValuePtr tensor(json path, std::size_t s, std::vector<std::int64_t> shape, std::vector<std::int64_t> stride = {},
                  std::int64_t offset = 0, bool parameter = false) {
    if (stride.empty() && !shape.empty()) {
      stride.resize(shape.size());
      std::int64_t k = 1;
      for (std::size_t i = shape.size(); i-- > 0;) {
        stride[i] = k;
        k *= shape[i];
      }
    }
    ValuePtr t = builder_.tensor(s, shape, stride, offset);
    if (parameter) t = builder_.parameter(t, true);
    tensors_.push_back({{"path", path}, {"storage", s}, {"dtype", storages_[s]["dtype"]}, {"shape", shape},
                        {"stride", stride}, {"offset", offset}, {"parameter", parameter}});
    return t;
  }
  ValuePtr fresh(json path, DType dt, std::vector<std::int64_t> shape, bool parameter = false) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return tensor(std::move(path), storage(dt, n), std::move(shape), {}, 0, parameter);
  }
  void kind(json path, std::string type) { kinds_.push_back({{"path", path}, {"type", type}}); }
  void scalar(json path, json value) { scalars_.push_back({{"path", path}, {"value", value}}); }

  void write(ckpt::ByteSink& sink, const pk::Value& root) {
    builder_.write(sink, root);
    json m{{"storages", storages_}, {"tensors", tensors_}, {"kinds", kinds_}, {"scalars", scalars_}};
    std::ofstream(sink.name() + ".json") << m.dump(1) << "\n";
  }

 private:
  ckpt::TorchSaveBuilder builder_;
  json storages_ = json::array(), tensors_ = json::array(), kinds_ = json::array(), scalars_ = json::array();
};

ValuePtr s(const char* t) { return pk::make_str(t); }

}  // namespace

void write_sample_torch_save(ckpt::ByteSink& sink) {
  Sample x;
  // model: every dtype torch 1.13 can load, views, a 0-d and an empty tensor, shared storages.
  std::vector<std::pair<ValuePtr, ValuePtr>> model;
  auto add = [&](const char* name, ValuePtr t) { model.emplace_back(s(name), std::move(t)); };
  add("layer.0.weight", x.fresh({"model", "layer.0.weight"}, DType::kFloat32, {4, 3}, true));
  add("layer.0.bias", x.fresh({"model", "layer.0.bias"}, DType::kFloat32, {3}, true));
  const std::pair<const char*, DType> dtypes[] = {
      {"bf16", DType::kBFloat16}, {"f16", DType::kFloat16}, {"f64", DType::kFloat64}, {"c64", DType::kComplex64},
      {"c128", DType::kComplex128}, {"i8", DType::kInt8}, {"u8", DType::kUInt8}, {"i16", DType::kInt16},
      {"i32", DType::kInt32}, {"i64", DType::kInt64}, {"bool", DType::kBool}};
  for (auto [n, dt] : dtypes) add(n, x.fresh({"model", n}, dt, {2, 3}));
  add("scalar", x.fresh({"model", "scalar"}, DType::kFloat32, {}));
  add("empty", x.fresh({"model", "empty"}, DType::kFloat32, {0, 3}));
  const std::size_t base = x.storage(DType::kFloat32, 12);
  add("transposed", x.tensor({"model", "transposed"}, base, {4, 3}, {1, 4}, 0));
  add("original", x.tensor({"model", "original"}, base, {3, 4}));
  const std::size_t longs = x.storage(DType::kInt64, 6);
  add("tail", x.tensor({"model", "tail"}, longs, {4}, {1}, 2));
  add("every_other", x.tensor({"model", "every_other"}, longs, {3}, {2}, 0));
  x.kind({"model"}, "OrderedDict");
  ValuePtr model_v = pk::make_ordered_dict(std::move(model));

  // optimizer: int keys, an int step, lists and tuples (no floats: torch 1.13's weights_only refuses them).
  ValuePtr state0 = pk::make_dict({{s("step"), pk::make_int(7)},
                                   {s("exp_avg"), x.fresh({"optimizer", "state", 0, "exp_avg"}, DType::kFloat32, {4, 3})}});
  x.scalar({"optimizer", "state", 0, "step"}, 7);
  ValuePtr groups = pk::make_list({pk::make_dict({{s("params"), pk::make_list({pk::make_int(0), pk::make_int(1)})},
                                                  {s("name"), s("decay")},
                                                  {s("amsgrad"), pk::make_bool(false)},
                                                  {s("foreach"), pk::make_none()}})});
  x.scalar({"optimizer", "param_groups", 0, "name"}, "decay");
  x.scalar({"optimizer", "param_groups", 0, "amsgrad"}, false);
  x.scalar({"optimizer", "param_groups", 0, "foreach"}, nullptr);
  x.kind({"optimizer", "param_groups"}, "list");
  ValuePtr optim = pk::make_dict({{s("state"), pk::make_dict({{pk::make_int(0), state0}})}, {s("param_groups"), groups}});

  ValuePtr nested = pk::make_list(
      {pk::make_dict({{s("a"), pk::make_list({x.fresh({"nested", 0, "a", 0}, DType::kUInt8, {1})})}}),
       pk::make_tuple({s("tuple"), pk::make_int(3), pk::make_none(), pk::make_bool(true)})});
  x.kind({"nested", 1}, "tuple");
  x.scalar({"nested", 1, 0}, "tuple");
  x.scalar({"nested", 1, 1}, 3);

  const char* unicode_key = "\xc3\xa9pique/\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87";  // "épique/ключ"
  ValuePtr root = pk::make_dict({{s("model"), model_v},
                                 {s("optimizer"), optim},
                                 {s(unicode_key), x.fresh({unicode_key}, DType::kInt32, {2})},
                                 {s("nested"), nested},
                                 {s("epoch"), pk::make_int(3)},
                                 {s("large"), pk::make_int(std::int64_t{1} << 40)},
                                 {s("negative"), pk::make_int(-123456789012)}});
  x.scalar({"epoch"}, 3);
  x.scalar({"large"}, std::int64_t{1} << 40);
  x.scalar({"negative"}, -123456789012);
  x.write(sink, *root);
}

namespace {

// The box [offsets, offsets + sizes) of a C-order tensor's bytes.
std::vector<std::byte> box(const std::vector<std::byte>& full, const std::vector<std::int64_t>& shape,
                           const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& sizes, std::size_t es) {
  std::vector<std::byte> out;
  std::int64_t n = 1;
  for (auto s : sizes) n *= s;
  std::vector<std::int64_t> idx(sizes.size(), 0);
  const auto gs = ckpt::contiguous_strides(shape);
  for (std::int64_t k = 0; k < n; ++k) {
    std::int64_t g = 0;
    for (std::size_t d = 0; d < idx.size(); ++d) g += (idx[d] + offsets[d]) * gs[d];
    auto at = full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(g) * es);
    out.insert(out.end(), at, at + static_cast<std::ptrdiff_t>(es));
    for (std::size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace

void write_sample_dcp(const std::string& dir, int world, const std::string& layout, const std::string& compression) {
  std::vector<ckpt::DcpWriteTensor> tensors;
  json manifest_tensors = json::array();
  std::size_t seed = 0;
  auto add = [&](std::string fqn, DType dt, std::vector<std::int64_t> shape, int dim, bool replicated = false) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    const std::size_t es = ckpt::element_size(dt);
    auto full = sample_bytes(seed, n * es, dt == DType::kBool);
    manifest_tensors.push_back({{"fqn", fqn}, {"dtype", ckpt::name(dt)}, {"shape", shape}, {"seed", seed}});
    ++seed;
    ckpt::DcpWriteTensor t{fqn, dt, shape, {}, false};
    if (replicated || shape.empty()) {
      t.chunks.push_back({0, std::vector<std::int64_t>(shape.size(), 0), shape, ckpt::memory_source(full)});
    } else {
      // torch.chunk: pieces of ceil(n / world); ranks past the last piece hold nothing.
      const std::int64_t len = shape[static_cast<std::size_t>(dim)];
      const std::int64_t step = (len + world - 1) / world;
      for (int r = 0; r < world; ++r) {
        const std::int64_t begin = std::min<std::int64_t>(r * step, len), end = std::min<std::int64_t>(begin + step, len);
        if (end <= begin) continue;
        std::vector<std::int64_t> offsets(shape.size(), 0), sizes = shape;
        offsets[static_cast<std::size_t>(dim)] = begin;
        sizes[static_cast<std::size_t>(dim)] = end - begin;
        t.chunks.push_back({r, offsets, sizes, ckpt::memory_source(box(full, shape, offsets, sizes, es))});
      }
    }
    tensors.push_back(std::move(t));
  };
  add("model.embed.weight", DType::kFloat32, {13, 4}, 0);
  add("model.layers.0.attn.wq.weight", DType::kBFloat16, {8, 8}, 0);
  add("model.layers.0.norm.weight", DType::kFloat16, {3}, 0);  // fewer rows than ranks when world > 3
  add("model.head.weight", DType::kFloat32, {4, 10}, 1);
  add("model.step_count", DType::kInt64, {2}, 0, true);
  add("optim.state.model.embed.weight.exp_avg", DType::kFloat32, {13, 4}, 0);
  add("optim.state.model.embed.weight.step", DType::kFloat32, {}, 0);
  add("extra.mask", DType::kBool, {5, 2}, 0);
  std::vector<ckpt::DcpWriteObject> objects{
      {"epoch", pk::make_int(4), 0},
      {"optim.param_groups.0.params", pk::make_list({s("model.embed.weight")}), 0},
      {"optim.param_groups.0.amsgrad", pk::make_bool(false), world - 1},
  };
  ckpt::DcpWriteOptions o;
  o.world_size = world;
  o.layout = layout == "1.13" ? ckpt::DcpLayout::kTorch113 : ckpt::DcpLayout::kCurrent;
  o.compression = compression == "zstd" ? ckpt::DcpCompression::kZstd : ckpt::DcpCompression::kNone;
  o.overwrite = ckpt::Overwrite::kYes;
  o.planner_data.set("model.embed.weight", pk::make_tuple({s("model"), s("embed.weight")}));
  o.planner_data.set("optim.param_groups.0.params", pk::make_tuple({s("optim"), s("param_groups"), pk::make_int(0), s("params")}));
  ckpt::write_dcp(dir, tensors, objects, o);
  json m{{"tensors", manifest_tensors},
         {"objects", {{"epoch", 4}, {"optim.param_groups.0.params", {"model.embed.weight"}}, {"optim.param_groups.0.amsgrad", false}}},
         {"world_size", world}};
  std::ofstream(dir + ".json") << m.dump(1) << "\n";
}

void write_sample_safetensors(ckpt::ByteSink& sink) {
  std::vector<ckpt::SafetensorsEntry> entries;
  json tensors = json::array();
  std::size_t idx = 0;
  auto add = [&](std::string name, DType dt, std::vector<std::uint64_t> shape) {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    auto bytes = sample_bytes(idx++, n * ckpt::element_size(dt), dt == DType::kBool);
    tensors.push_back({{"name", name}, {"dtype", ckpt::info(dt).safetensors}, {"shape", shape}, {"seed", idx - 1}});
    entries.push_back({std::move(name), dt, ckpt::Dims(std::vector<std::int64_t>(shape.begin(), shape.end())), ckpt::memory_source(std::move(bytes))});
  };
  for (const auto& row : ckpt::all_dtypes()) {
    if (row.safetensors.empty() || row.dtype == DType::kComplex128) continue;
    add(std::string("t_") + std::string(row.safetensors), row.dtype, {2, 3});
  }
  add("scalar", DType::kFloat32, {});
  add("empty", DType::kFloat32, {0, 4});
  add("z_last\xc3\xa9", DType::kInt64, {3});
  std::vector<std::pair<std::string, std::string>> meta{{"format", "pt"}, {"note", "quote\" and \\ back"}};
  ckpt::write_safetensors(sink, entries, meta);
  json m{{"tensors", tensors}, {"metadata", {{"format", "pt"}, {"note", "quote\" and \\ back"}}}};
  std::ofstream(sink.name() + ".json") << m.dump(1) << "\n";
}

}  // namespace fsdp_test
