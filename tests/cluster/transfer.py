"""Tiny TCP throughput probe for tests/cluster (run inside namespaces with ``ip netns exec``).

    transfer.py serve <bind addr> <port> <nbytes>   # prints "ready", receives nbytes, acks, exits
    transfer.py send <addr> <port> <nbytes>          # prints the seconds from connect to the ack
"""

import socket
import sys
import time


def serve(addr: str, port: int, nbytes: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    got = 0
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    conn.sendall(b"k")
    conn.close()
    print(got, flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    payload = b"\0" * nbytes
    for _ in range(200):
        try:
            conn = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            time.sleep(0.02)
    else:
        raise SystemExit(f"cannot connect to {addr}:{port}")
    t0 = time.perf_counter()
    conn.sendall(payload)
    assert conn.recv(1) == b"k"
    print(f"{time.perf_counter() - t0:.6f}", flush=True)


if __name__ == "__main__":
    mode, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    (serve if mode == "serve" else send)(addr, port, n)
