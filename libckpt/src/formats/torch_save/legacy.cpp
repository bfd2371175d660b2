// SPDX-License-Identifier: Apache-2.0
// The legacy torch.save format as torch.serialization's _legacy_save writes it and _legacy_load
// reads it (docs/formats/torch_save.md#legacy-format).
#include "formats/torch_save/legacy.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "formats/torch_save/tree_reader.hpp"

namespace ckpt::detail {
namespace {

using pickle::ValuePtr;

// torch.serialization.MAGIC_NUMBER, 0x1950a86a20f9469cfc6c, as the minimal little-endian
// two's-complement bytes LONG1 carries.
constexpr std::uint8_t kMagic[] = {0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
constexpr std::int64_t kProtocolVersion = 1001;  // torch.serialization.PROTOCOL_VERSION
// The magic number's pickle is at most this long in any protocol (PROTO, a FRAME, LONG1, STOP).
constexpr std::uint64_t kMagicPickleMax = 32;

bool is_magic(const pickle::Value& v) {
  const auto* i = v.get_if<pickle::Int>();
  return i && i->big.size() == sizeof kMagic && std::equal(i->big.begin(), i->big.end(), kMagic);
}

// The magic number's pickle at the start of `src`, or null when the bytes are not one.
ValuePtr magic_pickle(const ByteSource& src, std::uint64_t& end) {
  if (src.size() < 2) return nullptr;
  std::byte head[kMagicPickleMax];
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(src.size(), sizeof head));
  src.read_at(0, std::span(head).first(n));
  if (head[0] != std::byte{0x80}) return nullptr;  // PROTO: torch.save pickles with protocol >= 2
  try {
    pickle::ParseOptions o;
    o.persistent_ids = pickle::PersistentIds::kRefuse;
    return pickle::parse_prefix(std::span<const std::byte>(head, n), src.name(), end, 0, o);
  } catch (const Error&) {
    return nullptr;
  }
}

// `root` with each storage persistent id as the zip format has it: the legacy format's sixth item,
// the storage view of torch < 0.4 or None, dropped (a view is refused). The tree then writes back
// as any torch.save file of today.
ValuePtr archive_storage_ids(const ValuePtr& root, const std::string& file_name) {
  return pickle::rebuild(root, [&](const pickle::Value& v) -> ValuePtr {
    const auto* p = v.get_if<pickle::PersistentId>();
    const auto* pid = p && p->pid && p->pid->is<pickle::Tuple>() ? p->pid->sequence() : nullptr;
    if (!pid || pid->size() != 6 || !(*pid)[0]->str() || *(*pid)[0]->str() != "storage") return nullptr;
    if (!(*pid)[5]->is<pickle::None>()) {
      throw Error(ErrorKind::kUnsupported, file_name, v.offset,
                  "storage '" + ((*pid)[2]->str() ? *(*pid)[2]->str() : std::string("?")) +
                      "' is saved as a view of a storage (torch < 0.4), which is not supported");
    }
    ValuePtr five = pickle::make_tuple({pid->begin(), pid->begin() + 5});
    five->offset = p->pid->offset;
    ValuePtr out = pickle::make_persistent_id(std::move(five));
    out->offset = v.offset;
    return out;
  });
}

}  // namespace

bool looks_like_legacy_torch_save(const ByteSource& src) {
  std::uint64_t end = 0;
  const ValuePtr v = magic_pickle(src, end);
  return v && is_magic(*v);
}

void refuse_other_torch_save(const ByteSource& src) {
  if (src.size() >= 262) {
    std::byte magic[5];
    src.read_at(257, magic);
    if (std::memcmp(magic, "ustar", 5) == 0) {
      throw Error(ErrorKind::kUnsupported, src.name(), 0,
                  "this is the tar-based torch.save format (torch < 0.4), which is not supported; load and re-save it with "
                  "torch >= 1.6");
    }
  }
  std::uint64_t end = 0;
  if (const ValuePtr v = magic_pickle(src, end); v && !is_magic(*v)) {
    throw Error(ErrorKind::kFormat, src.name(), 0,
                "this is a pickle of a " + v->type_name() + ", not a torch.save file (which starts with its magic number)");
  }
}

TorchSaveFile read_legacy_torch_save(SourcePtr src) {
  const std::string& file_name = src->name();
  std::vector<std::byte> owned;
  const std::span<const std::byte> bytes = src->whole(owned);
  // The pickles, one after another; offsets in errors are the file's.
  std::uint64_t at = 0;
  auto next = [&](std::string_view what, pickle::PersistentIds pids) {
    if (at >= bytes.size()) {
      throw Error(ErrorKind::kFormat, file_name, at, "the file ends before the " + std::string(what) + " pickle");
    }
    pickle::ParseOptions o;
    o.persistent_ids = pids;
    std::uint64_t end = 0;
    ValuePtr v = pickle::parse_prefix(bytes.subspan(static_cast<std::size_t>(at)), file_name, end, at, o);
    at += end;
    return v;
  };
  const ValuePtr magic = next("magic number", pickle::PersistentIds::kRefuse);
  if (!is_magic(*magic)) {
    throw Error(ErrorKind::kFormat, file_name, magic->offset, "the first pickle is a " + magic->type_name() + ", not torch.save's magic number");
  }
  const ValuePtr protocol = next("protocol version", pickle::PersistentIds::kRefuse);
  if (protocol->int64() != kProtocolVersion) {
    throw Error(ErrorKind::kFormat, file_name, protocol->offset,
                "protocol version is " + pickle::repr(*protocol, 40) + ", expected " + std::to_string(kProtocolVersion));
  }
  const ValuePtr sys_info = next("system info", pickle::PersistentIds::kRefuse);
  if (const auto* items = sys_info->dict_items()) {
    for (const auto& [k, v] : *items) {
      if (k->str() && *k->str() == "little_endian" && v->get_if<bool>() && !*v->get_if<bool>()) {
        throw Error(ErrorKind::kUnsupported, file_name, v->offset, "the file was written on a big-endian machine, which is not supported");
      }
    }
  }

  TorchSaveFile file;
  file.legacy = true;
  file.root = archive_storage_ids(next("object", pickle::PersistentIds::kAllow), file_name);
  // A storage's bytes follow the pickles; their place is known once the key list is read.
  read_tree(file, file_name, [](const std::string&, DType, std::uint64_t, const pickle::Value&) { return StorageBytes{}; });
  const ValuePtr keys = next("storage keys", pickle::PersistentIds::kRefuse);
  const auto* list = keys->sequence();
  if (!list) throw Error(ErrorKind::kFormat, file_name, keys->offset, "the storage keys are a " + keys->type_name() + ", expected a list");

  std::unordered_set<std::size_t> placed;
  for (const ValuePtr& k : *list) {
    const std::string* key = k->str();
    if (!key) throw Error(ErrorKind::kFormat, file_name, k->offset, "a storage key is a " + k->type_name() + ", expected a str");
    const auto it = file.storage_index.find(*key);
    if (it == file.storage_index.end()) {
      throw Error(ErrorKind::kFormat, file_name, k->offset, "storage key '" + *key + "' is listed, but no tensor of the object uses it");
    }
    if (!placed.insert(it->second).second) {
      throw Error(ErrorKind::kFormat, file_name, k->offset, "storage key '" + *key + "' is listed twice");
    }
    TorchStorage& s = file.storages[it->second];
    src->check_range(at, 8, "the element count of storage '" + *key + "'");
    std::uint8_t count_bytes[8];
    src->read_at(at, std::as_writable_bytes(std::span(count_bytes)));
    std::uint64_t count = 0;
    for (int i = 7; i >= 0; --i) count = (count << 8) | count_bytes[i];
    if (count != s.numel) {
      throw Error(ErrorKind::kFormat, file_name, at,
                  "storage '" + *key + "' holds " + std::to_string(count) + " elements here, but the object's tensors say " +
                      std::to_string(s.numel) + " " + std::string(name(s.dtype)));
    }
    const std::uint64_t nbytes = s.numel * element_size(s.dtype);  // read_tree checked the product
    src->check_range(at + 8, nbytes, "storage '" + *key + "'");
    s.data = sub_source(src, at + 8, nbytes, "storage " + *key);
    at += 8 + nbytes;
  }
  for (const TorchStorage& s : file.storages) {
    if (!s.data) {
      throw Error(ErrorKind::kFormat, file_name, keys->offset,
                  "storage '" + s.key + "', which the object's tensors use, is not in the list of storage keys");
    }
  }
  return file;
}

}  // namespace ckpt::detail
