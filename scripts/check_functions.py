#!/usr/bin/env python3
"""Fails on a function longer than 80 lines outside the tests.

The rule is docs/design.md's "Rules for the code": no function over 80 lines in
the library, the binding, the tools, the benchmarks, the scripts and the
examples. A function's lines are its length as lizard counts it: from the line
of its name to the line of its closing brace (or, in Python, its last
statement), comments and blank lines included: the lines a reader has to hold.
The fix for a long function is named helpers that each do one step.

    .venv/bin/python scripts/check_functions.py [--root DIR] [--max-lines N]

Prints one line per offending function (file:line: name, length) and exits 1,
or prints a one-line summary and exits 0. Needs lizard (python/requirements.txt;
scripts/venv.sh installs it into .venv).
"""
import argparse
import pathlib
import sys

try:
    import lizard
except ImportError:
    sys.exit("check_functions: lizard is not installed: run scripts/venv.sh and use .venv/bin/python")

MAX_LINES = 80

# Every folder holding sources that are not tests.
ROOTS = [
    "include", "src", "memory", "offload", "optim", "tools", "benchmarks",
    "python/src", "python/strata", "scripts", "examples",
]
SUFFIXES = {".h", ".cc", ".cu", ".cuh", ".py"}
# lizard has no reader for CUDA files; their host and device code is C++.
CUDA_SUFFIXES = {".cu", ".cuh"}


def sources(root):
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES:
                yield path


def long_functions(root, max_lines):
    analyzer = lizard.FileAnalyzer(lizard.get_extensions([]))
    for path in sources(root):
        name_for_reader = str(path.with_suffix(".cc")) if path.suffix in CUDA_SUFFIXES else str(path)
        info = analyzer.analyze_source_code(name_for_reader, path.read_text(encoding="utf-8"))
        for function in info.function_list:
            if function.length > max_lines:
                yield path.relative_to(root), function


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent)
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args()
    offenders = list(long_functions(args.root, args.max_lines))
    for path, function in offenders:
        print(f"{path}:{function.start_line}: {function.long_name.split('(')[0]} is {function.length} lines "
              f"(at most {args.max_lines}: split it into named steps)")
    if offenders:
        print(f"check_functions: {len(offenders)} function(s) over {args.max_lines} lines; the rule is "
              f"docs/design.md, \"Rules for the code\"", file=sys.stderr)
        return 1
    print(f"check_functions: every function in {', '.join(ROOTS)} is at most {args.max_lines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
