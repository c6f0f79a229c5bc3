"""A decode or verify step without host overhead: padded to a row bucket, run from fixed buffers
(`static_step.py`), captured once per bucket as a CUDA graph (`cuda_graphs.py`), with a guard that
fails on any host synchronisation inside (`sync_guard.py`). `config.py` says which steps qualify
(and imports no torch: the CLI's flags read it)."""
