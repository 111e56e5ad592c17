"""The operations: one module per operation, written from its chapter by ``tools/export.py``.

An operation imports the runtime layer and, where it is built from another operation (``linear``
from ``matmul``, ``linear_cross_entropy`` from both), that operation's functions; device code
that two operations share lives in the runtime layer, not in either of them.
"""
