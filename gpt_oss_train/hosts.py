"""The processes of a multi-host job: joining them, and the link from process 0 to the rest.

Every command runs as the same program on every process (multi-controller JAX). `join()`
connects the processes for JAX's collectives (`sharding.initialize_distributed`) and, when
there are several, opens the `Link`: one TCP connection from each process to process 0,
whose address the others read from JAX's coordination service. Over it process 0 sends
what only it knows (decode's input file, each serving round's device calls) and the others
receive it: one framed message, no Ray, no second service.

The link is also how a lost peer is noticed: a process that ends by any means, SIGKILL
included, has its connection closed by the kernel, and the other end sees it at once.
Every survivor then exits with one line naming the lost process (`EXIT_PEER_LOST`) rather
than waiting forever in a collective that can no longer complete: process 0 watches every
connection, and tells the others which one it lost before it exits; the others watch
their connection to process 0.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable

import jax
from absl import logging
from jax._src import distributed  # the coordination service's key-value store

from gpt_oss_train import errors, runtime, sharding

EXIT_PEER_LOST = 3  # a peer process ended: this one cannot go on without it
CONNECT_TIMEOUT_S = 300  # as jax.distributed's initialization timeout
CLOSE_RACE_S = 2.0  # a peer's end this close to this process's own is not a loss

_DATA, _LOST, _CLOSE = b"D", b"L", b"C"
_HEADER = struct.Struct("!cQ")  # kind, payload length
_HELLO = struct.Struct("!32sI")  # secret, process index
_links = itertools.count()


def command(run: Callable[[Link], int], argv: list[str]) -> int:
    """An entry point's main(argv), on every process of the job: joins them (before
    anything asks JAX for its devices), sets the process up, and returns run(link)'s exit
    status, a UserError reported as one line (errors.run_command). Leaving it ends the
    link in order."""
    link = join()
    with link:
        runtime.setup_process(sharding.platform())
        return errors.run_command(lambda: run(link), argv)


class LinkClosed(Exception):
    """Process 0 closed the link in order: no more messages will come."""


def join() -> Link:
    """Joins this process to the job's others (nothing to do for one process) and opens
    the link between them. Call it first, before any JAX computation. Use it as a
    context manager: leaving the block normally ends the link in order (`close`)."""
    sharding.initialize_distributed()
    return Link.open()


class Link:
    """Process 0's connections to every other process (`send`), or one process's
    connection to process 0 (`receive`). With one process it is empty: `send` does
    nothing and there is nothing to receive."""

    def __init__(self, index: int, count: int, peers: dict[int, socket.socket]):
        self.index, self.count = index, count
        self._peers = peers  # process 0: {index: socket}; others: {0: socket}
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._closing = False
        self._closed = threading.Event()  # others: process 0's close arrived
        self._on_lost: list[Callable[[int], None]] = []
        self.lost: int | None = None  # the process found gone, if one was
        if peers:
            watch = self._watch_followers if self.leader else self._read_leader
            threading.Thread(target=watch, name="gpt-oss-link", daemon=True).start()

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def multihost(self) -> bool:
        return self.count > 1

    @classmethod
    def open(cls) -> Link:
        index, count = jax.process_index(), jax.process_count()
        if count == 1:
            return cls(0, 1, {})

        client = distributed.global_state.client
        key = f"gpt_oss_train/link/{next(_links)}"
        t0 = time.monotonic()
        if index == 0:
            peers = _accept_followers(client, key, count)
        else:
            peers = {0: _connect_to_leader(client, key, index)}
        logging.info(
            "link: process %d of %d connected in %.2f s", index, count, time.monotonic() - t0
        )
        return cls(index, count, peers)

    # -- messages -----------------------------------------------------------------------

    def send(self, payload: bytes) -> None:
        """Process 0: `payload` to every other process, in order."""
        assert self.leader, "only process 0 sends"
        self._send_all(_DATA, payload)

    def receive(self) -> bytes:
        """Another process: the next message of process 0 (waits for it); LinkClosed once
        process 0 has closed the link."""
        assert not self.leader, "process 0 sends, the others receive"
        item = self._inbox.get()
        if item is None:
            raise LinkClosed()
        return item

    def share(self, payload: bytes | None) -> bytes:
        """Process 0's `payload`, on every process: process 0 sends it, the others receive
        it (for inputs that only process 0 reads)."""
        if not self.multihost:
            return payload
        if self.leader:
            self.send(payload)
            return payload
        return self.receive()

    def agree(self, check: Callable[[], object]):
        """check() on process 0, its UserError raised on every process (the others would
        otherwise wait for process 0 forever); returns check()'s result on process 0,
        None elsewhere. For what only process 0 touches: its input file, its port."""
        result, error = None, None
        if self.leader:
            try:
                result = check()
            except errors.UserError as e:
                error = e
        if self.multihost:
            message = self.share(str(error).encode() if error else b"")
            if message and error is None:
                raise errors.UserError(message.decode())
        if error is not None:
            raise error
        return result

    def on_lost(self, callback: Callable[[int], None]) -> None:
        """callback(index of the lost process), run before this process exits for it."""
        self._on_lost.append(callback)

    def close(self, wait_s: float = CONNECT_TIMEOUT_S) -> None:
        """Ends the link in order. Process 0 tells the others that no more messages come;
        another process first waits (up to wait_s) for that, so that process 0, still
        finishing its part (an output file, a last round), never sees it leave early
        and takes it for lost. wait_s=0: leave now (this process failed; process 0
        will say so)."""
        if not self._peers:
            return
        if not self.leader:
            self._closed.wait(wait_s)
        with self._lock:
            if self._closing and self.leader:
                return
            self._closing = True
            for sock in self._peers.values():
                try:
                    if self.leader:
                        sock.sendall(_HEADER.pack(_CLOSE, 0))
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def __enter__(self) -> Link:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(wait_s=CONNECT_TIMEOUT_S if kind is None else 0)

    # -- frames -------------------------------------------------------------------------

    def _send_all(self, kind: bytes, payload: bytes, skip: int | None = None) -> None:
        frame = _HEADER.pack(kind, len(payload)) + payload
        with self._lock:
            for i, sock in self._peers.items():
                if i == skip:
                    continue
                try:
                    sock.sendall(frame)
                except OSError:
                    if kind == _DATA:
                        threading.Thread(
                            target=self._lose, args=(i, "its connection broke"), daemon=True
                        ).start()

    def _watch_followers(self) -> None:
        """Process 0: the others never write after their hello, so a readable connection
        is one that closed."""
        socks = {s: i for i, s in self._peers.items()}
        while True:
            ready, _, _ = select.select(list(socks), [], [], 1.0)
            for sock in ready:
                try:
                    data = sock.recv(1)
                except OSError:
                    data = b""
                if not data and not self._closing_soon():
                    self._lose(socks[sock], "its connection to process 0 closed")
                    return
                if not data:
                    del socks[sock]
            if not socks:
                return

    def _read_leader(self) -> None:
        sock = self._peers[0]
        try:
            while True:
                kind, n = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
                payload = _read_exactly(sock, n)
                if kind == _DATA:
                    self._inbox.put(payload)
                elif kind == _LOST:
                    self._lose(int(payload), "process 0 lost it")
                    return
                elif kind == _CLOSE:
                    self._closing = True
                    self._closed.set()
                    self._inbox.put(None)
                    return
        except (OSError, EOFError):
            if not self._closing_soon():
                self._lose(0, "its connection closed")

    def _closing_soon(self) -> bool:
        """Whether this process closes the link itself within a moment: processes that
        fail together (the same bad input on each) leave at nearly the same time, and the
        first to go is then not a lost peer."""
        deadline = time.monotonic() + CLOSE_RACE_S
        while not self._closing and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._closing

    def _lose(self, index: int, why: str) -> None:
        """Reports the lost process in one line, tells the others (process 0), runs the
        callbacks, and ends this process: a collective with the lost peer would never
        complete."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = index
        line = (
            f"process {index} of {self.count} is gone ({why}); process {self.index} exits, "
            "as a multi-host job cannot go on without every process"
        )
        logging.error("%s", line)
        print(line, file=sys.stderr, flush=True)
        if self.leader:
            self._send_all(_LOST, str(index).encode(), skip=index)
        for callback in self._on_lost:
            try:
                callback(index)
            except Exception:  # noqa: BLE001 - exiting regardless
                logging.exception("link: a peer-lost callback failed")
        os._exit(EXIT_PEER_LOST)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _coordinator_host() -> str:
    address = distributed.global_state.coordinator_address or "localhost:0"
    return address.rpartition(":")[0].strip("[]") or "localhost"


def _accept_followers(client, key: str, count: int) -> dict[int, socket.socket]:
    """Process 0: listens on the coordinator's address (the one every process can reach),
    publishes it with a secret, and accepts one connection from each other process."""
    host = _coordinator_host()
    server = socket.create_server((host, 0))
    secret = secrets.token_bytes(_HELLO.size - 4)
    client.key_value_set(key, f"{host}|{server.getsockname()[1]}|{secret.hex()}")
    server.settimeout(CONNECT_TIMEOUT_S)
    peers: dict[int, socket.socket] = {}
    with server:
        while len(peers) < count - 1:
            sock, _ = server.accept()
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                got, index = _HELLO.unpack(_read_exactly(sock, _HELLO.size))
            except (OSError, EOFError):
                sock.close()
                continue
            if not secrets.compare_digest(got, secret) or not 0 < index < count:
                sock.close()  # not one of this job's processes
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peers[index] = sock
    return peers


def _connect_to_leader(client, key: str, index: int) -> socket.socket:
    value = client.blocking_key_value_get(key, CONNECT_TIMEOUT_S * 1000)
    host, port, secret = value.split("|")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_HELLO.pack(bytes.fromhex(secret), index))
    sock.settimeout(None)
    return sock
