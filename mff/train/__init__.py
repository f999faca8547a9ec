"""The training step and its metrics (throughput, MFU, memory estimate)."""
