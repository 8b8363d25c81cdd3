"""meshplan profiler: measures per-layer compute and memory and the links between devices."""
