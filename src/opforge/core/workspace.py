"""Workspace pool: scratch memory reused across calls, per device and stream.

Kernels that need scratch memory (split reductions, partial sums) get it from `run`'s
``workspace=`` argument or from this pool. The pool keeps one buffer per (device, stream)
and grows it to the next power of two when a call asks for more, so a stream of calls with
changing shapes allocates O(log(max bytes)) times instead of once per call. Work enqueued on
one stream runs in order, so a buffer shared by the calls of one stream is never used by
two kernels at once; CPU calls run synchronously, so the CPU key is the calling thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_MIN_BYTES = 4096
_MAX_VIEWS = 256  # sizes remembered at once (a shape sweep makes many)


@dataclass
class WorkspaceStats:
    """Counters of the pool: requests served, allocations made, bytes currently held."""

    requests: int = 0
    allocations: int = 0
    bytes_held: int = 0


def _stream_key(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return (str(device), torch.cuda.current_stream(device).stream_id)
    return (str(device), threading.get_ident())


class WorkspacePool:
    """Thread-safe pool of byte buffers keyed by (device, stream)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        # The views handed out, one object per (device, stream, size) while its buffer
        # stays: a launch holding a view of the workspace keeps it while that object
        # lives (`launches`), and a slice costs 1 µs a call.
        self._views: dict[tuple[tuple[str, int], int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.stats = WorkspaceStats()
        self.poison = False

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes`` on ``device`` (a view of the pooled buffer).

        With `poison` set, fresh buffers are filled with 0xFF bytes (NaN in every float
        format) so that a kernel reading scratch memory it never wrote is caught by tests.
        """
        key = _stream_key(device)
        with self._lock:
            self.stats.requests += 1
            view = self._views.get((key, nbytes))
            if view is not None:
                return view
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < nbytes:
                size = max(_MIN_BYTES, 1 << (nbytes - 1).bit_length())
                held = 0 if buffer is None else buffer.numel()
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
                if self.poison:
                    buffer.fill_(0xFF)
                self._buffers[key] = buffer
                self._views = {k: v for k, v in self._views.items() if k[0] != key}
                self.stats.allocations += 1
                self.stats.bytes_held += size - held
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            view = self._views[(key, nbytes)] = buffer[:nbytes]
        return view

    def clear(self) -> None:
        """Release every buffer and reset the counters."""
        with self._lock:
            self._buffers.clear()
            self._views.clear()
            self.stats = WorkspaceStats()
