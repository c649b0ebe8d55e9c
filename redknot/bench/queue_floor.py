"""The queueing floor of a closed-loop load: the first-token times an ideal server would give.

``bench soak``'s normal clients each send a request, wait for its answer, think (exponential, mean
``think_s``) and send the next. On a machine whose requests are compute-bound (two requests in one
step take as long as the two one after the other, as on a CPU), no order of the work shortens
what waits: the best a server can do is run the requests one at a time, first come first served,
with nothing else to do and no overhead. This simulates that server, drawing each request's
service time from the unloaded run's first-token times, so a loaded run's tail can be read against
what its load alone costs. The hostile kinds' work is left out, so the floor is a lower bound.
"""

from __future__ import annotations

import heapq
import random


def closed_loop_fifo(service_s: list[float], clients: int, think_s: float, requests: int = 200_000,
                     seed: int = 0) -> list[float]:
    """Response times of ``requests`` requests from ``clients`` closed-loop clients served one at a
    time in arrival order; each service time is drawn from ``service_s``."""
    if not service_s or clients < 1:
        raise ValueError("the queueing floor needs service times and at least one client")
    rng = random.Random(seed)

    def think() -> float:
        return rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0

    arrivals = [(think(), c) for c in range(clients)]
    heapq.heapify(arrivals)
    free_at, responses = 0.0, []
    while len(responses) < requests:
        at, c = heapq.heappop(arrivals)
        response = max(0.0, free_at - at) + rng.choice(service_s)
        responses.append(response)
        free_at = at + response
        heapq.heappush(arrivals, (free_at + think(), c))
    return responses
