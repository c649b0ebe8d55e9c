"""Where a prefill's time goes: one call under torch.profiler, summarised by phase.

The recovery forward names its phases with ``record_function`` ranges (``recover.qkv``,
``recover.attention`` — which includes ``recover.attention_mass`` —, ``recover.o_proj``,
``recover.ffn``, ``recover.sparse_ffn``, ``recover.select``, ``recover.kv_write``,
``recover.bookkeeping``). On a GPU a phase's time is the device time of the kernels it launched;
``device_busy_ms`` (all kernels) against ``wall_ms`` shows how much of the call the GPU waited
for the host. On the CPU the phases report host time.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

PHASE_PREFIX = ("recover.", "engine.")  # the reference recovery forward's ranges; the engine step's


def _device_total(e) -> float:
    return float(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) or 0)


def _device_self(e) -> float:
    return float(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) or 0)


def profile_call(fn, device: torch.device, top: int = 15) -> tuple[dict, str]:
    """Run ``fn()`` once under the profiler. Returns (summary, table): the summary has wall_ms,
    device_busy_ms (None on CPU), phases_ms {phase: ms} and top_ops [[name, self ms, calls]]; the
    table is torch's own, sorted by self device time (host time on CPU)."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    total = _device_total if cuda else (lambda e: float(e.cpu_time_total))
    own = _device_self if cuda else (lambda e: float(e.self_cpu_time_total))
    # device work once: the kernels themselves (an op's device time repeats its kernels')
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA
               and not e.key.startswith(PHASE_PREFIX)]
    phases = {e.key: round(total(e) / 1e3, 3) for e in events if e.key.startswith(PHASE_PREFIX)}
    ops = sorted((e for e in events if not e.key.startswith(PHASE_PREFIX)), key=own, reverse=True)
    summary = {"wall_ms": round(wall * 1e3, 3),
               "device_busy_ms": round(sum(_device_self(e) for e in kernels) / 1e3, 3) if cuda else None,
               "phases_ms": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
               "top_ops": [[e.key, round(own(e) / 1e3, 3), e.count] for e in ops[:top]]}
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return summary, events.table(sort_by=sort, row_limit=30, max_name_column_width=70)


def format_summary(s: dict) -> str:
    busy = f", GPU busy {s['device_busy_ms']:.1f} ms" if s["device_busy_ms"] is not None else ""
    lines = [f"wall {s['wall_ms']:.1f} ms (under the profiler){busy}"]
    lines += [f"  {k:<28} {v:10.2f} ms" for k, v in s["phases_ms"].items()]
    return "\n".join(lines)
