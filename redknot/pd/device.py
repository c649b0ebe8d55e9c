"""One lock between CUDA-graph capture and device work on threads other than the engine's.

A KV transfer gathers pages and copies them to or from the host on a server or pull thread while
the engine thread runs; a CUDA graph being captured at that moment would record, or be broken by,
the other thread's allocations. The model runner captures under this lock, and transfer threads
take it around their device work (captures are rare: this costs nothing in steady state).
"""

import threading

device_lock = threading.RLock()
