// SPDX-License-Identifier: Apache-2.0
// torch.save archives: reading the record layout and the tensors of data.pkl, and writing them.
#include "ckpt/formats/torch_save.hpp"

#include <algorithm>
#include <charconv>

#include "ckpt/error.hpp"
#include "formats/torch_save/legacy.hpp"
#include "formats/torch_save/tree_reader.hpp"
#include "io/cursor.hpp"
#include "open_index.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_reader.hpp"
#include "zip/zip_writer.hpp"

namespace ckpt {
namespace {

using pickle::GlobalKind;
using pickle::Value;
using pickle::ValuePtr;

std::string record_text(const SourcePtr& s) {
  auto bytes = s->read_vector(0, std::min<std::uint64_t>(s->size(), 64));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

namespace {

[[noreturn]] void refuse_non_zip(const ByteSource& src) {
  detail::refuse_other_torch_save(src);
  std::byte head[4] = {};
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(src.size(), sizeof head));
  src.read_at(0, std::span(head).first(n));
  char hex[64];
  std::snprintf(hex, sizeof hex, "%02x %02x %02x %02x", n > 0 ? static_cast<unsigned>(head[0]) : 0u,
                n > 1 ? static_cast<unsigned>(head[1]) : 0u, n > 2 ? static_cast<unsigned>(head[2]) : 0u,
                n > 3 ? static_cast<unsigned>(head[3]) : 0u);
  throw Error(ErrorKind::kFormat, src.name(), 0,
              std::string("not a torch.save file: starts with ") + hex + ", expected a zip archive (50 4b 03 04)");
}

}  // namespace

std::uint64_t TorchTensor::numel() const noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

bool TorchTensor::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

bool looks_like_torch_save(const ByteSource& source) {
  return detail::starts_like_zip(source) || detail::looks_like_legacy_torch_save(source);
}

TorchSaveFile read_torch_save(SourcePtr source) {
  if (!detail::starts_like_zip(*source)) {
    if (detail::looks_like_legacy_torch_save(*source)) return detail::read_legacy_torch_save(std::move(source));
    refuse_non_zip(*source);
  }
  detail::ZipReader zip(source);
  TorchSaveFile file;
  const auto& entries = zip.entries();
  if (entries.empty()) throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(), "zip archive has no records");
  const std::string& first = entries.front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    throw Error(ErrorKind::kFormat, source->name(), entries.front().local_header_offset,
                "first record '" + first + "' is not inside a folder (torch.save puts every record under one)");
  }
  file.archive_name = first.substr(0, slash);
  const std::string prefix = file.archive_name + "/";
  for (const auto& e : entries) {
    if (!e.name.starts_with(prefix)) {
      throw Error(ErrorKind::kFormat, source->name(), e.local_header_offset,
                  "record '" + e.name + "' is outside the archive folder '" + file.archive_name + "/'");
    }
    file.records.push_back(e.name.substr(prefix.size()));
  }

  const detail::ZipEntry* version = zip.find(prefix + "version");
  if (!version) version = zip.find(prefix + ".data/version");
  if (!version) {
    throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(),
                "archive has no '" + prefix + "version' record (torch.load requires it)");
  }
  {
    const std::string text = trim(record_text(zip.open(*version)));
    int v = 0;
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || p != text.data() + text.size() || v < 1 || v > 10) {
      throw Error(ErrorKind::kFormat, source->name(), version->data_offset,
                  "version record '" + text.substr(0, 20) + "' is not an integer in [1, 10]");
    }
    file.version = v;
  }
  if (const detail::ZipEntry* bo = zip.find(prefix + "byteorder")) {
    const std::string text = trim(record_text(zip.open(*bo)));
    if (text == "big") {
      throw Error(ErrorKind::kUnsupported, source->name(), bo->data_offset,
                  "big-endian storages (byteorder 'big') are not supported");
    }
    if (text != "little") {
      throw Error(ErrorKind::kFormat, source->name(), bo->data_offset,
                  "byteorder record is '" + text.substr(0, 20) + "', expected 'little' or 'big'");
    }
  }
  if (const detail::ZipEntry* c = zip.find(prefix + "constants.pkl")) {
    throw Error(ErrorKind::kUnsupported, source->name(), c->local_header_offset,
                "this is a TorchScript archive (it has constants.pkl), not a torch.save checkpoint");
  }
  const detail::ZipEntry* pkl = zip.find(prefix + "data.pkl");
  if (!pkl) throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(), "archive has no '" + prefix + "data.pkl' record");
  SourcePtr pkl_src = zip.open(*pkl);
  std::vector<std::byte> owned;
  file.root = pickle::parse(pkl_src->whole(owned), pkl_src->name());
  detail::read_tree(file, pkl_src->name(),
                    [&](const std::string& key, DType dtype, std::uint64_t numel, const pickle::Value& pid) {
                      const std::string record = prefix + "data/" + key;
                      const detail::ZipEntry* e = zip.find(record);
                      if (!e) {
                        throw Error(ErrorKind::kFormat, pkl_src->name(), pid.offset,
                                    "storage '" + key + "' has no record '" + record + "' in the archive");
                      }
                      const std::uint64_t want = numel * element_size(dtype);  // read_tree checked the product
                      if (e->size != want) {
                        throw Error(ErrorKind::kFormat, source->name(), e->data_offset,
                                    "record '" + record + "' holds " + std::to_string(e->size) + " bytes, but its storage is " +
                                        std::to_string(numel) + " " + std::string(name(dtype)) + " elements (" +
                                        std::to_string(want) + " bytes)");
                      }
                      return detail::StorageBytes{zip.open(*e), e->crc32};
                    });
  return file;
}

// ---- writing ---------------------------------------------------------------------------------

TorchSaveRecord TorchSaveRecords::operator[](std::size_t i) const {
  auto literal = [](const Literal& l) {
    return TorchSaveRecord{l.name, l.written ? l.size : l.bytes.size(), l.bytes, false, l.written};
  };
  if (i < head_.size()) return literal(head_[i]);
  i -= head_.size();
  if (i < sizes_.size()) return TorchSaveRecord{storage_name(i), sizes_[i], {}, true, std::nullopt};
  return literal(tail_.at(i - sizes_.size()));
}

std::string_view TorchSaveRecords::storage_name(std::size_t s) const {
  const std::size_t begin = s == 0 ? 0 : name_ends_[s - 1];
  return std::string_view(names_).substr(begin, name_ends_[s] - begin);
}

void TorchSaveRecords::add_literal(std::string name, std::vector<std::byte> bytes, std::optional<std::uint32_t> written, std::uint64_t size) {
  (sizes_.empty() ? head_ : tail_).push_back({std::move(name), std::move(bytes), written, size});
}

void TorchSaveRecords::set_literal(std::size_t i, std::vector<std::byte> bytes, std::optional<std::uint32_t> written, std::uint64_t size) {
  Literal& l = i < head_.size() ? head_[i] : tail_.at(i - head_.size() - sizes_.size());
  l.bytes = std::move(bytes);
  l.written = written;
  l.size = size;
}

bool TorchSaveRecords::add_storage(std::string_view key, std::uint64_t size) {
  auto hash = [](std::string_view k) { return std::hash<std::string_view>()(k); };
  auto key_of = [&](std::size_t s) { return storage_name(s).substr(5); };
  if (detail::open_index_find(slots_, hash(key), [&](std::size_t s) { return key_of(s) == key; }) != detail::kNotIndexed) return false;
  if (!tail_.empty()) internal_error("TorchSaveRecords: a storage record after the last literal one");
  if (names_.size() + 5 + key.size() > 0xffffffffu) throw std::length_error("torch.save record names past 4 GiB");
  names_ += "data/";
  names_ += key;
  name_ends_.push_back(static_cast<std::uint32_t>(names_.size()));
  sizes_.push_back(size);
  detail::open_index_add(slots_, sizes_.size(), [&](std::size_t s) { return hash(key_of(s)); });
  return true;
}

void TorchSaveRecords::sort_storages(const std::function<bool(std::string_view, std::string_view)>& less) {
  std::vector<std::uint32_t> order(sizes_.size());
  for (std::size_t s = 0; s < order.size(); ++s) order[s] = static_cast<std::uint32_t>(s);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t x, std::uint32_t y) {
    return less(storage_name(x).substr(5), storage_name(y).substr(5));
  });
  std::string names;
  names.reserve(names_.size());
  std::vector<std::uint32_t> ends(order.size());
  std::vector<std::uint64_t> sizes(order.size());
  for (std::size_t s = 0; s < order.size(); ++s) {
    names += storage_name(order[s]);
    ends[s] = static_cast<std::uint32_t>(names.size());
    sizes[s] = sizes_[order[s]];
  }
  names_ = std::move(names);
  name_ends_ = std::move(ends);
  sizes_ = std::move(sizes);
  std::vector<std::uint32_t>().swap(slots_);  // keys are looked up only while records are added
}

namespace {
using OnPersistentId = std::function<void(const pickle::PersistentId&)>;

std::vector<std::byte> text_bytes(std::string_view text) {
  const auto b = std::as_bytes(std::span(text.data(), text.size()));
  return {b.begin(), b.end()};
}

// The records of a torch.save archive whose data.pkl `pickle_root(on_pid, records)` pickles into
// record 0 (TorchSaveRecords::set_literal), calling on_pid for each persistent id; a storage
// record is made for each storage key when first met.
TorchSaveRecords plan_records(const TorchSaveWriteOptions& options, const std::string& target,
                              const std::function<void(const OnPersistentId&, TorchSaveRecords&)>& pickle_root) {
  TorchSaveRecords records;
  records.add_literal("data.pkl", {});
  if (options.layout == TorchSaveLayout::kCurrent) {
    records.add_literal(".format_version", text_bytes("1"));
    records.add_literal(".storage_alignment", text_bytes("64"));
    records.add_literal("byteorder", text_bytes("little"));
  }
  auto on_pid = [&](const pickle::PersistentId& p) {
    const auto* pid = p.pid ? p.pid->sequence() : nullptr;
    if (!pid || pid->size() != 5 || !(*pid)[0]->str() || *(*pid)[0]->str() != "storage" || !(*pid)[1]->global() ||
        !(*pid)[2]->str() || !(*pid)[4]->int64() || *(*pid)[4]->int64() < 0) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "persistent id is not a torch storage tuple ('storage', class, key, location, numel)");
    }
    const pickle::Global* cls = (*pid)[1]->global();
    std::uint64_t es = 1;
    if (cls->kind == GlobalKind::kStorageClass) es = element_size(*dtype_from_storage_class(cls->name));
    else if (cls->kind != GlobalKind::kUntypedStorage) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "storage class '" + cls->module + "." + cls->name + "' is not a torch storage class");
    }
    records.add_storage(*(*pid)[2]->str(), static_cast<std::uint64_t>(*(*pid)[4]->int64()) * es);
  };
  pickle_root(on_pid, records);
  // torch 1.13 writes storages in sorted(key) order, strings compared ("10" before "2"); torch 2.x
  // with .format_version 1 in numeric key order.
  auto numeric = [](std::string_view k) {
    std::uint64_t v = 0;
    auto [p, ec] = std::from_chars(k.data(), k.data() + k.size(), v);
    return std::pair{ec == std::errc() && p == k.data() + k.size() ? 0 : 1, v};
  };
  if (options.layout == TorchSaveLayout::kTorch113) {
    records.sort_storages([](std::string_view x, std::string_view y) { return x < y; });
  } else {
    records.sort_storages([&](std::string_view x, std::string_view y) { return numeric(x) < numeric(y); });
  }
  records.add_literal("version", text_bytes("3\n"));
  return records;
}
}  // namespace

TorchSaveRecords plan_torch_save(const Value& root, const TorchSaveWriteOptions& options, const std::string& target) {
  return plan_records(options, target, [&](const OnPersistentId& on_pid, TorchSaveRecords& records) {
    records.set_literal(0, pickle::write(root, 2, on_pid));
  });
}

TorchSaveRecords plan_torch_save_streamed(const Value& root, const std::unordered_map<const Value*, pickle::DictBatches>& streamed,
                                          const std::vector<ValuePtr>& persistent, const TorchSaveWriteOptions& options,
                                          const std::string& target, const std::function<void(std::span<const std::byte>)>& pkl_out) {
  return plan_records(options, target, [&](const OnPersistentId& on_pid, TorchSaveRecords& records) {
    std::uint32_t crc = 0;
    std::uint64_t size = 0;
    pickle::write_streamed(
        root, 2, streamed,
        [&](std::span<const std::byte> b) {
          crc = detail::crc32_update(crc, b);
          size += b.size();
          pkl_out(b);
        },
        persistent, on_pid);
    records.set_literal(0, {}, crc, size);
  });
}

void write_torch_save(ByteSink& sink, const Value& root, const std::function<SourcePtr(const std::string&)>& storage_data,
                      const TorchSaveWriteOptions& options) {
  const TorchSaveRecords records = plan_torch_save(root, options, sink.name());
  std::vector<SourcePtr> data(records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TorchSaveRecord r = records[i];
    if (!r.storage) continue;
    data[i] = storage_data(std::string(r.storage_key()));
    if (!data[i] || data[i]->size() != r.size) {
      throw Error(ErrorKind::kInvalidArgument, sink.name(), std::nullopt,
                  "storage '" + std::string(r.storage_key()) + "' needs " + std::to_string(r.size) + " bytes, its data has " +
                      (data[i] ? std::to_string(data[i]->size()) : std::string("none")));
    }
  }
  detail::ZipWriter zip(sink, options.archive_name);
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TorchSaveRecord r = records[i];
    if (!data[i]) {
      zip.add(r.name, r.bytes);
      continue;
    }
    zip.begin_record(r.name, r.size);
    stream_range(*data[i], 0, r.size, [&](std::span<const std::byte> piece) { zip.write(piece); });
    zip.end_record();
  }
  zip.finish();
}

TorchSaveBuilder::TorchSaveBuilder(StorageKeys keys)
    : key_nodes_(keys),
      tag_(pickle::make_str("storage")),
      location_(pickle::make_str("cpu")),
      hooks_global_(pickle::make_global("collections", "OrderedDict")) {}

std::size_t TorchSaveBuilder::add_storage(DType dtype, SourcePtr data) {
  if (data->size() % element_size(dtype) != 0) {
    throw Error(ErrorKind::kInvalidArgument, data->name(), std::nullopt,
                std::to_string(data->size()) + " bytes are not a whole number of " + std::string(name(dtype)) + " elements");
  }
  const std::uint64_t nbytes = data->size();
  storages_.push_back({nbytes, dtype});
  data_.resize(storages_.size());
  data_.back() = std::move(data);
  if (key_nodes_ == StorageKeys::kShared) keys_.push_back(key(storages_.size() - 1));
  return storages_.size() - 1;
}

std::size_t TorchSaveBuilder::reserve_storage(DType dtype, std::uint64_t numel) {
  storages_.push_back({numel * element_size(dtype), dtype});
  if (key_nodes_ == StorageKeys::kShared) keys_.push_back(key(storages_.size() - 1));
  return storages_.size() - 1;
}

std::string TorchSaveBuilder::storage_key(std::size_t storage) const {
  if (storage >= storages_.size()) internal_error("TorchSaveBuilder::storage_key: no such storage");
  return std::to_string(storage);
}

pickle::ValuePtr TorchSaveBuilder::key(std::size_t storage) const {
  if (storage < keys_.size()) return keys_[storage];
  return pickle::make_str(std::to_string(storage));
}

pickle::ValuePtr TorchSaveBuilder::tensor(std::size_t storage, std::vector<std::int64_t> shape) {
  std::vector<std::int64_t> stride(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i];
  }
  return tensor(storage, std::move(shape), std::move(stride), 0);
}

pickle::ValuePtr TorchSaveBuilder::tensor(std::size_t storage, std::vector<std::int64_t> shape,
                                          std::vector<std::int64_t> stride, std::int64_t storage_offset) {
  if (storage >= storages_.size()) internal_error("TorchSaveBuilder::tensor: no such storage");
  const Storage& s = storages_[storage];
  const DTypeInfo& di = info(s.dtype);
  const bool legacy = !di.storage_class.empty();
  const std::int64_t numel = static_cast<std::int64_t>(s.nbytes / di.element_size);
  auto ints = [](const std::vector<std::int64_t>& v) {
    std::vector<ValuePtr> out;
    for (auto x : v) out.push_back(pickle::make_int(x));
    return pickle::make_tuple(std::move(out));
  };
  ValuePtr pid = pickle::make_persistent_id(pickle::make_tuple(
      {tag_, legacy ? global("torch", std::string(di.storage_class)) : global("torch.storage", "UntypedStorage"),
       key(storage), location_, pickle::make_int(legacy ? numel : static_cast<std::int64_t>(s.nbytes))}));
  std::vector<ValuePtr> args{pid, pickle::make_int(storage_offset), ints(shape), ints(stride), pickle::make_bool(false),
                             pickle::make_object(hooks_global_, pickle::BuildOp::kReduce, pickle::make_tuple())};
  if (!legacy) args.push_back(global("torch", std::string(di.name)));
  return pickle::make_object(global("torch._utils", legacy ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3"),
                             pickle::BuildOp::kReduce, pickle::make_tuple(std::move(args)));
}

pickle::ValuePtr TorchSaveBuilder::global(const std::string& module, const std::string& name) {
  const std::string key = module + "." + name;
  auto it = globals_.find(key);
  if (it == globals_.end()) it = globals_.emplace(key, pickle::make_global(module, name)).first;
  return it->second;
}

pickle::ValuePtr TorchSaveBuilder::parameter(pickle::ValuePtr tensor, bool requires_grad) {
  return pickle::make_object(pickle::make_global("torch._utils", "_rebuild_parameter"), pickle::BuildOp::kReduce,
                             pickle::make_tuple({std::move(tensor), pickle::make_bool(requires_grad),
                                                 pickle::make_object(hooks_global_, pickle::BuildOp::kReduce, pickle::make_tuple())}));
}

void TorchSaveBuilder::write(ByteSink& sink, const Value& root, const TorchSaveWriteOptions& options) const {
  write_torch_save(
      sink, root,
      [&](const std::string& key) -> SourcePtr {
        std::size_t i = 0;
        auto [p, ec] = std::from_chars(key.data(), key.data() + key.size(), i);
        if (ec != std::errc() || p != key.data() + key.size() || i >= storages_.size()) return nullptr;
        return i < data_.size() ? data_[i] : nullptr;
      },
      options);
}

}  // namespace ckpt
