"""Host helpers of the Hopper (sm_90) Gluon attention kernels, shared by ``_decode_impl`` and ``_prefill_impl``.

* ``gluon_device_ok``: whether a device runs the Gluon kernels at all (checked once per device).
* ``gluon_page_geometry``: a paged K/V view as the 2-D TMA descriptors both kernels read pages through.

The kernels' shared-memory layouts (``kernel_layouts``) are kernel-side and live in ``kernels/_sm90_common.py``,
imported on first use (a Triton without Gluon's Hopper ops must still import this module).
"""

from __future__ import annotations

import torch

from . import _backend
from ._config import capability as _capability

# A TMA descriptor's row count has to stay below this (the kernels address rows with int32 coordinates).
_INT32_LIMIT = 2**31 - 1

_GLUON_OK: dict = {}  # device index -> bool


def gluon_device_ok(device: torch.device) -> bool:
    """An sm_90 GPU (exactly: wgmma and TMA as Gluon's Hopper ops emit them) and a Triton with those ops."""
    if _backend._INTERPRET or device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    ok = _GLUON_OK.get(key)
    if ok is None:
        ok = _capability(device) == (9, 0)
        if ok:
            try:
                from .kernels import decode_sm90, prefill_sm90  # noqa: F401
            except Exception:  # a Triton without Gluon's Hopper ops: the Triton kernels
                ok = False
        _GLUON_OK[key] = ok
    return ok


def gluon_page_geometry(k, v, d: int):
    """Paged K/V ``[pages, page_size, heads, D]`` (any of the cache forms) as 2-D descriptors: (row stride,
    rows, columns, rows per page, head row step, head column step); key ``slot`` of head ``h`` in page ``p``
    is row ``p * rows_per_page + h * head_row + slot``, column ``h * head_col``. None when K and V differ in
    strides or the strides do not allow it."""
    if k.stride() != v.stride() or k.shape != v.shape:
        return None
    sp, ss, sh, sd = k.stride()
    pages, ps, hkv, _ = k.shape
    item = k.element_size()
    if sd != 1 or k.data_ptr() % 16 or v.data_ptr() % 16:
        return None
    if sh == d and ss >= hkv * d and sp % ss == 0:  # NHD: a row = one slot's heads
        rs, rpp, hr, hc, cols = ss, sp // ss, 0, d, hkv * d
    elif ss == d and sp % d == 0 and sh % d == 0:  # HND: a row = one head's slot
        rs, rpp, hr, hc, cols = d, sp // d, sh // d, 0, d
    else:
        return None
    if (rs * item) % 16:
        return None
    rows = ((pages - 1) * sp + (ps - 1) * ss + (hkv - 1) * sh + d - 1) // rs + 1
    if rows >= _INT32_LIMIT:
        return None
    return rs, rows, cols, rpp, hr, hc


__all__ = ["gluon_device_ok", "gluon_page_geometry"]
