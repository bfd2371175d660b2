// SPDX-License-Identifier: Apache-2.0
// NOTE [Compact key paths] in key_paths.hpp.
#include "ckpt/key_paths.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <functional>
#include <string>

#include "ckpt/error.hpp"
#include "open_index.hpp"

namespace ckpt {

KeyPaths::KeyPaths(const KeyPaths& other) {
  for (const Entry& e : other.entries_) set(e.fqn, other.find(e.fqn));
}

const KeyPaths::Entry* KeyPaths::at(std::string_view fqn) const {
  const std::size_t i =
      detail::open_index_find(slots_, std::hash<std::string_view>{}(fqn), [&](std::size_t e) { return entries_[e].fqn == fqn; });
  return i == detail::kNotIndexed ? nullptr : &entries_[i];
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

bool KeyPaths::spell(std::string_view fqn, std::span<const Key> keys, Rec& r) {
  if (keys.empty() || keys.size() > 16 || fqn.size() >= 0xffffffffu) return false;
  std::uint32_t cuts[16];
  std::uint16_t ints = 0;
  std::size_t at = 0;
  for (std::size_t k = 0; k < keys.size(); ++k) {
    if (k > 0) {
      if (at >= fqn.size() || fqn[at] != '.') return false;
      cuts[k - 1] = static_cast<std::uint32_t>(at);
      ++at;
    }
    if (fqn.substr(at, keys[k].text.size()) != keys[k].text) return false;
    at += keys[k].text.size();
    if (keys[k].is_int) ints = static_cast<std::uint16_t>(ints | (1u << k));
  }
  if (at != fqn.size()) return false;
  r = Rec{};
  r.cuts_at = static_cast<std::uint32_t>(cuts_.size());
  r.keys = static_cast<std::uint16_t>(keys.size());
  r.ints = ints;
  cuts_.insert(cuts_.end(), cuts, cuts + keys.size() - 1);
  return true;
}

KeyPaths::Rec KeyPaths::compact(std::string_view fqn, const pickle::ValuePtr& value) {
  Rec r;
  const auto* seq = value ? value->sequence() : nullptr;
  // A tuple of 1 to 16 str and int keys that spell the FQN; anything else (a list too) stays a tree.
  if (seq && !seq->empty() && seq->size() <= 16 && value->is<pickle::Tuple>()) {
    Key keys[16];
    std::string numbers[16];  // the int keys' texts
    bool ok = true;
    for (std::size_t k = 0; ok && k < seq->size(); ++k) {
      const pickle::Value& key = *(*seq)[k];
      if (const std::string* s = key.str()) {
        keys[k] = {*s, false};
      } else if (auto i = key.int64(); i && key.is<pickle::Int>()) {
        numbers[k] = std::to_string(*i);
        keys[k] = {numbers[k], true};
      } else {
        ok = false;
      }
    }
    if (ok && spell(fqn, std::span<const Key>(keys, seq->size()), r)) return r;
  }
  r = Rec{};
  r.tree = static_cast<std::int32_t>(trees_.size());
  trees_.push_back(value);
  return r;
}

bool KeyPaths::set_spelled(std::string_view fqn, std::span<const Key> keys) {
  Rec r;
  if (!spell(fqn, keys, r)) return false;
  put(fqn, r);
  return true;
}

void KeyPaths::set(std::string_view fqn, const pickle::ValuePtr& value) { put(fqn, compact(fqn, value)); }

void KeyPaths::put(std::string_view fqn, const Rec& r) {
  if (const Entry* e = at(fqn)) {
    entries_[static_cast<std::size_t>(e - entries_.data())].rec = r;  // the old cuts or tree stay behind: rare (a repeated key)
    return;
  }
  entries_.push_back({keep(fqn), r});  // cuts are positions: the same in the kept copy
  detail::open_index_add(slots_, entries_.size(), [&](std::size_t e) { return std::hash<std::string_view>{}(entries_[e].fqn); });
}

void KeyPaths::add(std::string_view fqn, const pickle::ValuePtr& value) {
  if (!contains(fqn)) set(fqn, value);
}

pickle::ValuePtr KeyPaths::find(std::string_view fqn) const {
  const Entry* e = at(fqn);
  if (!e) return nullptr;
  const Rec& r = e->rec;
  if (r.tree >= 0) return trees_[static_cast<std::size_t>(r.tree)];
  std::vector<KeyView> views;
  spelled(*e, views);
  std::vector<pickle::ValuePtr> keys;
  keys.reserve(views.size());
  for (const KeyView& v : views) keys.push_back(v.is_int ? pickle::make_int(v.index) : pickle::make_str(std::string(v.text)));
  return pickle::make_tuple(std::move(keys));
}

void KeyPaths::spelled(const Entry& e, std::vector<KeyView>& out) const {
  const Rec& r = e.rec;
  const std::string_view name = e.fqn;
  std::size_t begin = 0;
  for (std::size_t k = 0; k < r.keys; ++k) {
    const std::size_t end = k + 1 < r.keys ? cuts_[r.cuts_at + k] : name.size();
    KeyView v{name.substr(begin, end - begin), (r.ints & (1u << k)) != 0, 0};
    if (v.is_int) std::from_chars(v.text.data(), v.text.data() + v.text.size(), v.index);  // written by std::to_string
    out.push_back(v);
    begin = end + 1;
  }
}

bool KeyPaths::keys(std::string_view fqn, std::vector<KeyView>& out) const {
  out.clear();
  const Entry* e = at(fqn);
  if (!e) return false;
  const Rec& r = e->rec;
  if (r.tree >= 0) {
    const pickle::ValuePtr& value = trees_[static_cast<std::size_t>(r.tree)];
    const auto* seq = value ? value->sequence() : nullptr;
    if (!seq || seq->empty()) return false;
    for (const pickle::ValuePtr& k : *seq) {
      if (const std::string* s = k->str()) {
        out.push_back({*s, false, 0});
      } else if (auto i = k->int64()) {
        out.push_back({{}, true, *i});
      } else {
        out.clear();
        return false;
      }
    }
    return true;
  }
  spelled(*e, out);
  return true;
}

std::vector<std::string_view> KeyPaths::fqns() const {
  std::vector<std::string_view> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(e.fqn);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace ckpt
