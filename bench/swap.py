"""SwapSpace's write and read rates against the raw disk's, side by side, and the checksum's cost.

    python bench/swap.py                                   # /tmp; 256 MiB, 1 and 2 GiB; four aio settings
    python bench/swap.py --dir /local_nvme --sizes 2048 --aio 1048576:8:1 262144:32:1 --csv out.csv

For each size: ``measure_disk`` (one file, 8 MiB ``O_DIRECT`` requests, 8 in flight) gives the raw sequential
write and read rates; then for each ``--aio`` setting (``block_size:queue_depth:intra_op_parallelism``) a ``SwapSpace``
holds the same bytes as ``--region-mib`` regions (the swapped tensors: fp32, random), which are all written (every
write issued, then all waited for) and all read back (likewise), and the read is checked bit-exact; the first
setting runs again with CRC-32C replaced by a constant, to time what the checksums cost end to end.

Rates are bytes moved / wall time, the best of ``--repeats`` runs of each, raw and SwapSpace alternated (a shared
disk's rate swings from run to run); "vs raw" is the SwapSpace rate over the raw rate of the same size. "CPU s/GiB"
is this process's CPU time (all threads) per GiB moved, the lowest of the runs: steadier than wall time on a shared
machine; "raw CPU s/GiB" is measure_disk's per GiB written or read (the kernel's share of any O_DIRECT transfer).
The second table times CRC-32C (``crc32c``, what SwapSpace uses), ``zlib.crc32`` and the host copy into a swap
buffer on one ``--check-mib`` buffer, against the median raw read rate of the first (the share of a read's time
each would cost if run serially).
The disk is described with ``lsblk`` and ``df``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crc32c  # noqa: E402

from zeropp.bench.report import progress, rows_table, write_csv  # noqa: E402
from zeropp.offload import AioSettings, SwapSpace, aligned_buffer, measure_disk  # noqa: E402

MIB = 1 << 20


def describe_disk(path: str) -> str:
    """``df -hT`` of ``path`` and ``lsblk``'s disks, as text."""
    out = []
    for command in (["df", "-hT", path], ["lsblk", "-d", "-o", "NAME,SIZE,ROTA,TYPE,MODEL"]):
        done = subprocess.run(command, capture_output=True, text=True)
        out.append(f"$ {' '.join(command)}\n{(done.stdout or done.stderr).rstrip()}")
    return "\n".join(out)


def best_rate(fn, nbytes: int, repeats: int = 3) -> float:
    """``nbytes`` / the fastest of ``repeats`` calls of ``fn``, in bytes per second."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def swap_rates(directory: str, total: int, region: int, config: AioSettings, buffer_count: int,
               buffer_size: int, checksums: bool = True) -> tuple[float, float, float, float, bool]:
    """Write rate, read rate (bytes/s), write and read CPU time (seconds of this process, all threads, per GiB) and
    O_DIRECT of a SwapSpace moving ``total`` bytes in ``region``-byte fp32 regions; ``checksums=False`` replaces
    CRC-32C by a constant (to time what checksumming costs end to end)."""
    sizes = [min(region, total - start) for start in range(0, total, region)]
    tensors = {f"r{i}": torch.randn(n // 4) for i, n in enumerate(sizes)}
    no_checksum = contextlib.nullcontext() if checksums else mock.patch.object(crc32c, "crc32c", lambda data: 0)
    regions = {k: t.nbytes for k, t in tensors.items()}
    with no_checksum, SwapSpace(directory, regions, aio=config, buffer_count=buffer_count,
                                buffer_size=buffer_size) as space:
        start, cpu = time.perf_counter(), time.process_time()
        for handle in [space.write(k, t) for k, t in tensors.items()]:
            handle.wait()
        write_s, write_cpu = time.perf_counter() - start, time.process_time() - cpu
        outs = {k: torch.zeros_like(t) for k, t in tensors.items()}  # touched: no page faults in the timing
        start, cpu = time.perf_counter(), time.process_time()
        for handle in [space.read(k, outs[k]) for k in tensors]:
            handle.wait()
        read_s, read_cpu = time.perf_counter() - start, time.process_time() - cpu
        if not all(torch.equal(outs[k], t) for k, t in tensors.items()):
            raise AssertionError("SwapSpace read back different data")
        moved = sum(t.nbytes for t in tensors.values())
        return moved / write_s, moved / read_s, write_cpu * 2**30 / moved, read_cpu * 2**30 / moved, space.direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp", help="directory on the disk to measure (default /tmp)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048], help="MiB moved per run")
    parser.add_argument("--aio", nargs="+", default=["1048576:8:1", "262144:32:1", "1048576:4:2", "4194304:8:1"],
                        help="block_size:queue_depth:intra_op_parallelism settings")
    parser.add_argument("--region-mib", type=int, default=64, help="MiB per swap region (tensor)")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--buffer-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternated; the best is shown")
    parser.add_argument("--check-mib", type=int, default=64, help="MiB per checksum and copy timing")
    parser.add_argument("--csv", help="also write the rows as CSV here")
    args = parser.parse_args()

    print(describe_disk(args.dir))
    print(f"\nload average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs\n")

    rows = []
    for size in args.sizes:
        for setting in args.aio:
            block, depth, threads = (int(x) for x in setting.split(":"))
            config = AioSettings(block_size=block, queue_depth=depth, intra_op_parallelism=threads)
            progress(f"{size} MiB, block {block}, queue depth {depth}, threads {threads}")
            checks = [True, False] if setting == args.aio[0] else [True]
            runs = []
            raw_cpu = float("inf")
            for _ in range(args.repeats):  # alternated, so that a load change hits them alike
                cpu = time.process_time()
                raw = measure_disk(args.dir, size * MIB)
                raw_cpu = min(raw_cpu, (time.process_time() - cpu) * 2**30 / (2 * size * MIB))
                runs.append((raw, [swap_rates(
                    args.dir, size * MIB, args.region_mib * MIB, config, args.buffer_count, args.buffer_mib * MIB,
                    check) for check in checks]))
            raw_write = max(raw.write_bytes_per_s for raw, _ in runs)
            raw_read = max(raw.read_bytes_per_s for raw, _ in runs)
            for i, check in enumerate(checks):
                write, read = max(s[i][0] for _, s in runs), max(s[i][1] for _, s in runs)
                write_cpu, read_cpu = min(s[i][2] for _, s in runs), min(s[i][3] for _, s in runs)
                rows.append({"MiB": size, "block_size": block, "queue_depth": depth, "intra_op_parallelism": threads,
                             "CRC-32C": "on" if check else "off (timing only)",
                             "O_DIRECT": all(raw.direct and s[i][4] for raw, s in runs),
                             "raw write MB/s": raw_write / 1e6, "swap write MB/s": write / 1e6,
                             "write vs raw": write / raw_write, "raw read MB/s": raw_read / 1e6,
                             "swap read MB/s": read / 1e6, "read vs raw": read / raw_read,
                             "raw CPU s/GiB": raw_cpu, "write CPU s/GiB": write_cpu, "read CPU s/GiB": read_cpu})
    columns = list(rows[0])
    print(rows_table(rows, columns, {c: ".0f" for c in columns if c.endswith("MB/s")}
                     | {c: ".2f" for c in columns if c.endswith(("vs raw", "CPU s/GiB"))}))
    print()
    check = args.check_mib * MIB
    data = aligned_buffer(check)
    data.copy_(torch.randint(0, 256, (check,), dtype=torch.uint8))
    view = memoryview(data.numpy())
    staging = aligned_buffer(check)
    disk = statistics.median(row["raw read MB/s"] for row in rows) * 1e6
    label = f"operation ({args.check_mib} MiB, one thread)"
    checks = [("crc32c.crc32c (SwapSpace)", best_rate(lambda: crc32c.crc32c(view), check)),
              ("zlib.crc32", best_rate(lambda: zlib.crc32(view), check)),
              ("host copy into a swap buffer", best_rate(lambda: staging.copy_(data), check))]
    print(rows_table([{label: name, "GB/s": rate / 1e9, "% of the disk's read time": 100 * disk / rate}
                      for name, rate in checks], [label, "GB/s", "% of the disk's read time"],
                     {"GB/s": ".2f", "% of the disk's read time": ".1f"}))
    print(f"(the disk's read rate there: {disk / 1e9:.3f} GB/s, the median raw read above)")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
