"""Training: the step loop every recipe runs (``loop``), its shared options (``config``), the
step function (``step``), precision modes, run logging and metrics (throughput, MFU, memory
estimate), and what checkpoint metadata records about a run (``state``)."""
