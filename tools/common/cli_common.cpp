// SPDX-License-Identifier: Apache-2.0
#include "common/cli_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "ckpt/error.hpp"
#include "ckpt/test_hooks.hpp"
#include "fsdp_version.hpp"

namespace fsdp_tools {

std::string version_text(std::string_view program) {
  return std::string(program) + " " + FSDP_VERSION + " (" + FSDP_GIT_DESCRIBE + ")";
}

namespace {

// --help as zstd's and the gguf tools' read: the option and the kind of value it takes
// ("--n-layer INT", "--layout {fsdp,dtensor}"), then what it does, its range and its default
// ("transformer blocks [1 - 1024] (default: 2)"). An option whose default is a placeholder for
// "not given" (what its description explains) shows none: no_default() marks it.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override {
    if (opt->get_type_size() == 0) return {};  // a flag
    const auto [kind, check] = split(opt->get_type_name());
    std::string out = " " + (check.starts_with("{") ? check : names_kind(check) ? check.substr(0, check.find('(')) : kind);
    if (opt->get_expected_max() > 1) out += " ...";
    if (opt->get_required()) out += " (required)";
    return out;
  }
  std::string make_option_desc(const CLI::Option* opt) const override {
    std::string desc = opt->get_description();
    if (opt->get_type_size() == 0) return desc;
    const std::string check = split(opt->get_type_name()).second;
    // A range or sign; a set is the value's kind already, and a validator of validators
    // ("(A) OR (B)") is for the description to explain.
    if (!check.empty() && !check.starts_with("{") && !check.starts_with("(") && !names_kind(check)) desc += " [" + range_text(check) + "]";
    std::string d = opt->get_default_str();
    if (d.size() >= 2 && d.front() == '[' && d.back() == ']') d = d.substr(1, d.size() - 2);  // a list's
    if (!d.empty() && !opt->get_required()) desc += " (default: " + d + ")";
    return desc;
  }

 private:
  // "INT:INT in [1 - 1024]" -> ("INT", "INT in [1 - 1024]"): CLI11 joins the validators'
  // descriptions to the type's name.
  static std::pair<std::string, std::string> split(const std::string& type) {
    const std::size_t colon = type.find(':');
    if (colon == std::string::npos) return {type, {}};
    return {type.substr(0, colon), type.substr(colon + 1)};
  }
  // A validator whose description is a kind of value (FILE, PATH, DIR): it stands for the value.
  static bool names_kind(const std::string& check) {
    return check == "FILE" || check == "PATH(existing)" || check == "DIR" || check == "PATH";
  }
  // "INT in [1 - 1024]" -> "1 - 1024"; "POSITIVE" -> "> 0"; "NONNEGATIVE" -> ">= 0".
  static std::string range_text(const std::string& check) {
    if (const std::size_t open = check.find('['); open != std::string::npos && check.back() == ']') {
      return check.substr(open + 1, check.size() - open - 2);
    }
    if (check == "POSITIVE") return "> 0";
    if (check == "NONNEGATIVE") return ">= 0";
    return check;
  }
};

}  // namespace

void setup_app(CLI::App& app, std::string_view program, std::string_view description) {
  app.description(std::string(description));
  app.footer("See " + std::string(program) + "(1).");
  app.set_version_flag("--version", version_text(program), "print the version and exit");
  app.formatter(std::make_shared<HelpFormatter>());
  app.get_formatter()->column_width(34);
  app.option_defaults()->always_capture_default();
  app.add_option_function<std::string>(
         "--completion",
         [&app](const std::string& shell) {
           // Checked here, not by a validator: CLI11 gives a hidden option no name in its errors.
           if (shell != "bash" && shell != "zsh") throw CLI::ValidationError("--completion", shell + " not in {bash,zsh}");
           std::cout << completion_script(app, shell);
           throw CLI::Success();
         },
         "print a completion script for SHELL")
      ->group("");  // hidden: for the build, which installs what it prints
}

namespace {

// An option's names as typed ("--json", "-q", "--quiet").
std::vector<std::string> names_of(const CLI::Option& o) {
  std::vector<std::string> out;
  for (const auto& s : o.get_snames()) out.push_back("-" + s);
  for (const auto& l : o.get_lnames()) out.push_back("--" + l);
  return out;
}

// The options --help shows (not positionals, not the hidden ones).
std::vector<const CLI::Option*> shown_options(const CLI::App& app) {
  std::vector<const CLI::Option*> out;
  for (const CLI::Option* o : app.get_options()) {
    if (o->nonpositional() && !o->get_group().empty()) out.push_back(o);
  }
  return out;
}

std::string function_name(std::string name) {
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return "_" + name + "_complete";
}

// `text` inside a zsh single-quoted _arguments spec: quotes closed and reopened, and the
// characters _arguments gives a meaning ([ ] :) escaped.
std::string zsh_quoted(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\'') out += "'\\''";
    else if (c == '[' || c == ']' || c == ':') (out += '\\') += c;
    else out += c;
  }
  return out;
}

std::string bash_script(const CLI::App& app) {
  const std::string program = app.get_name(), fn = function_name(program);
  auto options = [](const CLI::App& a) {
    std::string w;
    for (const CLI::Option* o : shown_options(a)) {
      for (const std::string& n : names_of(*o)) w += (w.empty() ? "" : " ") + n;
    }
    return w;
  };
  const auto subs = app.get_subcommands([](const CLI::App*) { return true; });
  std::string pattern, names;
  for (const CLI::App* sub : subs) {
    pattern += (pattern.empty() ? "" : "|") + sub->get_name();
    names += (names.empty() ? "" : " ") + sub->get_name();
  }
  std::string out = "# bash completion for " + program + ", printed by `" + program + " --completion bash` from its option definitions\n";
  out += fn + "() {\n";
  out += "  local cur=${COMP_WORDS[COMP_CWORD]} sub= w opts subs\n";
  if (!subs.empty()) {
    out += "  for w in \"${COMP_WORDS[@]:1:COMP_CWORD-1}\"; do\n    case $w in " + pattern + ") sub=$w ;; esac\n  done\n";
  }
  out += "  case $sub in\n";
  for (const CLI::App* sub : subs) out += "    " + sub->get_name() + ") opts=\"" + options(*sub) + "\" subs= ;;\n";
  out += "    *) opts=\"" + options(app) + "\" subs=\"" + names + "\" ;;\n  esac\n";
  out += "  if [[ $cur == -* ]]; then\n    COMPREPLY=($(compgen -W \"$opts\" -- \"$cur\"))\n";
  out += "  else\n    COMPREPLY=($(compgen -W \"$subs\" -- \"$cur\") $(compgen -f -- \"$cur\"))\n  fi\n}\n";
  out += "complete -o filenames -o bashdefault -F " + fn + " " + program + "\n";
  return out;
}

std::string zsh_arguments(const CLI::App& app, const std::string& rest) {
  std::string out = "_arguments -s";
  for (const CLI::Option* o : shown_options(app)) {
    const std::vector<std::string> names = names_of(*o);
    const std::string desc = "[" + zsh_quoted(o->get_description()) + "]" + (o->get_items_expected_max() > 0 ? ":value:_files" : "");
    if (names.size() == 1) {
      out += " \\\n    '" + names[0] + desc + "'";
    } else {
      std::string group = "(";
      for (const std::string& n : names) group += (group.size() > 1 ? " " : "") + n;
      group += ")";
      out += " \\\n    '" + group + "'{" ;
      for (std::size_t i = 0; i < names.size(); ++i) out += (i ? "," : "") + names[i];
      out += "}'" + desc + "'";
    }
  }
  return out + " \\\n    " + rest + "\n";
}

std::string zsh_script(const CLI::App& app) {
  const std::string program = app.get_name();
  std::string out = "#compdef " + program + "\n# zsh completion for " + program + ", printed by `" + program +
                    " --completion zsh` from its option definitions\n";
  const auto subs = app.get_subcommands([](const CLI::App*) { return true; });
  if (subs.empty()) return out + zsh_arguments(app, "'*:file:_files'");
  std::string names, pattern;
  for (const CLI::App* sub : subs) {
    names += " '" + sub->get_name() + ":" + zsh_quoted(sub->get_description()) + "'";
    pattern += (pattern.empty() ? "" : "|") + sub->get_name();
  }
  out += "local -a subcommands\nsubcommands=(" + names + " )\n";
  out += "case ${words[(r)(" + pattern + ")]} in\n";
  for (const CLI::App* sub : subs) out += "  " + sub->get_name() + ")\n    " + zsh_arguments(*sub, "'*:file:_files'") + "    ;;\n";
  out += "  *)\n    " + zsh_arguments(app, "'1: :{_describe subcommand subcommands; _files}' '*:file:_files'") + "    ;;\nesac\n";
  return out;
}

}  // namespace

std::string completion_script(const CLI::App& app, std::string_view shell) {
  return shell == "zsh" ? zsh_script(app) : bash_script(app);
}

CLI::Option* no_default(CLI::Option* opt) { return opt->default_str(""); }

const char* format_named_by(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".safetensors") return "safetensors";
  if (ext == ".h5" || ext == ".hdf5") return "hdf5";
  if (ext == ".pt" || ext == ".pth" || ext == ".bin" || ext == ".ckpt") return "torch";
  return nullptr;
}

namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// What `typed` most likely meant among `names`: the nearest within two edits, if any.
std::optional<std::string> nearest(std::string_view typed, const std::vector<std::string>& names) {
  std::optional<std::string> best;
  std::size_t best_distance = 3;
  for (const std::string& n : names) {
    const std::size_t d = edit_distance(typed, n);
    if (d < best_distance) {
      best_distance = d;
      best = n;
    }
  }
  return best;
}

// The long options of `app` and its subcommands ("--dtype"), and its subcommands' names.
void names_of(const CLI::App& app, std::vector<std::string>& options, std::vector<std::string>& subcommands) {
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) options.push_back("--" + n);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    subcommands.push_back(sub->get_name());
    names_of(*sub, options, subcommands);
  }
}

// A suggestion for a mistyped option or subcommand among the arguments, or empty.
std::string suggestion(const CLI::App& app, int argc, const char* const* argv) {
  std::vector<std::string> options, subcommands;
  names_of(app, options, subcommands);
  std::error_code ec;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--") break;
    if (a.starts_with("--")) {
      a = a.substr(0, a.find('='));
      if (std::find(options.begin(), options.end(), a) != options.end()) continue;
      if (auto n = nearest(a, options)) return std::string(a) + " is not an option; did you mean " + *n + "?";
    } else if (i == 1 && !subcommands.empty() && std::find(subcommands.begin(), subcommands.end(), a) == subcommands.end() &&
               !std::filesystem::exists(std::filesystem::path(a), ec)) {  // a path is not a mistyped subcommand
      if (auto n = nearest(a, subcommands)) return "'" + std::string(a) + "' is not a subcommand; did you mean " + *n + "?";
    }
  }
  return {};
}

}  // namespace

std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::Success&) {  // --completion printed its script
    return 0;
  } catch (const CLI::ParseError& e) {
    // As every other error: "TOOL: error: ...", with what was most likely meant when an option
    // or a subcommand was mistyped.
    const std::string hint = suggestion(app, argc, argv);
    std::cerr << app.get_name() << ": error: " << (hint.empty() ? std::string(e.what()) : hint)
              << "\nRun with --help for more information.\n";
    return 2;
  }
  return std::nullopt;
}

std::uint64_t parse_byte_size(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) throw CLI::ValidationError("size", "'" + std::string(text) + "' is not a byte size (e.g. 512, 64MB, 1GiB)");
  const double number = std::stod(std::string(text.substr(0, i)));
  std::string unit(text.substr(i));
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "kB" || unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else if (unit == "KiB") mult = 1024.0;
  else if (unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB") mult = 1024.0 * 1024 * 1024 * 1024;
  else throw CLI::ValidationError("size", "unknown unit '" + unit + "' (use kB, MB, GB, KiB, MiB, GiB)");
  const double bytes = number * mult;
  if (!std::isfinite(bytes) || bytes >= 1.8e19) throw CLI::ValidationError("size", "'" + std::string(text) + "' is too large");
  return static_cast<std::uint64_t>(std::llround(bytes));
}

void add_write_flags(CLI::App& app, WriteFlags& f, const std::string& plan) {
  app.add_option("--include", f.include, "keep entries whose FQN matches GLOB (repeatable; filters apply in order)")->allow_extra_args(false);
  app.add_option("--exclude", f.exclude, "drop entries whose FQN matches GLOB (repeatable; filters apply in order)")->allow_extra_args(false);
  app.add_option("--rename", f.rename,
                 "rename output entries as sed's s/REGEX/REPLACEMENT/[g] does (repeatable, applied in order, after --strip-prefix)")
      ->allow_extra_args(false);
  app.add_option("--strip-prefix", f.strip_prefix, "remove PREFIX from the output names that start with it");
  app.add_flag("--dry-run", f.dry_run, "print the plan (" + plan + ") and write nothing");
  app.add_flag("-f,--force", f.force, "replace OUTPUT when it exists (a file, an empty directory or an output of the same kind only)");
  app.add_flag("--verify", f.verify, "check every CRC-32 the input records as the copy reads it; a mismatch fails, writing nothing");
  no_default(app.add_option("-j,--threads", f.threads, "threads to copy with (default: the machine's cores)"))->check(CLI::Range(1u, 1024u));
  app.add_flag("-q,--quiet", f.quiet, "print errors only: no progress bar, notes or list of what was written (--dry-run's plan and --json still print)");
  app.add_flag("--json", f.json, "print the result (or the plan) as one JSON object");
}

ckpt::EntryRenames renames_of(const WriteFlags& f) {
  try {
    return ckpt::EntryRenames(f.strip_prefix.empty() ? std::nullopt : std::optional<std::string>(f.strip_prefix), f.rename);
  } catch (const ckpt::Error& e) {
    throw CLI::ValidationError(e.what());
  }
}

std::optional<int> usage_errors(std::string_view program, const std::function<void()>& translate) {
  try {
    translate();
  } catch (const CLI::Error& e) {
    std::cerr << program << ": error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  } catch (const UsageError& e) {
    std::cerr << program << ": error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  }
  return std::nullopt;
}

unsigned test_hooks_from_environment() {
  if (const char* crash = std::getenv("FSDP_TEST_CRASH_AT")) ckpt::test_hooks::set_crash_point(crash);
  const char* delay = std::getenv("FSDP_TEST_COPY_DELAY_MS");
  return delay ? static_cast<unsigned>(std::atoi(delay)) : 0;
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::vector<std::string> float_dtype_names() {
  return {"bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float", "fp64", "float64", "double"};
}

ckpt::DType parse_float_dtype(std::string_view d) {
  if (d == "bf16" || d == "bfloat16") return ckpt::DType::kBFloat16;
  if (d == "fp16" || d == "float16" || d == "half") return ckpt::DType::kFloat16;
  if (d == "fp64" || d == "float64" || d == "double") return ckpt::DType::kFloat64;
  if (d == "fp32" || d == "float32" || d == "float") return ckpt::DType::kFloat32;
  throw CLI::ValidationError("--dtype", "'" + std::string(d) + "' is not bf16, fp16, fp32 or fp64");
}

std::vector<ckpt::EntryFilter> filters_in_order(int argc, const char* const* argv) {
  std::vector<ckpt::EntryFilter> out;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") break;
    for (const auto& [flag, include] : {std::pair{std::string_view("--include"), true}, std::pair{std::string_view("--exclude"), false}}) {
      if (a == flag && i + 1 < argc) {
        out.push_back({include, argv[++i]});
      } else if (a.size() > flag.size() && a.substr(0, flag.size()) == flag && a[flag.size()] == '=') {
        out.push_back({include, std::string(a.substr(flag.size() + 1))});
      }
    }
  }
  return out;
}

}  // namespace fsdp_tools
