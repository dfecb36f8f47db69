"""What the kernels' launch tunings need to know about the GPU, read once from the device.

The split and one-wave rules of the decode kernels count programs per streaming
multiprocessor; they were measured on cards with ``REFERENCE_SMS`` SMs (H100 SXM, H200) and
scale with the SM count of the card they run on (an H100 PCIe has 114, an L40S 142). The
count is PJRT's ``core_count`` device attribute of the first GPU; without a GPU (interpret
mode on the CPU) or where the plugin does not report it, the reference count stands, so
CPU tests trace exactly what an H100/H200 runs."""

from __future__ import annotations

import functools

import jax

REFERENCE_SMS = 132  # H100 SXM and H200: the cards every tuning constant was measured on


@functools.cache
def num_sms() -> int:
    """SMs of the first GPU (``REFERENCE_SMS`` when there is none or it does not say)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return REFERENCE_SMS
    n = getattr(devices[0], "core_count", None) if devices else None
    return int(n) if isinstance(n, int) and n > 0 else REFERENCE_SMS


def scaled(programs_on_reference: int) -> int:
    """A program count measured on a ``REFERENCE_SMS``-SM card, for this card (same
    programs per SM; at least 1)."""
    return max(1, round(programs_on_reference * num_sms() / REFERENCE_SMS))
