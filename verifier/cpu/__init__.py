"""The bottom floor: the CPU probe (`cpus`, `machine`), the C kernels (`csrc/`) and their build
(`cpu_ops`), and where timings and builds are cached (`cache`)."""
