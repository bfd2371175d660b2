// SPDX-License-Identifier: Apache-2.0
#include "ckpt/ops/filter.hpp"

#include <cctype>
#include <regex>

#include "ckpt/cast.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "text_helpers.hpp"

namespace ckpt {

bool filters_select(const std::vector<EntryFilter>& filters, std::string_view name) {
  EntrySelection s(filters);
  return s.select(name);
}

EntrySelection::EntrySelection(const std::vector<EntryFilter>& filters) : filters_(filters), matched_(filters.size(), false) {}

bool EntrySelection::select(std::string_view name) {
  bool selected = filters_.empty() || !filters_.front().include;
  const std::string n(name);
  for (std::size_t i = 0; i < filters_.size(); ++i) {
    if (!detail::glob_match(filters_[i].glob, n)) continue;
    selected = filters_[i].include;
    matched_[i] = true;
  }
  ++offered_;
  selected_ += selected;
  return selected;
}

struct EntryRenames::Rule {
  std::string text;  ///< as given, for messages
  std::regex pattern;
  std::string format;  ///< std::regex_replace's: $n for \n, $& for &, $$ for a literal $
  bool global = false;
};

EntryRenames::EntryRenames(std::optional<std::string> strip_prefix, const std::vector<std::string>& renames)
    : prefix_(std::move(strip_prefix)) {
  if (prefix_ && prefix_->empty()) prefix_.reset();
  for (const std::string& r : renames) {
    auto bad = [&](const std::string& why) {
      throw Error(ErrorKind::kInvalidArgument, "rename '" + r + "': " + why + " (expected s/REGEX/REPLACEMENT/ or s/REGEX/REPLACEMENT/g)");
    };
    if (r.size() < 4 || r[0] != 's') bad("not an s command");
    const char d = r[1];
    if (d == '\\' || d == '\n' || std::isalnum(static_cast<unsigned char>(d))) bad("the delimiter must be a punctuation character");
    // The three parts; a backslash before the delimiter makes it part of the text.
    std::vector<std::string> parts(1);
    std::size_t i = 2;
    for (; i < r.size() && parts.size() < 3; ++i) {
      if (r[i] == '\\' && i + 1 < r.size() && r[i + 1] == d) {
        parts.back() += d;
        ++i;
      } else if (r[i] == d) {
        parts.emplace_back();
      } else {
        parts.back() += r[i];
      }
    }
    if (parts.size() != 3) bad("it has no closing delimiter");
    const std::string flags = r.substr(i);
    if (flags != "" && flags != "g") bad("unknown flags '" + flags + "'");
    Rule rule;
    rule.text = r;
    rule.global = flags == "g";
    try {
      rule.pattern = std::regex(parts[0], std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      bad(std::string("the regex does not compile: ") + e.what());
    }
    const std::string& rep = parts[1];
    for (std::size_t k = 0; k < rep.size(); ++k) {
      if (rep[k] == '\\' && k + 1 < rep.size() && std::isdigit(static_cast<unsigned char>(rep[k + 1]))) {
        rule.format += '$';
        rule.format += rep[++k];
      } else if (rep[k] == '\\' && k + 1 < rep.size()) {
        rule.format += rep[++k] == '$' ? std::string("$$") : std::string(1, rep[k]);
      } else if (rep[k] == '&') {
        rule.format += "$&";
      } else if (rep[k] == '$') {
        rule.format += "$$";
      } else {
        rule.format += rep[k];
      }
    }
    rules_.push_back(std::make_shared<const Rule>(std::move(rule)));
  }
}

EntryRenames::EntryRenames(const EntryRenames&) = default;
EntryRenames& EntryRenames::operator=(const EntryRenames&) = default;
EntryRenames::~EntryRenames() = default;

std::string EntryRenames::apply(std::string_view name) const {
  std::string out(name);
  if (prefix_ && out.starts_with(*prefix_)) out.erase(0, prefix_->size());
  for (const auto& rule : rules_) {
    out = std::regex_replace(out, rule->pattern, rule->format,
                             rule->global ? std::regex_constants::format_default : std::regex_constants::format_first_only);
  }
  return out;
}

std::string EntryRenames::claim(std::string_view name, const std::string& where) {
  std::string out = apply(name);
  if (out.empty()) throw Error(ErrorKind::kInvalidArgument, where, std::nullopt, "--rename and --strip-prefix make '" + std::string(name) + "' an empty name");
  const auto [it, added] = made_.emplace(out, std::string(name));
  if (!added && it->second != name) {
    throw Error(ErrorKind::kInvalidArgument, where, std::nullopt,
                "--rename and --strip-prefix make '" + it->second + "' and '" + std::string(name) + "' both '" + out + "'");
  }
  return out;
}

std::vector<std::string> EntrySelection::unmatched() const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < filters_.size(); ++i) {
    if (!matched_[i]) out.push_back(std::string(filters_[i].include ? "--include" : "--exclude") + " '" + filters_[i].glob + "'");
  }
  return out;
}

void EntrySelection::conclude(const std::string& where, std::size_t kept, bool chose, std::vector<std::string> why,
                              Progress* progress) const {
  std::vector<std::string> unmatched_filters = unmatched();
  for (std::string& u : unmatched_filters) u += " matched no entry";
  why.insert(why.begin(), unmatched_filters.begin(), unmatched_filters.end());
  if ((chose || !filters_.empty()) && kept == 0) {
    std::string text;
    for (const std::string& w : why) text += "; " + w;
    throw Error(ErrorKind::kInvalidArgument, where, std::nullopt,
                "the selection selects none of the " + std::to_string(offered_) + " entries" + text + " (fsdp-ckpt-inspect lists them)");
  }
  if (progress) {
    for (const std::string& w : why) progress->note(w);
  }
}

std::string_view top_level_key(const Checkpoint& c, std::string_view fqn) {
  thread_local std::vector<KeyPaths::KeyView> keys;
  if (c.planner_data.keys(fqn, keys) && !keys.empty()) return keys.front().is_int ? std::string_view() : keys.front().text;
  if (!is_dcp(c.format)) return {};
  const std::size_t dot = fqn.find('.');
  return dot == std::string_view::npos ? fqn : fqn.substr(0, dot);
}

// NOTE [What --dtype casts]
// A checkpoint holds more than weights: Adam's exp_avg_sq of 1e-12 flushes to 0 in float16 (and is
// divided by its root on resume), a step count of 1001 becomes 1000 in bfloat16, a 1e6 in float16
// becomes inf. So --dtype casts the model's floating tensors only: those under the top-level key
// "model" where there is one, else every floating tensor not under an optimizer's key ("optim*").
// Integer tensors and non-tensor values keep their type; --cast-include GLOB casts more.
CastScope::CastScope(const Checkpoint& c, std::optional<DType> to, std::vector<std::string> include)
    : c_(c), to_(to), include_(std::move(include)) {
  if (!to_) return;
  for (const TensorEntry& t : c.tensors) {
    if (top_level_key(c, t.name) == "model") {
      has_model_ = true;
      break;
    }
  }
}

DType CastScope::out(std::string_view fqn, DType dtype) const {
  if (!to_ || !is_castable_float(dtype)) return dtype;
  const std::string name(fqn);
  for (const std::string& g : include_) {
    if (detail::glob_match(g, name)) return *to_;
  }
  const std::string_view top = top_level_key(c_, fqn);
  const bool model = has_model_ ? top == "model" : !top.starts_with("optim");
  return model ? *to_ : dtype;
}

}  // namespace ckpt
