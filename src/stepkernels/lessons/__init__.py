"""What the chapters use beside the library: timing and recording benchmarks (``bench``),
checks (``check_*``), figures (``figures*``) and shared lesson plumbing (``tutorial``).

The library (runtime, ops, models) never imports this wing."""
