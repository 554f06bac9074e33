"""Workers for test_checkpoint_fixture.py, run on every rank of 4 by ``engine_launch.launch``: load the committed
checkpoint ``fixtures/checkpoint_v2`` (written by an earlier zeropp, ``fixtures/make_checkpoint_fixture.py``) at
world sizes 4, 2 and 1 and return what each load restored, read back with the fixture script's own helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fixtures"))

import make_checkpoint_fixture as fixture  # noqa: E402

import zeropp  # noqa: E402

FIXTURE = HERE / "fixtures" / "checkpoint_v2"


def restored(engine, tag: str | None) -> dict:
    """Load ``tag`` of the fixture (``latest`` when ``None``) into ``engine``; what it then holds, ``expected.pt``'s
    layout (``draws`` this rank's only)."""
    path, client = engine.load_checkpoint(FIXTURE, tag=tag)
    return {"path": path.name, "client_state": client, "module": engine.consolidated_state_dict(),
            "optim": fixture.whole_optimizer_state(engine), "engine": fixture.engine_values(engine),
            "draws": fixture.draws()}


def loads(rank: int, world: int, resave: str) -> dict:
    """World 4: ``latest``. World 2 (ranks 0 and 1, a subgroup): ``latest`` and ``global_step2``, then a save of
    the loaded ``latest`` state with this code to ``resave`` (tag ``global_step3``). World 1 (rank 0): ``latest``.
    Each from a freshly built engine of another seed."""
    out = {"world4": restored(fixture.make_engine(seed=1), None)}
    # Every rank creates each group, but only its members register it, and torch names a group that only its
    # members create (zeropp's) by the number of groups a rank registered: so the pair's engines come before the
    # group only rank 0 registers.
    pair = torch.distributed.new_group([0, 1])
    if rank < 2:
        topology = zeropp.comm.Topology(group=pair)
        out["world2"] = restored(fixture.make_engine(seed=2, topology=topology), None)
        engine = fixture.make_engine(seed=3, topology=topology)
        out["world2_step2"] = restored(engine, "global_step2")
        engine.load_checkpoint(FIXTURE)
        engine.save_checkpoint(resave, tag="global_step3", client_state={"tag": "global_step3", "note": "fixture"})
    alone = torch.distributed.new_group([0])
    if rank == 0:
        out["world1"] = restored(fixture.make_engine(seed=4, topology=zeropp.comm.Topology(group=alone)), None)
    torch.distributed.barrier()
    return out
