"""docs/options.md is what `strata options --markdown` prints: the option table of src/config/options.cc."""
import difflib
import os
import pathlib
import subprocess

import pytest

import strata

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "options.md"
# build/python/strata/__init__.py -> build/bin/strata, as in test_checkpoint.py.
STRATA_BIN = pathlib.Path(strata.__file__).resolve().parents[2] / "bin" / "strata"
REGENERATE = "build/bin/strata options --markdown > docs/options.md"


def test_options_doc_is_the_option_table():
    if not STRATA_BIN.exists():
        pytest.skip(f"no strata CLI beside this strata package ({STRATA_BIN})")
    printed = subprocess.run([str(STRATA_BIN), "options", "--markdown"], capture_output=True, text=True,
                             check=True).stdout
    written = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    diff = "".join(difflib.unified_diff(written.splitlines(keepends=True), printed.splitlines(keepends=True),
                                        "docs/options.md", "strata options --markdown", n=0))
    assert printed == written, (f"docs/options.md differs from the option table in src/config/options.cc; "
                                f"regenerate it from the repository root with `{REGENERATE}`:\n{diff[:4000]}")


def test_every_key_the_engine_takes_is_on_the_page():
    text = DOC.read_text(encoding="utf-8")
    missing = [key for key in strata.option_keys() if f"| `{key}` |" not in text]
    assert not missing, f"keys missing from docs/options.md: {missing}; regenerate with `{REGENERATE}`"
