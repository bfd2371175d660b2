// SPDX-License-Identifier: Apache-2.0
#include "common/cli_common.hpp"

#include <cmath>
#include <iostream>

#include "fsdp_version.hpp"

namespace fsdp_tools {

std::string version_text(std::string_view program) {
  return std::string(program) + " " + FSDP_VERSION + " (" + FSDP_GIT_DESCRIBE + ")";
}

void setup_app(CLI::App& app, std::string_view program, std::string_view description) {
  app.description(std::string(description));
  app.footer("See " + std::string(program) + "(1).");
  app.set_version_flag("--version", version_text(program), "print the version and exit");
  app.get_formatter()->column_width(34);
}

std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
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

}  // namespace fsdp_tools
