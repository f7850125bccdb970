// strata options [--config FILE] [--set key=value]... | --markdown
#include <cstdio>
#include <memory>
#include <string>

#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct OptionsFlags {
  CommonFlags common;
  bool markdown = false;
};

int PrintValues(const CommonFlags& flags) {
  Result<Options> options = LoadOptions(flags);
  if (!options.ok()) return Fail(options.status());
  auto values = DescribeOptions(*options);
  const auto& docs = OptionDocs();
  std::printf("%-32s %-12s %-12s %s\n", "key", "value", "default", "meaning");
  for (size_t i = 0; i < docs.size(); ++i) {
    std::printf("%-32s %-12s %-12s %s\n", docs[i].key.c_str(), values[i].second.c_str(),
                docs[i].default_value.c_str(), docs[i].description.c_str());
  }
  return 0;
}

// A table cell: a '|' in the text would end the cell.
std::string Cell(const std::string& text) {
  std::string cell;
  for (char c : text) {
    if (c == '|') cell += '\\';
    cell += c;
  }
  return cell;
}

// docs/options.md: the option table as a page of the docs. A test compares the
// file with this output (python/tests/test_options_doc.py), so the page cannot
// drift from OptionDocs(); what it says is written here, once.
int PrintMarkdown() {
  std::printf(
      "# strata — options\n"
      "\n"
      "<!-- Generated from the option table (src/config/options.cc): "
      "build/bin/strata options --markdown > docs/options.md -->\n"
      "\n"
      "Every key the engine takes, with its default and meaning, in the order of the option table in\n"
      "`src/config/options.cc`; this page is printed by `strata options --markdown`, and a test fails\n"
      "when the two differ. The same keys are what JSON files, `--set key=value`, `strata::SetOption`\n"
      "and the Python config take. JSON may nest (`{\"device\": {\"budget\": \"2GiB\"}}`) or use dotted\n"
      "keys (`{\"device.budget\": \"2GiB\"}`); a list is a JSON list or, with `--set`, comma-separated.\n"
      "Sizes take bytes or suffixes (`4096`, `64MiB`, `1.5GiB`, `2GB`); GB/s is 10^9 bytes/s. An unknown\n"
      "key or a bad value is an `InvalidArgument` error (in Python a `ValueError`) naming the key, the\n"
      "value and what is allowed. `strata options [--config FILE] [--set key=value]...` prints the\n"
      "values in effect. The Python adapter's own keys (`gradient_accumulation_steps`,\n"
      "`accumulation`, ...) are in [usage.md](usage.md#configuration).\n"
      "\n"
      "| key | type | default | meaning |\n"
      "|---|---|---|---|\n");
  for (const OptionDoc& doc : OptionDocs()) {
    const std::string default_value = doc.default_value.empty() ? "empty" : "`" + Cell(doc.default_value) + "`";
    std::printf("| `%s` | %s | %s | %s |\n", doc.key.c_str(), Cell(doc.type).c_str(), default_value.c_str(),
                Cell(doc.description).c_str());
  }
  return 0;
}

}  // namespace

Command AddOptionsCommand(CLI::App& parent) {
  auto flags = std::make_shared<OptionsFlags>();
  CLI::App* command = parent.add_subcommand("options", "print every option with its value, default and meaning");
  AddCommonFlags(command, flags->common);
  command
      ->add_flag("--markdown", flags->markdown,
                 "print the option table as docs/options.md (keys, defaults and meanings; no values)")
      ->excludes(command->get_option("--config"))
      ->excludes(command->get_option("--set"));
  return {command, [flags] { return flags->markdown ? PrintMarkdown() : PrintValues(flags->common); }};
}

}  // namespace strata::cli
