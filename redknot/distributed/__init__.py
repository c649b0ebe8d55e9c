"""Tensor parallelism across one host's devices: the process group (``group.py``), the split layers
(``layers.py``), one rank's share of a model (``shard.py``), head-to-rank balancing
(``balance.py``), and the lockstep engine that keeps the ranks' engines in step (``lockstep.py``,
``workers.py``). docs/tp.md tells the design."""
