"""Pins each private torch use in ``zeropp/_torch_internals.py`` to values set through torch's public API, so that a
torch upgrade that moves or changes one fails here (run in a child process: it initializes torch.distributed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from zeropp._torch_internals import group_timeout

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=1234.5))
assert group_timeout(dist.group.WORLD) == timedelta(seconds=1234.5), group_timeout(dist.group.WORLD)
assert group_timeout(dist.new_group([0], timeout=timedelta(seconds=77))) == timedelta(seconds=77)
# what the Topology docstring says torch's new_group gives without a timeout: the backend's default, not the world's
assert group_timeout(dist.new_group([0])) == dist.default_pg_timeout == timedelta(minutes=30)
both = dist.new_group([0], backend="cpu:gloo,cuda:gloo", timeout=timedelta(seconds=5))  # several backends, one value
assert group_timeout(both) == timedelta(seconds=5), group_timeout(both)
dist.destroy_process_group()
print("ok")
"""


def test_group_timeout_reads_the_timeout_given_to_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
