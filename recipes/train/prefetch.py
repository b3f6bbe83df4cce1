"""Batches prepared one step ahead in a background thread, so the step rarely waits on data.

``get(cursor)`` is a pure function of the cursor for every batch source here (``core.data.text.Batches``,
``core.data.documents.DocBatches``, the fault and distill wrappers), so computing ``cursor + 1`` early changes no value:
after a jump (a rollback, a resume) the prefetched batch is simply not used. Pinned memory and non-blocking
copies on CUDA come from the batch sources themselves (``pin_memory``). The loop logs the time each step
waited for its batch (``data_ms``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class Prefetch:
    """``batches.get`` with the next cursor's batch built in a background thread."""

    def __init__(self, batches):
        self.batches = batches
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="purestep-data")
        self._ahead = None    # (cursor, future)

    def get(self, cursor: int):
        cursor = int(cursor)
        if self._ahead is not None and self._ahead[0] == cursor:
            batch = self._ahead[1].result()
        else:
            if self._ahead is not None:
                self._ahead[1].cancel()
            batch = self.batches.get(cursor)
        self._ahead = (cursor + 1, self._pool.submit(self.batches.get, cursor + 1))
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
