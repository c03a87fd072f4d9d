"""Random JSON schemas for structured-output tests and benchmarks: nested objects, arrays,
enums, bounded integers and numbers, strings with a length bound or a pattern. Every schema
bounds its output (a sampler under the constraint ends whatever its logits)."""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Objects, arrays, enums, bounded numbers and strings with patterns, nested."""
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10.0, "maximum": 10.0}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[0-9]{3}-[A-Z]{2}$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": 3}
    names = rng.sample(["id", "name", "tags", "score", "kind", "meta"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": names,
        "additionalProperties": False,
    }
