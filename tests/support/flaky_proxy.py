"""A TCP proxy in front of a real server that cuts chosen responses short: the first ``drops``
connections whose request line contains ``match`` get only ``cut_after`` bytes of the answer, then the
connection is closed (a dropped download, for the resume tests of generators/weight_fetch.py). Other
connections are forwarded whole. Real sockets on a free port of 127.0.0.1."""

from __future__ import annotations

import socket
import threading


class FlakyProxy:
    def __init__(self, upstream: tuple[str, int], match: bytes, cut_after: int, drops: int = 1):
        self.upstream, self.match, self.cut_after, self.drops = upstream, match, cut_after, drops
        self.cut = 0  # responses cut short so far
        self.requests: list[bytes] = []  # every request head forwarded
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as up:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            self.requests.append(head)
            up.sendall(head)
            with self._lock:
                cut = self.match in head.split(b"\r\n", 1)[0] and self.cut < self.drops
                self.cut += cut
            sent = 0
            while True:
                data = up.recv(65536)
                if not data:
                    return
                if cut and sent + len(data) >= self.cut_after:
                    client.sendall(data[: self.cut_after - sent])
                    return  # closes the client's connection mid-body
                client.sendall(data)
                sent += len(data)
