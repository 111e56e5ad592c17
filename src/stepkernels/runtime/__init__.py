"""The runtime layer: what every operation stands on.

Device facts and input checks (``core``, ``arguments``), cheap repeated launches (``launch``),
CUDA-graph helpers (``graphs``), and device code that several operations share, written from
the chapters that teach it: tiles of a matrix product (``tiles``, chapter 04), activations
(``activations``, chapter 04), rows as matrices (``rows``) and programs that wait for their
siblings (``waiting``, chapter 02), partial sums flushed under a lock (``partials``, chapter 03).
It imports nothing else of the package.
"""
