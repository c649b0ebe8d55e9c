"""The queueing floor of a closed-loop load: the first-token times an ideal server would give.

``bench soak``'s clients each send a request, wait for its answer, pause and send the next. On a
machine whose requests are compute-bound (two requests in one step take as long as the two one
after the other, as on a CPU), no order of the work shortens what waits: the best a server can do
is run the requests one at a time, first come first served, with nothing else to do and no
overhead. This simulates that server, drawing each request's service time from the unloaded run's
first-token times, so a loaded run's tail can be read against what its load alone costs. Work the
simulation leaves out (decoding, the heavy requests) only raises the real tail, so the floor is a
lower bound.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from .percentile import percentile


@dataclass(frozen=True)
class Client:
    """A closed-loop client: it pauses ``pause_s`` after each answer (exponential around it when
    ``exponential``, else exactly) before its next request."""

    pause_s: float
    exponential: bool = True


def closed_loop_fifo(service_s: list[float], clients: list[Client], requests: int = 200_000,
                     seed: int = 0) -> list[tuple[int, float]]:
    """(client index, response time) of ``requests`` requests from ``clients``, served one at a time
    in arrival order; each service time is drawn from ``service_s``."""
    if not service_s or not clients:
        raise ValueError("the queueing floor needs service times and at least one client")
    rng = random.Random(seed)

    def pause(c: int) -> float:
        client = clients[c]
        if client.pause_s <= 0:
            return 0.0
        return rng.expovariate(1.0 / client.pause_s) if client.exponential else client.pause_s

    def first(c: int) -> float:  # a fixed-pause client starts anywhere in its cycle
        return pause(c) if clients[c].exponential else rng.uniform(0, clients[c].pause_s)

    arrivals = [(first(c), c) for c in range(len(clients))]
    heapq.heapify(arrivals)
    free_at, out = 0.0, []
    while len(out) < requests:
        at, c = heapq.heappop(arrivals)
        response = max(0.0, free_at - at) + rng.choice(service_s)
        out.append((c, response))
        free_at = at + response
        heapq.heappush(arrivals, (free_at + pause(c), c))
    return out


def floor_p99(service_s: list[float], clients: list[Client], timed: int, seed: int = 0) -> float:
    """The p99 response time of the first ``timed`` clients (the others are load only)."""
    return percentile([r for c, r in closed_loop_fifo(service_s, clients, seed=seed) if c < timed], 0.99)
