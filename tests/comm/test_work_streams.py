"""``CollectiveWork``'s CUDA stream rule, checked on CPU with stand-ins for streams, events and CUDA tensors.

The real thing runs in ``test_comm_cuda.py`` (needs a GPU); this pins the bookkeeping on every machine: a ``wait()``
from another stream than the issuing one waits on the issuing stream's event and records the input, the output and
every temporary on the waiting stream *before* the collective's last step drops them; a ``wait()`` on the issuing
stream, a synchronous call and CPU tensors do nothing of the kind.
"""

from __future__ import annotations

import torch

from zeropp.comm import work as work_mod
from zeropp.comm.work import CollectiveWork, run


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.device = torch.device("cuda", 0)
        self.log: list[tuple[str, object]] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", event.stream))

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", other))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream


class FakeCudaTensor:
    """What ``CollectiveWork`` uses of a tensor: ``is_cuda``, ``device``, ``record_stream``."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, name: str, freed: list[str]) -> None:
        self.name = name
        self.recorded: list[FakeStream] = []
        self._freed = freed

    def record_stream(self, stream: FakeStream) -> None:
        assert self.name not in self._freed, f"{self.name} recorded after it was freed"
        self.recorded.append(stream)


class FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(self.name)


def _patch(monkeypatch, current: list[FakeStream]) -> None:
    monkeypatch.setattr(work_mod.torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(work_mod.torch.cuda, "Event", FakeEvent)


def _two_hop(log: list[str], freed: list[str], temps: dict[str, FakeCudaTensor], out: FakeCudaTensor):
    """A collective shaped like qgZ: hop 1 in flight at return; hop 2 issued inside wait(); temporaries freed at
    the end (the generator's locals go when it finishes)."""
    yield FakeWork(log, "hop1"), (temps["send"], temps["recv"], None), " at hop 1"
    yield FakeWork(log, "hop2"), (temps["mid"],), " at hop 2"
    freed.extend(temps)
    return out


def _setup(monkeypatch):
    issuing, side = FakeStream("issuing"), FakeStream("side")
    current = [issuing]
    _patch(monkeypatch, current)
    log: list[str] = []
    freed: list[str] = []
    temps = {n: FakeCudaTensor(n, freed) for n in ("send", "recv", "mid")}
    inp, out = FakeCudaTensor("input", freed), FakeCudaTensor("out", freed)
    return issuing, side, current, log, freed, temps, inp, out


def test_wait_from_another_stream_orders_and_records_everything(monkeypatch):
    issuing, side, current, log, freed, temps, inp, out = _setup(monkeypatch)
    work = CollectiveWork(_two_hop(log, freed, temps, out), (inp, out))
    assert log == [] and not work.is_completed()
    current[0] = side
    assert work.wait() is out
    assert log == ["hop1", "hop2"] and work.is_completed()
    assert side.log == [("wait_event", issuing)]  # the side stream waits on the issuing stream's event
    for t in (inp, out, *temps.values()):
        assert t.recorded == [side], t.name
    # a second wait() from the side stream: nothing more; from a third stream: it waits on the side stream
    assert work.wait() is out and side.log == [("wait_event", issuing)]
    third = FakeStream("third")
    current[0] = third
    assert work.wait() is out
    assert third.log == [("wait_stream", side)] and out.recorded == [side, third]


def test_wait_on_the_issuing_stream_records_nothing(monkeypatch):
    issuing, side, current, log, freed, temps, inp, out = _setup(monkeypatch)
    work = CollectiveWork(_two_hop(log, freed, temps, out), (inp, out))
    assert work.wait() is out and log == ["hop1", "hop2"]
    assert issuing.log == [] and all(not t.recorded for t in (inp, out, *temps.values()))
    # a later wait() from another stream makes it wait on the issuing stream, where the result was finished
    current[0] = side
    assert work.wait() is out and side.log == [("wait_stream", issuing)] and out.recorded == [side]


def test_synchronous_calls_and_cpu_tensors_skip_the_streams(monkeypatch):
    issuing, side, current, log, freed, temps, inp, out = _setup(monkeypatch)

    def boom(*_a, **_k):
        raise AssertionError("no stream bookkeeping expected")

    monkeypatch.setattr(work_mod.torch.cuda, "Event", boom)
    current[0] = side  # even with another current stream: a synchronous call waits where it issued
    assert run(_two_hop(log, freed, temps, out), async_op=False, tensors=(inp, out)) is out
    assert all(not t.recorded for t in (inp, out, *temps.values()))
    monkeypatch.setattr(work_mod.torch.cuda, "current_stream", boom)
    cpu_in, cpu_out = torch.zeros(3), torch.ones(3)

    def steps():
        yield FakeWork(log, "cpu"), (torch.zeros(2),), ""
        return cpu_out

    handle = run(steps(), async_op=True, tensors=(cpu_in, cpu_out))
    assert handle.wait() is cpu_out


def test_no_communication_still_orders_the_waiting_stream(monkeypatch):
    # e.g. one rank: the result is written on the issuing stream when the call returns
    issuing, side, current, log, freed, temps, inp, out = _setup(monkeypatch)

    def local():
        return out
        yield  # a generator with no communication

    work = CollectiveWork(local(), (inp, out))
    assert work.is_completed()
    current[0] = side
    assert work.wait() is out
    assert side.log == [("wait_event", issuing)] and out.recorded == [side] and inp.recorded == [side]
