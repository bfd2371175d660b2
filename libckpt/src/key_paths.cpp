// SPDX-License-Identifier: Apache-2.0
// NOTE [Compact key paths] in key_paths.hpp.
#include "ckpt/key_paths.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string>

namespace ckpt {

KeyPaths::KeyPaths(const KeyPaths& other) {
  for (const auto& [name, rec] : other.index_) set(name, other.find(name));
}

KeyPaths& KeyPaths::operator=(const KeyPaths& other) {
  if (this != &other) *this = KeyPaths(other);
  return *this;
}

std::string_view KeyPaths::keep(std::string_view fqn) {
  constexpr std::size_t kBlock = 64 * 1024;
  if (block_used_ + fqn.size() > block_size_) {
    block_size_ = std::max(kBlock, fqn.size());
    blocks_.push_back(std::make_unique<char[]>(block_size_));
    block_used_ = 0;
  }
  char* at = blocks_.back().get() + block_used_;
  if (!fqn.empty()) std::memcpy(at, fqn.data(), fqn.size());
  block_used_ += fqn.size();
  return {at, fqn.size()};
}

KeyPaths::Rec KeyPaths::compact(std::string_view fqn, const pickle::ValuePtr& value) {
  Rec r;
  const auto* seq = value ? value->sequence() : nullptr;
  // A tuple of 1 to 16 str and int keys that spell the FQN; anything else (a list too) stays a tree.
  bool ok = seq && !seq->empty() && seq->size() <= 16 && value->is<pickle::Tuple>();
  std::vector<std::uint32_t> cuts;
  std::size_t at = 0;
  for (std::size_t k = 0; ok && k < seq->size(); ++k) {
    const pickle::Value& key = *(*seq)[k];
    std::string number;  // an int key's text
    std::string_view text;
    if (const std::string* s = key.str()) {
      text = *s;
    } else if (auto i = key.int64(); i && key.is<pickle::Int>()) {
      text = number = std::to_string(*i);
      r.ints = static_cast<std::uint16_t>(r.ints | (1u << k));
    } else {
      ok = false;
      break;
    }
    if (k > 0) {
      if (at >= fqn.size() || fqn[at] != '.') ok = false;
      cuts.push_back(static_cast<std::uint32_t>(at));
      ++at;
    }
    if (!ok || fqn.substr(at, text.size()) != text) ok = false;
    at += text.size();
  }
  if (ok && at == fqn.size() && fqn.size() < 0xffffffffu) {
    r.cuts_at = static_cast<std::uint32_t>(cuts_.size());
    r.keys = static_cast<std::uint16_t>(seq->size());
    cuts_.insert(cuts_.end(), cuts.begin(), cuts.end());
    return r;
  }
  r = Rec{};
  r.tree = static_cast<std::int32_t>(trees_.size());
  trees_.push_back(value);
  return r;
}

void KeyPaths::set(std::string_view fqn, const pickle::ValuePtr& value) {
  if (auto it = index_.find(fqn); it != index_.end()) {
    it->second = compact(it->first, value);  // the old cuts or tree stay behind: rare (a repeated key)
    return;
  }
  const std::string_view kept = keep(fqn);
  index_.emplace(kept, compact(kept, value));
}

void KeyPaths::add(std::string_view fqn, const pickle::ValuePtr& value) {
  if (!contains(fqn)) set(fqn, value);
}

pickle::ValuePtr KeyPaths::find(std::string_view fqn) const {
  const auto it = index_.find(fqn);
  if (it == index_.end()) return nullptr;
  const Rec& r = it->second;
  if (r.tree >= 0) return trees_[static_cast<std::size_t>(r.tree)];
  const std::string_view name = it->first;
  std::vector<pickle::ValuePtr> keys;
  keys.reserve(r.keys);
  std::size_t begin = 0;
  for (std::size_t k = 0; k < r.keys; ++k) {
    const std::size_t end = k + 1 < r.keys ? cuts_[r.cuts_at + k] : name.size();
    const std::string_view text = name.substr(begin, end - begin);
    if (r.ints & (1u << k)) {
      std::int64_t v = 0;
      std::from_chars(text.data(), text.data() + text.size(), v);  // written by std::to_string above
      keys.push_back(pickle::make_int(v));
    } else {
      keys.push_back(pickle::make_str(std::string(text)));
    }
    begin = end + 1;
  }
  return pickle::make_tuple(std::move(keys));
}

std::vector<std::string_view> KeyPaths::fqns() const {
  std::vector<std::string_view> out;
  out.reserve(index_.size());
  for (const auto& [name, rec] : index_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace ckpt
