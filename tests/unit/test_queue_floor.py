"""The queueing floor: an ideal one-at-a-time server under closed-loop clients."""

import pytest

from redknot.bench.queue_floor import Client, closed_loop_fifo, floor_p99


def test_one_client_never_waits():
    service = [0.2, 0.25, 0.3]
    out = closed_loop_fifo(service, [Client(2.0)], requests=1000)
    assert len(out) == 1000 and {r for _, r in out} <= set(service)  # each response is its own service time


def test_back_to_back_clients_wait_for_every_other_one():
    out = [r for _, r in closed_loop_fifo([0.1], [Client(0.0)] * 4, requests=400)]
    assert out[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # all four arrive at once
    assert out[4:] == pytest.approx([0.4] * 396)  # then each waits for the three others


def test_the_soak_load_alone_puts_p99_beyond_twice_the_service_time():
    # four clients pausing 2 s on average, 0.27 s requests: the CPU soak's normal load
    assert 2.5 * 0.27 < floor_p99([0.27], [Client(2.0)] * 4, timed=4) < 3.2 * 0.27
    assert floor_p99([0.27], [Client(2.0)], timed=1) == pytest.approx(0.27)


def test_load_only_clients_delay_the_timed_ones_but_are_not_timed():
    alone = floor_p99([0.27], [Client(2.0)], timed=1)
    beside = [Client(2.0), Client(0.5, exponential=False)]  # a second client, fixed pauses
    out = closed_loop_fifo([0.27], beside, requests=20_000)
    assert {c for c, _ in out} == {0, 1}
    assert floor_p99([0.27], beside, timed=1) > 1.5 * alone  # it collides with the other often
    # a cycle of 0.5 s pause plus its answer against 2 s plus an answer: it sends about 2.5x as often
    sent = [sum(c == k for c, _ in out) for k in (0, 1)]
    assert 2.0 < sent[1] / sent[0] < 3.5


def test_no_service_times_or_clients_is_an_error():
    with pytest.raises(ValueError, match="service times"):
        closed_loop_fifo([], [Client(1.0)])
    with pytest.raises(ValueError, match="at least one client"):
        closed_loop_fifo([0.1], [])


def test_percentile_is_the_nearest_rank():
    from redknot.bench.percentile import percentile

    xs = list(range(100, 0, -1))  # 1..100, unsorted
    assert percentile(xs, 0.99) == 99 and percentile(xs, 0.5) == 50 and percentile(xs, 1.0) == 100
    assert percentile([7.0], 0.99) == 7.0 and percentile([1, 2, 3], 0.01) == 1
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN
