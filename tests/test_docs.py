"""The Examples blocks of the public docstrings run on the CPU and print what they claim."""

from __future__ import annotations

import doctest

import pytest

import flashinfer_triton as fi


@pytest.mark.parametrize(
    "module", [fi.decode, fi.prefill, fi.cascade, fi.page, fi.quantization], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
