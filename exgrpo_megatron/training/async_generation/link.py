"""The link between the trainer's global rank 0 and the generator process (generator.py).

Its own two-rank gloo process group over a TCPStore at (host, port), separate from the training world, so
neither side's collectives wait for the other's. Messages are pickled objects; weights travel as flat tensors
in the dtype they train in. A peer that dies closes its connection: the other side's pending send or receive
raises (gloo: "Connection closed by peer") instead of hanging.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TRAINER, GENERATOR = 0, 1
_HEADER, _PAYLOAD, _TENSOR = 0, 1, 2  # message tags
CONNECT_TIMEOUT = timedelta(minutes=15)  # the peer process starting (spawn, imports) and joining the store
TIMEOUT = timedelta(hours=6)  # one receive may wait for a whole generation round


class Link:
    def __init__(self, host: str, port: int, rank: int) -> None:
        """rank TRAINER hosts the store."""
        store = dist.TCPStore(host, port, 2, is_master=rank == TRAINER, timeout=CONNECT_TIMEOUT)
        self.group: Any = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)  # its send/recv are not in torch's stubs
        self.peer = 1 - rank

    def send_object(self, obj: Any) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self._send(torch.tensor([payload.numel()], dtype=torch.int64), _HEADER)
        self._send(payload, _PAYLOAD)

    def recv_object(self) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        self._recv(size, _HEADER)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._recv(payload, _PAYLOAD)
        return pickle.loads(payload.numpy().tobytes())

    def send_tensor(self, tensor: torch.Tensor) -> None:
        self._send(tensor.detach().contiguous().cpu(), _TENSOR)

    def recv_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self._recv(out, _TENSOR)
        return out

    def _send(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.send([tensor], self.peer, tag).wait()

    def _recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.recv([tensor], self.peer, tag).wait()
