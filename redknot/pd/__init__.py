"""Prefill/decode disaggregation: the KV handoff format, leases and the transports (docs/pd.md)."""
