"""The queueing floor: an ideal one-at-a-time server under closed-loop clients."""

import pytest

from redknot.bench.queue_floor import closed_loop_fifo


def test_one_client_never_waits():
    service = [0.2, 0.25, 0.3]
    out = closed_loop_fifo(service, clients=1, think_s=2.0, requests=1000)
    assert len(out) == 1000 and set(out) <= set(service)  # each response is its own service time


def test_back_to_back_clients_wait_for_every_other_one():
    out = closed_loop_fifo([0.1], clients=4, think_s=0.0, requests=400)
    assert out[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # all four arrive at once
    assert out[4:] == pytest.approx([0.4] * 396)  # then each waits for the three others


def test_the_soak_load_alone_puts_p99_beyond_twice_the_service_time():
    # four clients thinking 2 s on average, 0.27 s requests: the CPU soak's normal load
    out = sorted(closed_loop_fifo([0.27], clients=4, think_s=2.0, requests=100_000))
    p50, p99 = out[len(out) // 2], out[int(0.99 * len(out))]
    assert p50 == pytest.approx(0.27, rel=0.1)
    assert 2.5 * 0.27 < p99 < 3.2 * 0.27
    light = sorted(closed_loop_fifo([0.27], clients=1, think_s=2.0, requests=10_000))
    assert light[int(0.99 * len(light))] == pytest.approx(0.27)


def test_no_service_times_is_an_error():
    with pytest.raises(ValueError, match="service times"):
        closed_loop_fifo([], clients=2, think_s=1.0)
