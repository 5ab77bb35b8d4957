"""Names the code uses but never defines. Much of braid runs only on GPUs (the GPU tier does not
run in CI), so a name left undefined there would otherwise first fail on a GPU machine: pyflakes
reads every module and reports such names without running them."""
from __future__ import annotations

import os

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "braid")
WRONG = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect:
    def __init__(self):
        self.found = []

    def flake(self, msg):
        if isinstance(msg, WRONG):
            self.found.append(f"{os.path.relpath(msg.filename, SRC)}:{msg.lineno}: {msg.message % msg.message_args}")

    def unexpectedError(self, filename, msg):      # noqa: N802 (pyflakes' reporter interface)
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):    # noqa: N802
        self.found.append(f"{filename}:{lineno}: {msg}")


def test_no_module_uses_a_name_it_never_defines():
    rep = _Collect()
    files = 0
    for root, _, names in os.walk(SRC):
        for n in names:
            if n.endswith(".py"):
                files += 1
                pyflakes_api.checkPath(os.path.join(root, n), rep)
    assert files > 50
    assert rep.found == [], "\n".join(rep.found)


def test_the_check_sees_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(t):\n    if t.is_cuda:\n        return (t.numel(), dt)\n")
    rep = _Collect()
    pyflakes_api.checkPath(str(bad), rep)
    assert len(rep.found) == 1 and "undefined name 'dt'" in rep.found[0]
