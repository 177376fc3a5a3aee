"""GPU machine classes a configuration may name (``machine: b300`` in a preset, ``--machine``).

``ddtree-serve plan`` sizes with the class's memory per GPU unless ``--gpu-memory-gb`` states it; the server
sizes from the GPU it finds (``cudaMemGetInfo``) and logs a warning when that differs from the class by more
than ``MISMATCH``. Figures: the vendor's memory per GPU, read as GiB (HBM and GDDR capacities are binary);
a device reports a few percent less once ECC and the driver's reservation are taken.
"""

from __future__ import annotations

GPU_MEMORY_GIB: dict[str, float] = {
    "b300": 288.0,  # HBM3e, sm103
    "b200": 180.0,  # HBM3e, sm100
    "h200": 141.0,  # HBM3e, sm90
    "h100": 80.0,  # HBM3, sm90 (SXM)
    "rtx-pro-6000": 96.0,  # GDDR7, sm120 (RTX PRO 6000 Blackwell)
}
MISMATCH = 0.10  # relative difference of device memory that start-up warns about


def machine_memory_mismatch(machine: str | None, total_bytes: int) -> str | None:
    """A warning when ``total_bytes`` (the probed device) is not the memory of ``machine``, else None."""
    if machine is None or total_bytes <= 0:
        return None
    want = GPU_MEMORY_GIB[machine]
    have = total_bytes / (1 << 30)
    if abs(have - want) <= MISMATCH * want:
        return None
    return (f"the configuration is written for {machine} GPUs ({want:g} GiB) but this GPU has {have:.1f} GiB: "
            "the KV cache is sized from this GPU, so numbers planned for the preset do not apply")
