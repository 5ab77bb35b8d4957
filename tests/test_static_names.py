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


# The Communicator is one class over several files (comm/communicator.py and its parts); an
# attribute read on `self` in one of them that no part defines fails only when that line runs,
# and many of them run only on GPUs.
COMM_FILES = ("communicator.py", "callpath.py", "exchange.py", "routing.py", "p2p.py", "reductions.py", "ledger.py")
COMM_CLASSES = {"Communicator", "CallPath", "Exchange", "Routing", "PointToPoint", "Reductions", "Faults"}


def _self_attributes(sources: dict[str, str], classes: set[str]) -> dict[str, list[str]]:
    """{attribute: where it is read} for every `self.X` read in `classes` that none of them
    defines (a method, a class attribute, or an assignment to self.X anywhere in them)."""
    import ast
    defined, used = set(), {}
    for name, text in sources.items():
        for cls in (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name in classes):
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(item.name)
                elif isinstance(item, ast.Assign):
                    defined.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    defined.add(item.target.id)
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if isinstance(node.ctx, ast.Store):
                        defined.add(node.attr)
                    else:
                        used.setdefault(node.attr, []).append(f"{name}:{node.lineno}")
    return {k: v for k, v in used.items() if k not in defined}


def test_the_communicator_reads_no_attribute_it_never_defines():
    comm = os.path.join(SRC, "comm")
    sources = {f: open(os.path.join(comm, f)).read() for f in COMM_FILES}
    missing = _self_attributes(sources, COMM_CLASSES)
    assert missing == {}, "\n".join(f"self.{k}: read at {', '.join(v[:3])}" for k, v in sorted(missing.items()))


def test_the_attribute_check_sees_a_leftover():
    text = ("class CallPath:\n    def f(self):\n        self.kept = 1\n        return self.kept\n\n"
            "class Reductions:\n    def g(self):\n        if self.cuda_only:\n            return self._fast_ar\n        return self.f()\n")
    assert set(_self_attributes({"x.py": text}, {"CallPath", "Reductions"})) == {"cuda_only", "_fast_ar"}
