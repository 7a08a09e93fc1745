"""Models Relay builds locally for its examples and benchmarks (no model hub): ``smollm2.py`` for
``make smollm2-demo`` (examples/smollm2-cpu/)."""
