"""Benchmarks (``redknot bench ...``)."""
