"""ddtree-serve: an OpenAI-compatible server whose decode loop is DFlash + DDTree speculative decoding.

Rooms: ``server`` (HTTP, scheduling, processes), ``speculative`` (drafts, trees, verification, commit),
``model_executor`` (models, KV cache, sampling), ``kernels`` (torch references, Triton and CUDA glue).
"""
