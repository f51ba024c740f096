"""The environment variables the library reads: this module is the only one that reads any.

They are read once, at import, so set them before ``import flashinfer_triton``:

``TRITON_INTERPRET``
    ``1``: CPU tensors run the Triton kernels in Triton's interpreter (CI's kernel tests); otherwise CPU
    tensors take the PyTorch path. Triton itself reads it too.
``FLASHINFER_TRITON_GLUON``
    ``0``: the Triton kernels for every variant, also on Hopper (no Gluon decode / prefill kernels).
    Default ``1``.
``FLASHINFER_TRITON_FAST_LAUNCH``
    ``0``: every kernel through Triton's own launcher instead of the cached direct launch (``_launch``).
    Default ``1``.
"""

from __future__ import annotations

import os


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) not in ("", "0")


INTERPRET: bool = _flag("TRITON_INTERPRET", "0")
GLUON: bool = _flag("FLASHINFER_TRITON_GLUON", "1")
FAST_LAUNCH: bool = _flag("FLASHINFER_TRITON_FAST_LAUNCH", "1")

__all__ = ["INTERPRET", "GLUON", "FAST_LAUNCH"]
