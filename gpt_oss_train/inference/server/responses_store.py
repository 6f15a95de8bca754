"""Stored responses, for `previous_response_id` and GET /v1/responses/{id}: in this
process's memory, at most `capacity` of them, the oldest evicted first.

Each entry keeps the response object (what GET returns) and the conversation it ends:
the items of every earlier turn in its chain, its own input items and its output items.
A continued conversation shares the item objects of the one before (only the list is
new), so a chain of N turns holds each turn's text once. Items stay as long as any
stored response refers to them; nothing survives a restart.
"""

from __future__ import annotations

import collections
import dataclasses

# Responses kept: a long-running server holds this many conversations at most. Each one's
# text is bounded by the context (max_context tokens, a few bytes each).
DEFAULT_CAPACITY = 1024


@dataclasses.dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as returned
    conversation: tuple  # every item so far, input and output (responses_request items)


class ResponseStore:
    """id -> Stored, first in, first out: putting one more than `capacity` evicts the
    oldest put (reading one does not keep it longer)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def put(self, response_id: str, entry: Stored) -> None:
        self._entries[response_id] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    def __len__(self) -> int:
        return len(self._entries)
