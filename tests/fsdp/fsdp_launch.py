"""``launch`` from tests/comm/comm_launch.py, for worker modules in tests/fsdp (added to the workers' path)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "comm"))

from comm_launch import launch as _launch


def launch(target: str, world_size: int, tmp_path: Path, *, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``target`` (``"module:function"``, the module in tests/fsdp) on ``world_size`` gloo ranks."""
    env = dict(env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))]))
    return _launch(target, world_size, tmp_path, env=env, **kwargs)
