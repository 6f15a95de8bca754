"""Accelerator datasheet figures, one row per chip: dense bf16 peak FLOP/s (for MFU),
HBM per device (for ahead-of-time memory checks), HBM bandwidth (for the decode
bandwidth share and the step-time model) and interconnect bandwidth (for the step-time
model's collectives, aot/step_model.py). Looked up by `jax.Device.device_kind`; unknown
chips (CPUs included) give None, and so does a figure the sources do not state, so no
figure is ever made up.

Sources: cloud.google.com/tpu/docs (v4, v5e, v5p, v6e, tpu7x system-architecture pages)
and NVIDIA's datasheets (sparsity figures halved to dense).
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float | None  # memory per JAX device (None: not one device per chip)
    hbm_bandwidth: float | None  # bytes/s per device
    # Inter-chip interconnect within a slice: the bidirectional bytes/s per chip, all its
    # ports together, as Google's pages state it (a chip sends at most half of it).
    ici_bandwidth: float | None = None
    # Data-center network between slices: bytes/s per chip.
    dcn_bandwidth: float | None = None
    # JAX devices a chip shows (TPU7x: one per TensorCore chiplet). The figures above that
    # are "per device" are the chip's shared among them; the links are the chip's.
    devices_per_chip: int = 1


def _split(devices: int, peak_flops: float, hbm_bytes: float, hbm_bandwidth: float, **links):
    """A chip shown as `devices` JAX devices, from its per-chip datasheet figures."""
    return Chip(
        peak_flops / devices,
        hbm_bytes / devices,
        hbm_bandwidth / devices,
        devices_per_chip=devices,
        **links,
    )


# Matched as case-insensitive substrings of device_kind, first match wins: the more
# specific names come first (v5e reports "TPU v5 lite", v5p plain "TPU v5").
#
# Interconnect, from docs.cloud.google.com/tpu/docs/<chip> ("System architecture" tables):
#   v6e: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip) 800 GBps";
#        DCN "Data center network bandwidth per Pod 25.6 Tbps" over its 256 chips = 100 Gbps
#        per chip (the same as its "4 x 200 Gbps NIC" per 8-chip host).
#   v5e: ICI 400 GBps bidirectional per chip; DCN 6.4 Tbps per 256-chip Pod = 25 Gbps per
#        chip (= "2 x 100 Gbps NIC" per 8-chip host).
#   v5p: ICI 1200 GBps bidirectional per chip; "Data center network (DCN) bandwidth per
#        chip 50 Gbps".
#   v4:  the page states no per-chip ICI or DCN figure: None.
#   tpu7x: per chip "Peak compute (BF16) 2307 TFLOPs", "HBM capacity 192 GiB", "HBM
#        bandwidth 7380 GBps", "Bidirectional ICI bandwidth 1200 GBps", "DCN bandwidth
#        100 Gbps"; two TensorCores a chip, which libtpu shows as two devices.
_V6E = dict(ici_bandwidth=800e9, dcn_bandwidth=100e9 / 8)
_V5E = dict(ici_bandwidth=400e9, dcn_bandwidth=25e9 / 8)
_V5P = dict(ici_bandwidth=1200e9, dcn_bandwidth=50e9 / 8)
_TPU7X = dict(ici_bandwidth=1200e9, dcn_bandwidth=100e9 / 8)

CHIPS: dict[str, Chip] = {
    "TPU7x": _split(2, 2307e12, 192 * GiB, 7.38e12, **_TPU7X),
    "TPU v6 lite": Chip(918e12, 32 * GiB, 1.64e12, **_V6E),
    "TPU v6e": Chip(918e12, 32 * GiB, 1.64e12, **_V6E),
    "TPU v5 lite": Chip(197e12, 16 * GiB, 0.819e12, **_V5E),
    "TPU v5e": Chip(197e12, 16 * GiB, 0.819e12, **_V5E),
    "TPU v5p": Chip(459e12, 95 * GiB, 2.765e12, **_V5P),
    "TPU v5": Chip(459e12, 95 * GiB, 2.765e12, **_V5P),
    # libtpu describes v4 as two devices per chip: the chip's HBM is not a device's.
    "TPU v4": Chip(275e12, None, 1.2e12),
    "B200": Chip(2250e12, 180 * GiB, 8.0e12),
    "H200": Chip(989e12, 141e9, 4.8e12),
    # H100 SXM; the PCIe card is 756 TFLOP/s dense (pass an override for it).
    "H100": Chip(989e12, 80 * GiB, 3.35e12),
    "A100": Chip(312e12, 80 * GiB, 2.039e12),
}


def chip(device_kind: str) -> Chip | None:
    kind = (device_kind or "").lower()
    for name, c in CHIPS.items():
        if name.lower() in kind:
            return c
    return None


def peak_flops(device_kind: str, override: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a device; `override` (> 0) wins."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override)
    c = chip(device_kind)
    return None if c is None else c.peak_flops


def hbm_bytes(device_kind: str, override_gib: float = 0.0) -> float | None:
    if override_gib > 0:
        return override_gib * GiB
    c = chip(device_kind)
    return None if c is None else c.hbm_bytes


def hbm_bandwidth(device_kind: str, override: float = 0.0) -> float | None:
    if override > 0:
        return override
    c = chip(device_kind)
    return None if c is None else c.hbm_bandwidth
