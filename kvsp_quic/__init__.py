"""kvsp-quic: the reference implementation of the KV Cache Storage Protocol (KVSP)."""

__version__ = "0.1.0"
