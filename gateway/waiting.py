"""The gateway's waiting queue: one ticket per request from admission to the end of its
response, and the count of sequences that have produced no output yet, bounded by
`--max-waiting`. This module is the one writer of that count."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway import errors


class WaitingQueue:
    """Requests in flight (`tickets`, which the drain on SIGTERM waits for) and the sequences
    among them that still wait for their first output (`num_waiting`)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self.tickets: set[Ticket] = set()

    def open(self) -> Ticket:
        """A place for one more request, or 429 when the queue is full."""
        if self.num_waiting >= self.max_waiting:
            raise errors.too_many_requests(retry_after=1.0)
        ticket = Ticket(self)
        self.num_waiting += 1
        self.tickets.add(ticket)
        return ticket


@dataclass(eq=False)
class Ticket:
    """A request's place in the waiting queue, from admission until its response ends.
    `num_waiting` sequences count against `--max-waiting` until each produces its first
    output; `close()` (idempotent) releases whatever is left and ends the request's flight."""

    queue: WaitingQueue
    num_waiting: int = 1
    is_closed: bool = field(default=False, init=False)

    def hold(self, num_sequences: int) -> None:
        """Grow (or shrink) the reservation to `num_sequences`: 400 if the request alone can
        never fit, 429 if the queue is too full for it now."""
        queue = self.queue
        if num_sequences > queue.max_waiting:
            raise errors.OpenAIError(
                400,
                f"This request asks for {num_sequences} sequences (n x prompts); this server "
                f"queues at most {queue.max_waiting}. Send fewer choices or prompts per request.",
                param="n",
                code="too_many_sequences",
            )
        others = queue.num_waiting - self.num_waiting
        if others + num_sequences > queue.max_waiting:
            raise errors.too_many_requests(retry_after=1.0)
        queue.num_waiting += num_sequences - self.num_waiting
        self.num_waiting = num_sequences

    def started(self) -> None:
        """One sequence produced its first output: it no longer waits."""
        if self.num_waiting > 0:
            self.num_waiting -= 1
            self.queue.num_waiting -= 1

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self.queue.num_waiting -= self.num_waiting
        self.num_waiting = 0
        self.queue.tickets.discard(self)
