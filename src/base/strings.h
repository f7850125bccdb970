// Small text helpers shared by the parsers of sizes and options. Pure; thread-safe.
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace strata {

// `text` without leading and trailing white space.
inline std::string Trim(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return std::string(text.substr(begin, end - begin));
}

}  // namespace strata
