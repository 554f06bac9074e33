"""zeropp.offload: SwapSpace round trips, ordering, the buffer bound, the preflight and every storage fault.

Faults are real where this machine allows it: files are truncated, deleted and changed on disk; "full" is a small
tmpfs filled by another file (needs root to mount; skipped, naming that, elsewhere) and, everywhere, a file-size
limit (RLIMIT_FSIZE) in a subprocess; "read-only" is a tmpfs mounted read-only as root, else a directory without
write permission. The device error (EIO) and a filesystem refusing O_DIRECT are simulated by making ``os`` calls in
``zeropp.offload.aio`` raise what the kernel would.
"""

import errno
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zeropp.offload import ALIGNMENT, AioSettings, SwapError, SwapSpace, aligned_buffer, measure_disk
from zeropp.offload import aio

BLOCK = 8192
SMALL = dict(aio=AioSettings(block_size=BLOCK, queue_depth=3, intra_op_parallelism=2), buffer_count=3,
             buffer_size=3 * BLOCK)


def random_tensor(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads and infinities included for floats)."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def mount_tmpfs(path: str, options: str) -> None:
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"needs permission to mount a tmpfs (root): mount -o {options} failed: {done.stderr.strip()}")


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of the given options under ``tmp_path``; unmounted after the test."""
    mounted = []

    def make(options: str) -> str:
        path = str(tmp_path / f"mnt{len(mounted)}")
        mount_tmpfs(path, options)
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", path], check=True)


def test_crc32c_matches_the_bitwise_definition(gen):
    import crc32c

    data = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    assert crc32c.crc32c(data) == crc32c_reference(data)


def test_aligned_buffer_is_aligned_and_sized():
    for nbytes in (1, ALIGNMENT, 3 * ALIGNMENT + 17):
        buffer = aligned_buffer(nbytes)
        assert buffer.data_ptr() % ALIGNMENT == 0
        assert buffer.numel() % ALIGNMENT == 0 and nbytes <= buffer.numel() < nbytes + ALIGNMENT


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_is_bit_exact_and_the_file_holds_the_bytes(tmp_path, gen, dtype, direct):
    numels = {"one": 1, "odd": 3 * BLOCK + 7, "multi.chunk/0": 10 * BLOCK + 5}
    tensors = {k: random_tensor(n, dtype, gen) for k, n in numels.items()}
    with SwapSpace(tmp_path, {k: t.nbytes for k, t in tensors.items()}, direct=direct, **SMALL) as space:
        assert space.direct == (direct is None)  # /tmp of this machine and CI accept O_DIRECT
        for handle in [space.write(k, t) for k, t in tensors.items()]:
            handle.wait()
        outs = {k: torch.empty_like(t) for k, t in tensors.items()}
        for handle in [space.read(k, outs[k]) for k in tensors]:
            handle.wait()
        for key, tensor in tensors.items():
            assert same_bits(outs[key], tensor)
            with open(space.path(key), "rb") as file:
                on_disk = file.read()
            assert len(on_disk) == -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
            assert on_disk[:tensor.nbytes] == tensor.view(torch.uint8).numpy().tobytes()
            assert on_disk[tensor.nbytes:] == bytes(len(on_disk) - tensor.nbytes)


def test_many_overlapping_transfers_keep_per_key_order(tmp_path, gen):
    sizes = {f"k{i}": int(torch.randint(1, 6 * BLOCK, (), generator=gen)) for i in range(12)}
    first = {k: random_tensor(n, torch.uint8, gen) for k, n in sizes.items()}
    second = {k: random_tensor(n, torch.uint8, gen) for k, n in sizes.items()}
    seen_first = {k: torch.empty_like(t) for k, t in first.items()}
    seen_second = {k: torch.empty_like(t) for k, t in first.items()}
    with SwapSpace(tmp_path, sizes, **SMALL) as space:
        handles = []
        for key in sizes:  # nothing waited for: every transfer is queued behind the others
            handles += [space.write(key, first[key]), space.read(key, seen_first[key]),
                        space.write(key, second[key]), space.read(key, seen_second[key])]
        for handle in handles:
            handle.wait()
        assert all(h.done() for h in handles)
        for key in sizes:
            assert same_bits(seen_first[key], first[key]) and same_bits(seen_second[key], second[key])
        assert space.peak_buffers_in_use <= 3


@pytest.mark.parametrize("buffer_count", [1, 2])
def test_buffer_pool_bounds_the_buffers_in_flight(tmp_path, gen, buffer_count):
    tensors = {f"k{i}": random_tensor(7 * BLOCK + 3, torch.uint8, gen) for i in range(6)}
    with SwapSpace(tmp_path, {k: t.nbytes for k, t in tensors.items()}, aio=AioSettings(block_size=BLOCK),
                   buffer_count=buffer_count, buffer_size=2 * BLOCK) as space:
        for handle in [space.write(k, t) for k, t in tensors.items()]:
            handle.wait()
        outs = {k: torch.empty_like(t) for k, t in tensors.items()}
        for handle in [space.read(k, outs[k]) for k in tensors]:
            handle.wait()
        assert space.peak_buffers_in_use == buffer_count  # used them all, never more
        assert all(same_bits(outs[k], t) for k, t in tensors.items())


def test_buffer_size_is_cut_to_the_largest_region_and_pinned_only_with_cuda(tmp_path):
    with SwapSpace(tmp_path, {"a": 100, "b": ALIGNMENT + 1}, buffer_size=64 << 20, pin_memory=True) as space:
        assert space.buffer_size == 2 * ALIGNMENT
        assert space.pinned == torch.cuda.is_available()


def test_close_removes_everything_and_two_spaces_do_not_collide(tmp_path, gen):
    a_data, b_data = random_tensor(5000, torch.float32, gen), random_tensor(5000, torch.float32, gen)
    a = SwapSpace(tmp_path, {"w": a_data.nbytes}, rank=0, **SMALL)
    b = SwapSpace(tmp_path, {"w": b_data.nbytes}, rank=0, **SMALL)
    assert a.directory != b.directory and os.path.dirname(a.directory) == str(tmp_path / "zeropp-swap")
    a.write("w", a_data).wait()
    b.write("w", b_data).wait()
    out_a, out_b = torch.empty_like(a_data), torch.empty_like(b_data)
    a.read("w", out_a).wait()
    b.read("w", out_b).wait()
    assert same_bits(out_a, a_data) and same_bits(out_b, b_data)
    a.close()
    assert not os.path.exists(a.directory) and os.path.exists(b.path("w"))
    b.close()
    b.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="is closed"):
        b.write("w", b_data)


def test_close_refuses_to_delete_foreign_files(tmp_path):
    space = SwapSpace(tmp_path, {"w": 10})
    foreign = os.path.join(space.directory, "notes.txt")
    open(foreign, "w").close()
    with pytest.raises(SwapError, match=r"holds files zeropp did not make: \['notes.txt'\]; delete them"):
        space.close()
    assert os.listdir(space.directory) == ["notes.txt"]


def test_the_same_run_id_and_rank_twice_is_refused(tmp_path):
    with SwapSpace(tmp_path, {"w": 10}, run_id="run", rank=3) as space:
        assert space.directory == str(tmp_path / "zeropp-swap" / "run-rank3")
        with pytest.raises(ValueError, match="run-rank3.*exists"):
            SwapSpace(tmp_path, {"w": 10}, run_id="run", rank=3)


def test_misuse_is_refused(tmp_path):
    with SwapSpace(tmp_path, {"w": 40}) as space:
        with pytest.raises(ValueError, match="never written"):
            space.read("w", torch.empty(10))
        with pytest.raises(ValueError, match="has 44 bytes, the region 40"):
            space.write("w", torch.empty(11))
        with pytest.raises(ValueError, match="not contiguous"):
            space.write("w", torch.empty(10, 2)[:, 0])
        with pytest.raises(KeyError, match="no swap region 'x'"):
            space.write("x", torch.empty(10))
        space.write("w", torch.zeros(10))
        with pytest.raises(ValueError, match="holds torch.float32 data"):
            space.read("w", torch.empty(10, dtype=torch.int32))
    for bad in ({}, {"w": 0}):
        with pytest.raises(ValueError):
            SwapSpace(tmp_path, bad)
    with pytest.raises(ValueError, match="block_size=1000"):
        AioSettings(block_size=1000)


KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_preflight_missing_and_not_a_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(SwapError, match=f"{KEY}='{missing}' does not exist. Fix: create it"):
        SwapSpace(missing, {"w": 10}, config_key=KEY)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SwapError, match=f"{KEY}='{file}' is not a directory"):
        SwapSpace(file, {"w": 10}, config_key=KEY)


def test_preflight_read_only(tmp_path, small_tmpfs):
    if os.geteuid() == 0:  # root writes through permissions: a read-only filesystem it is
        path = small_tmpfs("ro,size=1m")
    else:
        path = str(tmp_path / "ro")
        os.mkdir(path, 0o500)
    with pytest.raises(SwapError, match=f"{KEY}='{path}' is not writable: creating a file there failed"):
        SwapSpace(path, {"w": 10}, config_key=KEY)
    assert os.listdir(path) == []


def test_preflight_too_little_free_space(tmp_path):
    stat = os.statvfs(tmp_path)
    free = stat.f_bavail * stat.f_frsize
    needed = -(-(free + (1 << 30)) // ALIGNMENT) * ALIGNMENT
    with pytest.raises(SwapError, match=rf"{KEY}='{tmp_path}' has \d+ bytes .* free but this rank's swap regions "
                                        rf"need {needed} bytes"):
        SwapSpace(tmp_path, {"w": needed}, config_key=KEY)
    assert os.listdir(tmp_path) == []


def test_filesystem_full_while_writing(small_tmpfs, gen):
    path = small_tmpfs("size=1m")
    data = random_tensor(256 << 10, torch.uint8, gen)
    with SwapSpace(path, {"w": data.nbytes}, aio=AioSettings(block_size=64 << 10)) as space:
        with open(os.path.join(path, "filler"), "wb") as filler:  # another program fills the disk
            with pytest.raises(OSError) as full:
                while True:
                    filler.write(bytes(64 << 10))
                    filler.flush()
            assert full.value.errno == errno.ENOSPC
        with pytest.raises(SwapError, match=rf"write of \d+ bytes at offset \d+ of '{space.path('w')}' failed: the "
                                            r"filesystem is full .* Fix: free space"):
            space.write("w", data).wait()
        with pytest.raises(SwapError, match="its last write failed: write of"):
            space.read("w", torch.empty_like(data)).wait()
        os.unlink(os.path.join(path, "filler"))
        space.write("w", data).wait()  # the region is usable again once rewritten
        out = torch.empty_like(data)
        space.read("w", out).wait()
        assert same_bits(out, data)


def test_file_size_limit_while_writing(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from zeropp.offload import AioSettings, SwapError, SwapSpace
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        space = SwapSpace({str(tmp_path)!r}, {{"w": 1 << 20}}, aio=AioSettings(block_size=1 << 16))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, resource.RLIM_INFINITY))
        try:
            space.write("w", torch.ones(1 << 20, dtype=torch.uint8)).wait()
        except SwapError as error:
            print(error)
        space.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "failed: the file would exceed the largest file size allowed" in done.stdout
    where = re.search(r"write of \d+ bytes at offset (\d+) of '(.*)' failed", done.stdout)
    assert where and where[2].endswith("-rank0/00000-w.swap") and int(where[1]) >= 1 << 18  # pieces run in parallel
    assert os.listdir(tmp_path) == []


@pytest.fixture
def written(tmp_path, gen):
    """A swap space with region ``w`` (several pieces; the last one short) written, and the data."""
    data = random_tensor(5 * BLOCK + 100, torch.float32, gen)
    with SwapSpace(tmp_path, {"w": data.nbytes}, **SMALL) as space:
        space.write("w", data).wait()
        yield space, data


def test_corrupted_byte_is_caught_with_its_range(written, gen):
    space, data = written
    at = int(torch.randint(0, data.nbytes, (), generator=gen))
    with open(space.path("w"), "r+b") as file:
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ 0x10]))
        file.flush()
        os.fsync(file.fileno())
    start = at // BLOCK * BLOCK
    end = min(start + BLOCK, data.nbytes)
    with pytest.raises(SwapError, match=rf"bytes \[{start}, {end}\) of '{space.path('w')}' do not match the "
                                        r"CRC-32C recorded"):
        space.read("w", torch.empty_like(data)).wait()
    space.write("w", data).wait()  # rewritten, it reads back again
    out = torch.empty_like(data)
    space.read("w", out).wait()
    assert same_bits(out, data)


def test_read_range_reads_any_part_and_checks_what_it_touches(written, gen):
    """``read_range`` returns exactly the asked elements (ranges inside one piece, across pieces and chunks, the
    region's ends), waits for a write called before it, and catches a corrupted byte in a piece it touches but not
    one outside."""
    space, data = written
    n = data.numel()
    ranges = [(0, n), (0, 1), (n - 1, n), (BLOCK // 4 - 3, BLOCK // 4 + 5), (7, 3 * BLOCK // 4 + 11)]
    ranges += [tuple(sorted(int(x) for x in torch.randint(0, n + 1, (2,), generator=gen))) for _ in range(4)]
    for a, b in ranges:
        out = torch.empty(b - a, dtype=data.dtype)
        space.read_range("w", 4 * a, out)
        assert same_bits(out, data[a:b]), (a, b)
    newer = random_tensor(n, torch.float32, gen)
    space.write("w", newer)  # not waited for: read_range waits for it
    out = torch.empty(100, dtype=torch.float32)
    space.read_range("w", 4 * (n - 100), out)
    assert same_bits(out, newer[n - 100:])
    with open(space.path("w"), "r+b") as file:  # corrupt the first piece
        file.seek(5)
        byte = file.read(1)[0]
        file.seek(5)
        file.write(bytes([byte ^ 0x01]))
    space.read_range("w", BLOCK, torch.empty(10, dtype=torch.float32))  # the second piece is intact
    with pytest.raises(SwapError, match=r"bytes \[0, \d+\) of .* do not match the CRC-32C recorded"):
        space.read_range("w", 0, torch.empty(10, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"outside the region's"):
        space.read_range("w", 4 * n - 4, torch.empty(2, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"dtype torch.float32"):
        space.read_range("w", 0, torch.empty(2, dtype=torch.int32))


def test_truncated_file_is_a_short_read(written):
    space, data = written
    os.truncate(space.path("w"), 2 * BLOCK + ALIGNMENT)
    with pytest.raises(SwapError, match=rf"offset \d+ of '{space.path('w')}' failed: short read, the file ends at "
                                        rf"byte {2 * BLOCK + ALIGNMENT} .* truncated"):
        space.read("w", torch.empty_like(data)).wait()


def test_deleted_file(written):
    space, data = written
    os.unlink(space.path("w"))
    with pytest.raises(SwapError, match=rf"open for reading of '{space.path('w')}' failed: the file was deleted"):
        space.read("w", torch.empty_like(data)).wait()
    with pytest.raises(SwapError, match="the file was deleted"):
        space.write("w", data).wait()


def test_device_error_simulated(written, monkeypatch):
    space, data = written

    def eio(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(aio.os, "preadv", eio)
    with pytest.raises(SwapError, match=rf"read of \d+ bytes at offset \d+ of '{space.path('w')}' failed: the "
                                        r"device reported an I/O error\. Fix: check the disk"):
        space.read("w", torch.empty_like(data)).wait()


def test_o_direct_refused_falls_back_to_buffered_io_once(tmp_path, gen, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(aio.os, "open", refuse_direct)
    monkeypatch.setattr(aio, "_warned_devices", set())
    data = random_tensor(3 * BLOCK + 1, torch.bfloat16, gen)
    with pytest.warns(RuntimeWarning, match="buffered I/O under .*the filesystem refused O_DIRECT"):
        space = SwapSpace(tmp_path, {"w": data.nbytes}, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SwapSpace(tmp_path, {"w": 10}).close()  # the same filesystem: no second warning
    with space:
        assert not space.direct
        space.write("w", data).wait()
        out = torch.empty_like(data)
        space.read("w", out).wait()
        assert same_bits(out, data)
    with pytest.raises(SwapError, match="direct=True but the filesystem refused O_DIRECT"):
        SwapSpace(tmp_path, {"w": 10}, direct=True)
    assert os.listdir(tmp_path) == []


def test_measure_disk_removes_its_file(tmp_path):
    rates = measure_disk(str(tmp_path), 1 << 20, request_bytes=1 << 18, in_flight=2)
    assert rates.write_bytes_per_s > 0 and rates.read_bytes_per_s > 0 and rates.direct
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned buffers, GPU tensors)")
def test_cuda_tensors_round_trip_through_pinned_buffers(tmp_path, gen):
    data = random_tensor(4 * BLOCK + 3, torch.bfloat16, gen).cuda()
    with SwapSpace(tmp_path, {"w": data.nbytes}, pin_memory=True, **SMALL) as space:
        assert space.pinned
        space.write("w", data * 1).wait()  # a tensor a kernel is still writing on the current stream
        out = torch.empty_like(data)
        space.read("w", out).wait()
        assert same_bits(out, data)


def test_the_config_alignment_is_the_swap_alignment() -> None:
    """``zeropp.config`` checks ``aio.block_size`` against its own copy of the O_DIRECT unit (the config layer imports
    nothing of zeropp's): it must be this module's."""
    from zeropp.config.offload import DIRECT_IO_ALIGNMENT
    from zeropp.offload import ALIGNMENT

    assert DIRECT_IO_ALIGNMENT == ALIGNMENT
