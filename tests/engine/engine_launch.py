"""``launch`` and ``launch_cases`` from tests/comm/comm_launch.py, for worker modules in tests/engine (added to the workers' path)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "comm"))

from comm_launch import launch as _launch
from comm_launch import launch_cases as _launch_cases

launch = functools.partial(_launch, worker_dirs=[HERE])
launch_cases = functools.partial(_launch_cases, worker_dirs=[HERE])
