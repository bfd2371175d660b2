// SPDX-License-Identifier: Apache-2.0
// safetensors: a strict header parser (a small JSON reader of our own, so every error carries the
// absolute byte offset) and the reference writer's layout.
#include "ckpt/formats/safetensors.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>

#include "ckpt/error.hpp"
#include "io/cursor.hpp"

namespace ckpt {
namespace {

constexpr std::uint64_t kMaxHeader = 100'000'000;
constexpr int kMaxJsonDepth = 64;

// ---- a minimal JSON reader -------------------------------------------------------------------

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject } type = Type::kNull;
  std::uint64_t at = 0;         // absolute offset of the value's first byte
  std::string text;             // string value, or the number's literal
  std::vector<Json> items;      // array items, or object values
  std::vector<std::string> keys;
  std::vector<std::uint64_t> key_at;
};

class JsonReader {
 public:
  JsonReader(std::string_view s, const std::string& source, std::uint64_t base) : s_(s), source_(source), base_(base) {}

  /// The top-level object, entry by entry: `entry(key, key_at, value)` for each in file order, each
  /// value's tree dropped after its call, so a header is never one tree as large as the header.
  template <typename Entry>
  void each_entry(Entry&& entry) {
    ws();
    expect('{');
    ws();
    if (peek() == '}') {
      ++pos_;
    } else {
      while (true) {
        ws();
        if (peek() != '"') fail("expected a string key");
        const std::uint64_t key_at = base_ + pos_;
        const std::string key = string();
        ws();
        expect(':');
        ws();
        entry(key, key_at, value(1));
        ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        break;
      }
    }
    ws();
    if (pos_ != s_.size()) fail("unexpected '" + std::string(1, s_[pos_]) + "' after the header object");
  }

 private:
  [[noreturn]] void fail(const std::string& m) const { throw Error(ErrorKind::kFormat, source_, base_ + pos_, "header JSON: " + m); }
  void ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  char peek() {
    if (pos_ >= s_.size()) fail("unexpected end of the header");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "', found '" + s_[pos_] + "'");
    ++pos_;
  }
  Json value(int depth) {
    if (depth > kMaxJsonDepth) fail("nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    Json v;
    v.at = base_ + pos_;
    const char c = peek();
    if (c == '{') {
      v.type = Json::Type::kObject;
      ++pos_;
      ws();
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        ws();
        if (peek() != '"') fail("expected a string key");
        v.key_at.push_back(base_ + pos_);
        v.keys.push_back(string());
        ws();
        expect(':');
        ws();
        v.items.push_back(value(depth + 1));
        ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.type = Json::Type::kArray;
      ++pos_;
      ws();
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        ws();
        v.items.push_back(value(depth + 1));
        ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.type = Json::Type::kString;
      v.text = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = Json::Type::kNumber;
      const std::size_t start = pos_;
      while (pos_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '-' || s_[pos_] == '+' ||
                                  s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E')) {
        ++pos_;
      }
      v.text = std::string(s_.substr(start, pos_ - start));
      return v;
    }
    for (auto [word, type] : {std::pair{"true", Json::Type::kBool}, std::pair{"false", Json::Type::kBool},
                              std::pair{"null", Json::Type::kNull}}) {
      const std::string_view w(word);
      if (s_.substr(pos_, w.size()) == w) {
        pos_ += w.size();
        v.type = type;
        v.text = std::string(w);
        return v;
      }
    }
    fail(std::string("unexpected '") + c + "'");
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) {
        --pos_;
        fail("control character in a string");
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {
            if (s_.substr(pos_, 2) != "\\u") fail("unpaired surrogate escape");
            pos_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xdc00 || lo >= 0xe000) fail("invalid low surrogate escape");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail("unpaired surrogate escape");
          }
          utf8(cp, out);
          break;
        }
        default: --pos_; fail(std::string("invalid escape '\\") + e + "'");
      }
    }
  }
  std::uint32_t hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<std::uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<std::uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<std::uint32_t>(h - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    return v;
  }
  static void utf8(std::uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string_view s_;
  const std::string& source_;
  std::uint64_t base_;
  std::size_t pos_ = 0;
};

bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned char c = p[i];
    std::size_t n = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2 : (c & 0xf8) == 0xf0 ? 3 : 9;
    if (n == 9 || (n == 1 && c < 0xc2) || (n == 3 && c > 0xf4)) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size() || (p[i + k] & 0xc0) != 0x80) return false;
    }
    i += n + 1;
  }
  return true;
}

std::uint64_t json_uint(const Json& v, const std::string& source, std::string_view what) {
  if (v.type != Json::Type::kNumber || v.text.empty() || v.text[0] == '-' ||
      v.text.find_first_not_of("0123456789") != std::string::npos || (v.text.size() > 1 && v.text[0] == '0')) {
    throw Error(ErrorKind::kFormat, source, v.at, std::string(what) + " is " + (v.text.empty() ? "not a number" : "'" + v.text + "'") +
                                                     ", expected a non-negative integer");
  }
  std::uint64_t x = 0;
  for (char c : v.text) {
    if (__builtin_mul_overflow(x, 10u, &x) || __builtin_add_overflow(x, static_cast<std::uint64_t>(c - '0'), &x)) {
      throw Error(ErrorKind::kFormat, source, v.at, std::string(what) + " " + v.text + " does not fit 64 bits");
    }
  }
  return x;
}

// The reference implementation's Dtype enum order, which is its alignment order.
int dtype_rank(DType d) {
  static constexpr std::array<DType, 20> kOrder{
      DType::kBool,  DType::kUInt8,   DType::kInt8,    DType::kFloat8E5M2,     DType::kFloat8E4M3FN,
      DType::kFloat8E8M0FNU, DType::kFloat8E4M3FNUZ, DType::kFloat8E5M2FNUZ, DType::kInt16, DType::kUInt16,
      DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kUInt32, DType::kFloat32,
      DType::kComplex64, DType::kFloat64, DType::kInt64, DType::kUInt64, DType::kComplex128};
  for (std::size_t i = 0; i < kOrder.size(); ++i) {
    if (kOrder[i] == d) return static_cast<int>(i);
  }
  return -1;
}

void json_string(std::string_view s, std::string& out) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

}  // namespace

bool looks_like_safetensors(const ByteSource& source) {
  if (source.size() < 9) return false;
  std::byte head[9];
  source.read_at(0, head);
  // The header length is checked by the reader (with a precise message), not here.
  return head[8] == std::byte{'{'};
}

SafetensorsFile read_safetensors(SourcePtr source) {
  const std::string& name = source->name();
  const std::uint64_t size = source->size();
  if (size < 8) {
    throw Error(ErrorKind::kFormat, name, 0, "file of " + std::to_string(size) + " bytes is too small for a safetensors header length (8 bytes)");
  }
  std::byte len_bytes[8];
  source->read_at(0, len_bytes);
  std::uint64_t n = 0;
  std::memcpy(&n, len_bytes, 8);
  if (n > kMaxHeader) {
    throw Error(ErrorKind::kFormat, name, 0, "header length " + std::to_string(n) + " exceeds the limit of 100000000 bytes");
  }
  if (n > size - 8) {
    throw Error(ErrorKind::kFormat, name, 0,
                "header length " + std::to_string(n) + " passes the end of the file (" + std::to_string(size) + " bytes)");
  }
  const std::vector<std::byte> raw = source->read_vector(8, n);
  const std::string_view text(reinterpret_cast<const char*>(raw.data()), raw.size());
  if (!valid_utf8(text)) throw Error(ErrorKind::kFormat, name, 8, "header is not valid UTF-8");
  if (text.empty() || text[0] != '{') throw Error(ErrorKind::kFormat, name, 8, "header does not start with '{'");
  SafetensorsFile file;
  file.header_size = n;
  const std::uint64_t buffer_at = 8 + n;
  const std::uint64_t buffer_size = size - buffer_at;
  std::map<std::string, std::uint64_t, std::less<>> seen;  // each name's key offset
  JsonReader(text, name, 8).each_entry([&](const std::string& key, std::uint64_t key_at, const Json& v) {
    if (!seen.emplace(key, key_at).second) {
      throw Error(ErrorKind::kFormat, name, key_at, "tensor name '" + key + "' appears twice in the header");
    }
    if (key == "__metadata__") {
      if (v.type != Json::Type::kObject) throw Error(ErrorKind::kFormat, name, v.at, "__metadata__ is not an object of strings");
      for (std::size_t k = 0; k < v.keys.size(); ++k) {
        if (v.items[k].type != Json::Type::kString) {
          throw Error(ErrorKind::kFormat, name, v.items[k].at, "__metadata__ value of '" + v.keys[k] + "' is not a string");
        }
        file.metadata.emplace_back(v.keys[k], v.items[k].text);
      }
      return;
    }
    if (v.type != Json::Type::kObject) throw Error(ErrorKind::kFormat, name, v.at, "entry '" + key + "' is not an object");
    const Json *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
    for (std::size_t k = 0; k < v.keys.size(); ++k) {
      if (v.keys[k] == "dtype") dtype = &v.items[k];
      else if (v.keys[k] == "shape") shape = &v.items[k];
      else if (v.keys[k] == "data_offsets") offsets = &v.items[k];
    }
    if (!dtype || !shape || !offsets) {
      throw Error(ErrorKind::kFormat, name, v.at, "tensor '" + key + "' lacks " +
                                                      std::string(!dtype ? "dtype" : !shape ? "shape" : "data_offsets"));
    }
    SafetensorsTensor t;
    t.name = key;
    if (dtype->type != Json::Type::kString) throw Error(ErrorKind::kFormat, name, dtype->at, "dtype of '" + key + "' is not a string");
    auto dt = dtype_from_safetensors(dtype->text);
    if (!dt) {
      const bool known = dtype->text == "F4" || dtype->text == "F6_E2M3" || dtype->text == "F6_E3M2";
      throw Error(known ? ErrorKind::kUnsupported : ErrorKind::kFormat, name, dtype->at,
                  "dtype '" + dtype->text + "' of '" + key + "' is " + (known ? "a sub-byte type we do not support" : "not a known safetensors dtype"));
    }
    t.dtype = *dt;
    if (shape->type != Json::Type::kArray) throw Error(ErrorKind::kFormat, name, shape->at, "shape of '" + key + "' is not an array");
    std::uint64_t numel = 1;
    for (const Json& d : shape->items) {
      t.shape.push_back(json_uint(d, name, "shape entry of '" + key + "'"));
      numel = detail::checked_mul(numel, t.shape.back(), name, d.at, "element count of '" + key + "'");
    }
    if (offsets->type != Json::Type::kArray || offsets->items.size() != 2) {
      throw Error(ErrorKind::kFormat, name, offsets->at, "data_offsets of '" + key + "' is not a [begin, end] pair");
    }
    const std::uint64_t b = json_uint(offsets->items[0], name, "data_offsets begin of '" + key + "'");
    const std::uint64_t e = json_uint(offsets->items[1], name, "data_offsets end of '" + key + "'");
    if (b > e) throw Error(ErrorKind::kFormat, name, offsets->at, "data_offsets of '" + key + "' begin " + std::to_string(b) + " after end " + std::to_string(e));
    const std::uint64_t want = detail::checked_mul(numel, element_size(t.dtype), name, offsets->at, "byte size of '" + key + "'");
    if (e - b != want) {
      throw Error(ErrorKind::kFormat, name, offsets->at,
                  "tensor '" + key + "' spans " + std::to_string(e - b) + " bytes, but " + dtype->text + " " +
                      std::to_string(numel) + " elements need " + std::to_string(want));
    }
    if (e > buffer_size) {
      throw Error(ErrorKind::kFormat, name, offsets->at,
                  "tensor '" + key + "' ends at buffer offset " + std::to_string(e) + ", past the buffer's " +
                      std::to_string(buffer_size) + " bytes");
    }
    t.begin = buffer_at + b;
    t.end = buffer_at + e;
    file.tensors.push_back(std::move(t));
  });
  // The tensors must tile the buffer exactly.
  std::vector<const SafetensorsTensor*> order;
  for (const auto& t : file.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  std::uint64_t expect = buffer_at;
  for (const auto* t : order) {
    if (t->begin != expect) {
      throw Error(ErrorKind::kFormat, name, seen.find(t->name)->second,
                  "tensor '" + t->name + "' starts at buffer offset " + std::to_string(t->begin - buffer_at) + ", expected " +
                      std::to_string(expect - buffer_at) + (t->begin > expect ? " (a hole)" : " (an overlap)"));
    }
    expect = t->end;
  }
  if (expect != size) {
    throw Error(ErrorKind::kFormat, name, expect,
                "tensors end at buffer offset " + std::to_string(expect - buffer_at) + " but the buffer holds " +
                    std::to_string(buffer_size) + " bytes (trailing bytes)");
  }
  file.source = std::move(source);
  return file;
}

SourcePtr SafetensorsFile::data(const SafetensorsTensor& t) const { return sub_source(source, t.begin, t.end - t.begin, t.name); }

namespace {
// The JSON header of `l` (its entries in file order) without padding, a piece per entry to `put`;
// `placed(begin, end)` gets each entry's data offsets, counted from the buffer's start.
void header_json(const SafetensorsLayout& l, const std::function<void(std::string_view)>& put,
                 const std::function<void(std::uint64_t, std::uint64_t)>& placed) {
  std::string piece = "{";
  if (!l.metadata.empty()) {
    piece += "\"__metadata__\":{";
    for (std::size_t i = 0; i < l.metadata.size(); ++i) {
      if (i) piece += ',';
      json_string(l.metadata[i].first, piece);
      piece += ':';
      json_string(l.metadata[i].second, piece);
    }
    piece += "}";
  }
  bool first = l.metadata.empty();
  std::uint64_t at = 0;
  for (const auto& e : l.entries) {
    if (!first) piece += ',';
    first = false;
    json_string(e.name, piece);
    piece += ":{\"dtype\":\"";
    piece += info(e.dtype).safetensors;
    piece += "\",\"shape\":[";
    for (std::size_t i = 0; i < e.shape.size(); ++i) {
      if (i) piece += ',';
      piece += std::to_string(e.shape[i]);
    }
    const std::uint64_t end = at + e.nbytes();
    piece += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(end) + "]}";
    placed(at, end);
    at = end;
    put(piece);
    piece.clear();
  }
  piece += "}";
  put(piece);
}
}  // namespace

SafetensorsLayout plan_safetensors(std::vector<SafetensorsEntry> entries,
                                   const std::vector<std::pair<std::string, std::string>>& metadata, const std::string& target) {
  for (const auto& e : entries) {
    const DTypeInfo& di = info(e.dtype);
    if (di.safetensors.empty() || dtype_rank(e.dtype) < 0) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "tensor '" + e.name + "' has dtype " + std::string(di.name) + ", which safetensors cannot store");
    }
    if (e.name == "__metadata__") throw Error(ErrorKind::kInvalidArgument, target, std::nullopt, "a tensor cannot be named __metadata__");
  }
  std::vector<std::size_t> order(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t i, std::size_t j) {
    const SafetensorsEntry &a = entries[i], &b = entries[j];
    const int ra = dtype_rank(a.dtype), rb = dtype_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  {
    // Into that order in place, cycle by cycle (a second vector would be as large again): place i
    // takes the entry given at order[i].
    std::vector<bool> placed(entries.size());
    for (std::size_t start = 0; start < entries.size(); ++start) {
      if (placed[start]) continue;
      SafetensorsEntry first = std::move(entries[start]);
      for (std::size_t at = start;;) {
        placed[at] = true;
        const std::size_t from = order[at];
        if (from == start) {
          entries[at] = std::move(first);
          break;
        }
        entries[at] = std::move(entries[from]);
        at = from;
      }
    }
  }
  {
    // By name alone: two entries of one name and different dtypes are not neighbours above.
    // Sorted as indices (4 bytes each, not a 16-byte view).
    if (entries.size() > 0xffffffffu) throw Error(ErrorKind::kInvalidArgument, target, std::nullopt, "more than 2^32 tensors");
    std::vector<std::uint32_t> by_name(entries.size());
    for (std::size_t i = 0; i < by_name.size(); ++i) by_name[i] = static_cast<std::uint32_t>(i);
    std::sort(by_name.begin(), by_name.end(), [&](std::uint32_t a, std::uint32_t b) { return entries[a].name < entries[b].name; });
    const auto twice = std::adjacent_find(by_name.begin(), by_name.end(),
                                          [&](std::uint32_t a, std::uint32_t b) { return entries[a].name == entries[b].name; });
    if (twice != by_name.end()) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt, "tensor name '" + entries[*twice].name + "' given twice");
    }
  }
  SafetensorsLayout out;
  out.entries = std::move(entries);
  out.order = std::move(order);
  out.metadata = metadata;
  out.begins.reserve(out.entries.size());
  // The header is measured here and made again, a piece at a time, when it is written
  // (write_head), so it is never held whole.
  std::uint64_t json = 0;
  std::uint64_t data = 0;
  header_json(out, [&](std::string_view p) { json += p.size(); }, [&](std::uint64_t begin, std::uint64_t end) {
    out.begins.push_back(begin);
    data = end;
  });
  const std::uint64_t n = json + (8 - json % 8) % 8;  // padded with spaces to a multiple of 8
  out.head_size = 8 + n;
  for (auto& b : out.begins) b += out.head_size;
  out.size = out.head_size + data;
  return out;
}

void SafetensorsLayout::write_head(const std::function<void(std::span<const std::byte>)>& write) const {
  // Entries' pieces gathered into writes of about 64 KiB.
  std::string buffer;
  auto flush = [&] {
    write(std::as_bytes(std::span(buffer.data(), buffer.size())));
    buffer.clear();
  };
  const std::uint64_t n = head_size - 8;
  for (int i = 0; i < 8; ++i) buffer += static_cast<char>(n >> (8 * i));
  std::uint64_t json = 0;
  header_json(*this, [&](std::string_view p) {
    json += p.size();
    buffer += p;
    if (buffer.size() >= (std::size_t{64} << 10)) flush();
  }, [](std::uint64_t, std::uint64_t) {});
  buffer.append(static_cast<std::size_t>(n - json), ' ');
  flush();
}

std::uint64_t SafetensorsEntry::nbytes() const noexcept {
  std::uint64_t numel = 1;
  for (const std::int64_t d : shape) numel *= static_cast<std::uint64_t>(d);
  return numel * element_size(dtype);
}

void write_safetensors(ByteSink& sink, std::vector<SafetensorsEntry> entries,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  for (const auto& e : entries) {
    if (!e.data || e.data->size() != e.nbytes()) {
      throw Error(ErrorKind::kInvalidArgument, sink.name(), std::nullopt,
                  "tensor '" + e.name + "' needs " + std::to_string(e.nbytes()) + " bytes, its data has " +
                      (e.data ? std::to_string(e.data->size()) : std::string("none")));
    }
  }
  const SafetensorsLayout layout = plan_safetensors(std::move(entries), metadata, sink.name());
  layout.write_head([&](std::span<const std::byte> b) { sink.write(b); });
  for (const auto& e : layout.entries) {
    stream_range(*e.data, 0, e.data->size(), [&](std::span<const std::byte> piece) { sink.write(piece); });
  }
}

}  // namespace ckpt
