"""Userspace delay/loss link: the stand-in for ``netem`` on kernels without it.

One process owns one TUN device inside the cluster's hub namespace.  The hub
routes every packet that arrives from a node into that device (policy rule
``iif pI lookup <table>``); this process reads it, drops it with probability
``loss``, holds it for ``delay`` seconds and writes it back into the same
device, where the kernel routes it on to the destination node by its address.
So every packet between two nodes crosses the link exactly once: one-way
delay = ``delay``, round trip = 2 x ``delay``.

Rate is not limited here; the kernel's htb classes on the veth links do that
(see ``cluster.py``).  The delay is the same for every packet, so a FIFO is
already in deadline order and no heap is needed.

Run by ``Cluster.up`` as ``ip netns exec HUB python -m lorasync.emulate.delaylink``;
it prints ``ready`` once the device exists and exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

__all__ = ["open_tun", "serve"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
#: Bound on bytes held in flight so a stalled receiver cannot eat memory;
#: beyond it packets are dropped, as a router's full buffer would.
MAX_QUEUED_BYTES = 64 << 20


def open_tun(name: str) -> int:
    """Create (or attach to) TUN device ``name`` in this namespace; return its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def serve(fd: int, delay_s: float, loss: float, mtu: int = 65535,
          rng: random.Random | None = None, stop: list | None = None) -> dict:
    """Forward packets read from ``fd`` back into it after ``delay_s``.

    Returns counters when ``stop[0]`` becomes true (set by the signal handler).
    """
    rng = rng or random.Random()
    stop = stop if stop is not None else [False]
    queue: collections.deque = collections.deque()
    queued = 0
    stats = {"forwarded": 0, "dropped_loss": 0, "dropped_full": 0, "write_errors": 0}
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    bufsize = mtu + 64
    try:
        while not stop[0]:
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, pkt = queue.popleft()
                queued -= len(pkt)
                try:
                    os.write(fd, pkt)
                    stats["forwarded"] += 1
                except OSError:
                    stats["write_errors"] += 1
            # epoll rounds the timeout up to whole ms, so packets are never early
            timeout = max(0.0, queue[0][0] - now) if queue else 1.0
            try:
                events = ep.poll(timeout)
            except InterruptedError:
                continue
            if not events:
                continue
            for _ in range(256):  # bounded so due packets are not starved
                try:
                    pkt = os.read(fd, bufsize)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                if loss and rng.random() < loss:
                    stats["dropped_loss"] += 1
                    continue
                if queued + len(pkt) > MAX_QUEUED_BYTES:
                    stats["dropped_full"] += 1
                    continue
                queue.append((time.monotonic() + delay_s, pkt))
                queued += len(pkt)
    finally:
        ep.close()
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorasync.emulate.delaylink", description=__doc__)
    p.add_argument("--dev", required=True, help="TUN device name to create in this namespace")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay in seconds")
    p.add_argument("--loss", type=float, default=0.0, help="drop probability per packet, 0..1")
    p.add_argument("--mtu", type=int, default=65535)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cluster", default="", help="cluster name (lets `down` find this process)")
    args = p.parse_args(argv)
    stop = [False]

    def _stop(signum, frame):
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    fd = open_tun(args.dev)
    print("ready", flush=True)
    # the parent stops reading after "ready"; never write to that pipe again
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    t0 = time.monotonic()
    stats = serve(fd, args.delay, args.loss, args.mtu, random.Random(args.seed), stop)
    print(f"delaylink {args.dev}: {stats} over {time.monotonic() - t0:.1f}s", file=sys.stderr)
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
