"""Freed host memory goes back to the OS (glibc malloc_trim) when the serving loop goes idle."""

import os
import sys

import pytest
import torch

from redknot.engine.host_memory import release_free_heap, resident_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc are Linux's")
def test_trim_returns_fragmented_free_memory():
    """Many small blocks freed with every hundredth kept (what per-request buffers leave behind):
    the arenas keep the freed memory until the trim gives it back."""
    blocks = [bytearray(4000) for _ in range(60_000)]  # ~240 MB of small (brk/arena) allocations
    keep = blocks[::100]
    del blocks
    before = resident_bytes()
    assert release_free_heap()
    after = resident_bytes()
    assert before > 0 and after < before - 100 * 2**20, (before, after)
    del keep


class _Fake:
    """A clock, a resident size and a trim that costs ``cost`` seconds and gives back ``gives``."""

    def __init__(self, rss=1000, cost=0.005, gives=0):
        self.t, self.size, self.cost, self.gives, self.calls = 0.0, rss, cost, gives, 0

    def clock(self):
        return self.t

    def rss(self):
        return self.size

    def release(self):
        self.calls += 1
        self.t += self.cost
        self.size -= self.gives
        return True


def _policy(f, **kw):
    from redknot.engine.host_memory import HeapTrimPolicy

    return HeapTrimPolicy(clock=f.clock, rss=f.rss, release=f.release, **kw)


def test_trim_under_load_needs_time_finished_requests_and_growth():
    f = _Fake(rss=1000)
    p = _policy(f, interval_s=10, min_growth=0.02)
    assert not p.due(0)  # the first call sets the baseline
    f.t, f.size = 5.0, 2000
    assert not p.due(3)  # grown, requests finished, but too soon
    f.t = 11.0
    assert not p.due(0)  # no request finished since the baseline: nothing was freed
    f.size = 1015
    assert not p.due(3)  # grew by less than 2%
    f.size = 1030
    assert p.due(3)
    p.trim(3)
    assert f.calls == 1 and p.trims == 1 and abs(p.seconds - 0.005) < 1e-9
    f.t += 10.0
    assert not p.due(3)  # same finished count as at the trim
    assert not p.due(4)  # and no growth past the size measured after the trim (1030)
    f.size = 1100
    assert p.due(4)


def test_an_expensive_trim_stretches_the_interval():
    """Trims take at most max_share of wall time: a 0.5 s trim at 1% waits 50 s, not 10."""
    f = _Fake(rss=1000, cost=0.5)
    p = _policy(f, interval_s=10, max_share=0.01)
    p.due(0)
    f.t, f.size = 10.0, 2000
    assert p.due(1)
    p.trim(1)
    assert p.wait_s() == 50.0
    f.size = 4000
    f.t += 20.0
    assert not p.due(2)
    f.t += 30.0
    assert p.due(2)


def test_cpu_primitive_cache_is_capped_unless_the_user_set_it(monkeypatch):
    from redknot.engine.host_memory import CPU_PRIMITIVE_CACHE_CAPACITY, cap_cpu_primitive_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cap_cpu_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CPU_PRIMITIVE_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    cap_cpu_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_cpu_primitive_cache_caps_both_shape_caches(monkeypatch):
    from redknot.engine.host_memory import CPU_SHAPE_CACHE_VARIABLES, cap_cpu_primitive_cache

    for name in CPU_SHAPE_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cap_cpu_primitive_cache(16)
    assert [os.environ[n] for n in CPU_SHAPE_CACHE_VARIABLES] == ["16", "16"]


_SHAPE_GROWTH = """
import ctypes, sys
if sys.argv[1] == "capped":
    from redknot.engine.host_memory import cap_cpu_primitive_cache
    cap_cpu_primitive_cache()
import torch
from redknot.models.linear import linear, pack

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def live():  # bytes malloc has handed out and not had back
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

w = torch.randn(256, 128)
packed = pack(w)
for m in range(1, 41):
    linear(torch.randn(m, 128), w, None, packed)
before = live()
for m in range(41, 401):  # a new row count each call, as recoveries give
    linear(torch.randn(m, 128), w, None, packed)
print((live() - before) / 2**20)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallinfo2")
def test_new_gemm_shapes_do_not_grow_live_memory_once_capped(tmp_path):
    """Each new row count through a prepacked CPU linear caches a computation; capped, 360 new
    shapes keep live native memory flat (uncapped they hold ~200 MiB)."""
    import subprocess

    import ctypes

    from redknot.engine.host_memory import CPU_SHAPE_CACHE_VARIABLES
    from redknot.models.linear import pack

    if pack(torch.zeros(2, 2)) is None:
        pytest.skip("no oneDNN on this torch build")
    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("a C library without mallinfo2 (glibc < 2.33)")
    env = {k: v for k, v in os.environ.items() if k not in CPU_SHAPE_CACHE_VARIABLES}
    script = tmp_path / "shapes.py"
    script.write_text(_SHAPE_GROWTH)
    grown = {mode: float(subprocess.run([sys.executable, str(script), mode], env=env, check=True,
                                        capture_output=True, text=True).stdout.strip().splitlines()[-1])
             for mode in ("capped", "default")}
    assert grown["capped"] < 32, grown
    assert grown["default"] > 2 * grown["capped"] + 32, grown  # the measurement sees the growth
