"""Routed experts: the contract a MoE layer's experts meet, kt-kernel on the CPU (methods, the worker pool, the weight
cache, deferral), and the copies the GPU streams or reads from host memory."""
