"""Where the c10d stores listen: one address, never a wildcard.

torch's TCPStore servers (the rendezvous store of the torchrun agents, the
workers' bootstrap store, and the store rank 0's worker creates when every
restart gets a fresh one: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) listen on
every interface, and they have no authentication: whoever reaches the port
can list and write keys.  lorasync makes every store server a process of its
starts listen on one address (:func:`bind_stores`):

* on one node, loopback (every rank is local);
* across nodes, the address peers reach this node at: the overlay's when
  there is one, ``--local-addr``, else the address of the interface that
  routes to the rendezvous host (:func:`route_address`).

A launcher tells its agents and workers the address in ``LORASYNC_STORE_ADDR``;
a worker started by a plain ``torchrun`` (no lorasync launcher) works it out
from its environment (:func:`store_address`) and creates the group's store
itself (:func:`init_process_group`), so the store rank 0 hosts is bound the
same way.  torch has no option for either: the servers are given a listening
socket bound to the address (``master_listen_fd``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Callable

from lorasync.hostops import route_address

__all__ = ["ENV", "GUARD_ENV", "LOOPBACK", "StoreBindError", "StoreAuthError",
           "listening_socket", "bind_stores", "worker_secret", "connect", "interface_address",
           "collective_address", "route_address", "store_address", "master_endpoint",
           "init_process_group"]

#: the address a launcher chose for this node's stores
ENV = "LORASYNC_STORE_ADDR"
LOOPBACK = "127.0.0.1"


class StoreBindError(RuntimeError):
    """A store cannot listen on the address it must use.  A RuntimeError, as
    torch's own bind failure is: its rendezvous falls back to a client when
    another agent on this machine already hosts the store."""


def listening_socket(addr: str, port: int) -> int:
    """A listening TCP socket on addr:port; returns its fd (the store takes it over)."""
    return _listening(addr, port).detach()


def _listening(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1024)
    except OSError as exc:
        s.close()
        hint = ("is the overlay up on this node (`lorasync tunnel status`)?"
                if exc.errno == errno.EADDRNOTAVAIL else "is another job using that port?")
        raise StoreBindError(f"cannot listen on {addr}:{port} for the c10d store "
                             f"({exc.strerror}): {hint}") from None
    return s


def _wildcard(host) -> bool:
    try:
        return ipaddress.ip_address(str(host)).is_unspecified
    except ValueError:
        return False


#: set by a launcher whose agents guard their stores: the workers guard theirs too
GUARD_ENV = "LORASYNC_STORE_GUARD"


class StoreAuthError(RuntimeError):
    """A store refused this process's secret, or did not answer as a guarded store."""


def _store_class():
    import torch.distributed as dist

    return getattr(dist.TCPStore, "_lorasync_original", dist.TCPStore)


def _master_flag(args, kw) -> bool:
    return bool(kw.get("is_master", args[1] if len(args) > 1 else False))


def _make_store_class(addr: str, secret: str | None):
    """torch's TCPStore, bound to ``addr`` and, with ``secret``, guarded."""
    from lorasync.launch.guard import Forwarder, Guard

    original = _store_class()

    class TCPStore(original):
        """torch's TCPStore: a server listens on one address; with the job's
        secret, behind a guard (:mod:`lorasync.launch.guard`), and a client
        connects through the guard's handshake."""

        _lorasync_original = original

        def __init__(self, host_name, port, *args, **kw):
            self._lorasync_port = None
            if _master_flag(args, kw) and kw.get("master_listen_fd") is None:
                if secret is None:
                    kw["master_listen_fd"] = listening_socket(addr, int(port or 0))
                    super().__init__(host_name, port, *args, **kw)
                    return
                # the store on loopback, the guard where peers connect; the guard
                # first: a server given world_size waits in its constructor for
                # every worker, and they arrive through the guard
                inner = _listening(LOOPBACK, 0)
                inner_port = inner.getsockname()[1]
                guard = Guard(_listening(addr, int(port or 0)), inner_port, secret)
                kw["master_listen_fd"] = inner.detach()
                try:
                    super().__init__(LOOPBACK, inner_port, *args, **kw)
                except BaseException:
                    guard.close()
                    raise
                self._lorasync_guard = guard
                self._lorasync_port = guard.port
                return
            if secret is None or _master_flag(args, kw):
                super().__init__(host_name, port, *args, **kw)
                return
            fw = Forwarder(str(host_name), int(port), secret,
                           connect_timeout=_timeout_s(args, kw))
            try:
                super().__init__(LOOPBACK, fw.port, *args, **kw)
            except Exception as exc:
                if fw.error:
                    raise StoreAuthError(
                        f"the c10d store at {host_name}:{port} cannot be used: {fw.error}; every "
                        "node needs the same secret (--secret-file, docs/guide.md)") from exc
                raise
            self._lorasync_forwarder = fw

        @property
        def port(self):
            return self._lorasync_port if self._lorasync_port is not None \
                else original.port.__get__(self)

    return TCPStore


def _timeout_s(args, kw) -> float:
    t = kw.get("timeout", args[2] if len(args) > 2 else None)
    try:
        return float(t.total_seconds())
    except AttributeError:
        return 300.0


def bind_stores(addr: str, secret: str | None = None) -> Callable[[], None]:
    """Make every TCPStore this process creates from now on listen on
    ``addr`` only (a server) and, with ``secret``, guard it (a server) or go
    through the guard (a client): the agent's rendezvous store (c10d
    backend), its bootstrap store for the workers, and a worker's env://
    store.  With a secret the workers this process starts guard theirs too
    (``LORASYNC_STORE_GUARD``).  Returns what undoes it all (a launcher
    running in a longer-lived process, e.g. a test)."""
    import importlib

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    # the module, not the function of the same name torch.distributed exports
    env_rdzv = importlib.import_module("torch.distributed.rendezvous")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    TCPStore = _make_store_class(addr, secret)

    def create_server(self, master_addr, master_port):
        # the workers' bootstrap store (group rank 0's agent)
        return TCPStore(host_name=master_addr, port=master_port, is_master=True,
                        multi_tenant=True)

    before = (dist.TCPStore, env_rdzv.TCPStore, backend.TCPStore,
              dyn.DynamicRendezvousHandler.__dict__["_create_tcp_store_server"],
              os.environ.get(GUARD_ENV))
    dist.TCPStore = TCPStore
    env_rdzv.TCPStore = TCPStore
    backend.TCPStore = TCPStore
    dyn.DynamicRendezvousHandler._create_tcp_store_server = create_server
    if secret is not None:
        os.environ[GUARD_ENV] = "1"

    def undo() -> None:
        dist.TCPStore, env_rdzv.TCPStore, backend.TCPStore = before[:3]
        dyn.DynamicRendezvousHandler._create_tcp_store_server = before[3]
        if before[4] is None:
            os.environ.pop(GUARD_ENV, None)
        else:
            os.environ[GUARD_ENV] = before[4]
    return undo


def worker_secret(env=None) -> str | None:
    """The secret a worker guards its stores with: only when its agent guards
    the agent's stores too (a plain torchrun's are not)."""
    from lorasync.launch.guard import job_secret

    env = os.environ if env is None else env
    return job_secret(env) if env.get(GUARD_ENV) == "1" else None


def connect(host: str, port: int, world_size: int | None, timeout: timedelta, **kw):
    """A client of the store at ``host``:``port``, through the guard when the
    job has one."""
    cls = _make_store_class(LOOPBACK, worker_secret())
    return cls(host, port, world_size, False, timeout=timeout, **kw)


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname`` (SIOCGIFADDR), or None."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def collective_address(env=None) -> str | None:
    """The address gloo/NCCL use on this node: their interface's
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``; the first of a list)."""
    env = os.environ if env is None else env
    names = env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME") or ""
    name = names.split(",")[0].lstrip("^=").strip()
    return interface_address(name) if name else None


def _single_node(env) -> bool:
    try:
        return int(env.get("WORLD_SIZE", 1)) == int(env.get("LOCAL_WORLD_SIZE",
                                                            env.get("WORLD_SIZE", 1)))
    except ValueError:
        return False


def store_address(env=None) -> str:
    """Where this node's stores listen: the launcher's choice
    (``LORASYNC_STORE_ADDR``); loopback when every rank is on this node; the
    collectives' interface (``GLOO_SOCKET_IFNAME``); else the address that
    routes to the store host (``MASTER_ADDR``: rank 0's own node)."""
    env = os.environ if env is None else env
    chosen = env.get(ENV)
    if chosen and not _wildcard(chosen):
        return chosen
    if _single_node(env):
        return LOOPBACK
    master = env.get("MASTER_ADDR")
    return (collective_address(env) or (route_address(master) if master else None)
            or LOOPBACK)


def master_endpoint(env=None) -> tuple[str, int]:
    """(address, port) of the group's store as this worker connects to it:
    on one node the address it listens on (see :func:`store_address`), across
    nodes ``MASTER_ADDR``."""
    env = os.environ if env is None else env
    port = int(env["MASTER_PORT"])
    if _single_node(env):
        return store_address(env), port
    return env["MASTER_ADDR"], port


def init_process_group(backend: str, timeout: timedelta, *, on_store=None, **kw):
    """``torch.distributed.init_process_group`` for a torchrun worker, with the
    group's store created here: rank 0 (unless the agent's store is shared)
    hosts it on :func:`store_address` only, the others connect to
    :func:`master_endpoint`.  ``on_store(store)`` is called once the store is
    there, before the process group is created (the trainer leaves a mark in
    it: a rank that stops between the two is named).  Returns the store."""
    import torch.distributed as dist

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, port = master_endpoint(env)
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store or rank != 0:
        store = connect(host, port, world, timeout)
    else:
        cls = _make_store_class(store_address(env), worker_secret(env))
        store = cls(host, port, world, True, timeout=timeout, multi_tenant=True)
    if on_store is not None:
        on_store(store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            **kw)
    return store
