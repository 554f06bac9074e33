"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (a broken link or anchor, a
page left out of the nav, or an API reference to a name that no longer exists fails it), and the configuration page
names every key the config parser accepts and the troubleshooting page every exception class zeropp defines."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zeropp import config as zconfig
from zeropp.config import blocks, offload, optimizer, readers, scheduler, training

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings are not installed: pip install -e '.[docs]' (setup.sh does)")
def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "api" / "quant" / "index.html").is_file()


def accepted_keys(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every key name (the last part of its dotted name) that ``check_keys`` accepts or refuses by name while
    configs with every block and every optimizer and scheduler type are parsed."""
    seen: set[str] = set()
    real = readers.check_keys

    def recording(p, block, where, valid, unsupported=None):
        seen.update(valid)
        seen.update(unsupported or {})
        return real(p, block, where, valid, unsupported)

    for module in (blocks, offload, optimizer, scheduler, training):
        monkeypatch.setattr(module, "check_keys", recording)
    zero = {"stage": 3, "zeropp": {"memory_budget": {"cpu": 1}}, "offload_optimizer": {"device": "cpu"},
            "offload_param": {}}
    schedulers = {"WarmupLR": {}, "WarmupDecayLR": {"total_num_steps": 10}, "WarmupCosineLR": {"total_num_steps": 10},
                  "OneCycle": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}
    assert set(schedulers) == set(zconfig.SCHEDULER_TYPES)
    for opt in ("AdamW", "Adam", "SGD"):
        for kind, params in schedulers.items():
            zconfig.load_config({"train_batch_size": 2, "bf16": {}, "fp16": {}, "aio": {}, "zero_optimization": zero,
                                 "optimizer": {"type": opt, "params": {}},
                                 "scheduler": {"type": kind, "params": params}}, world_size=2)
    return seen


def test_configuration_page_names_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`([A-Za-z0-9_]+)`", page))
    keys = accepted_keys(monkeypatch)
    assert len(keys) > 100, sorted(keys)
    missing = sorted(keys - documented)
    assert not missing, f"docs/configuration.md does not name these config keys: {missing}"


def exception_classes() -> set[str]:
    """The public exception classes defined anywhere in zeropp (found in the source: a class whose base is an
    exception class, by name)."""
    bases: dict[str, set[str]] = {}
    for path in (ROOT / "zeropp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))}
                bases.setdefault(node.name, set()).update(names)
    found = {n for n, b in bases.items() if any(x.endswith(("Error", "Exception")) or x == "KeyboardInterrupt"
                                                for x in b)}
    while True:
        more = {n for n, b in bases.items() if b & found} - found
        if not more:
            return {n for n in found if not n.startswith("_")}
        found |= more


def test_troubleshooting_page_names_every_exception() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    classes = exception_classes()
    assert {"ConfigError", "CollectiveError", "OffloadError", "PlacementError"} <= classes, sorted(classes)
    missing = sorted(c for c in classes if f"`{c}`" not in page)
    assert not missing, f"docs/troubleshooting.md does not name these exception classes: {missing}"


def test_readme_commands_are_what_ci_runs() -> None:
    """The README's first lines are the two commands (demo, tests), and .ci/run runs the test command as written."""
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme[2] == "```bash", readme[:5]
    demo, tests = (line.split("#")[0].strip() for line in readme[3:5])
    assert demo == "./setup.sh && .venv/bin/python -m zeropp.bench.training --quick"
    assert tests == "./setup.sh && .venv/bin/python -m pytest -q -n 2"
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
