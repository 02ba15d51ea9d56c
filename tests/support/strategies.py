"""Hypothesis strategies the property tests share: TOML keys and values, and recipe-shaped data
(every key a table, an array of tables or a value, the same at a path in every file)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# A bare TOML key, as recipes write them (no quoting needed).
keys = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)

# Text of any kind that TOML can hold in a string: every code point but surrogates and NUL
# (recipes refuse a NUL byte).
texts = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)

scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),  # TOML's integers are 64-bit
    st.floats(allow_nan=False),  # NaN is no value a recipe could compare equal to
    texts,
)

# Any TOML value: scalars, arrays (TOML 1.0 allows mixed types) and inline tables.
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=6,
)


def same(a: Any, b: Any) -> bool:
    """Equal as TOML values: types included (True is not 1, 1 is not 1.0)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# A shape: for each key, "value", "tables" (an array of tables, like [[eval]]) or a nested shape.
shapes = st.recursive(
    st.dictionaries(keys, st.sampled_from(["value", "tables"]), min_size=1, max_size=4),
    lambda inner: st.dictionaries(keys, st.one_of(st.sampled_from(["value", "tables"]), inner), min_size=1, max_size=4),
    max_leaves=10,
)


@st.composite
def shaped(draw: st.DrawFn, shape: dict[str, Any]) -> dict[str, Any]:
    """Data of ``shape``: a subset of its keys, each holding a value of its kind (an array of
    tables is never empty: ``eval = []`` says "clear", a different rule)."""
    out: dict[str, Any] = {}
    for key, kind in shape.items():
        if not draw(st.booleans()):
            continue
        if kind == "value":
            out[key] = draw(scalars)
        elif kind == "tables":
            out[key] = draw(st.lists(st.dictionaries(keys, scalars, max_size=2), min_size=1, max_size=2))
        else:
            out[key] = draw(shaped(kind))
    return out
