"""Sampling parameters reject what the sampler cannot use, naming the field."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import FLOAT_FIELDS, SamplingParams


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_floats_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_every_float_field_is_checked():
    """A float field added later must join FLOAT_FIELDS."""
    floats = {name for name, kind in SamplingParams.__annotations__.items() if kind == "float"}
    assert floats == set(FLOAT_FIELDS)
