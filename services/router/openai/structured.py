"""Structured output in the HTTP API: OpenAI's ``response_format`` and vLLM's extensions, as
the ``OutputConstraint`` of the router's ``SamplingParams``.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``.
- vLLM's ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
  ``guided_choice`` (strings), ``guided_grammar`` (Lark), and ``structured_outputs`` (an object
  with one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``).

At most one may be set (a 400 names the second). A constraint over the size budget
(``CONSTRAINT_LIMITS``: too many choices, too long a spec) is refused here, naming the client's
field, before any protobuf is built from it: a huge ``guided_choice`` costs its parse and
nothing more. The constraint itself (a schema that does not compile, a bad regex) is checked by
the router, as for gRPC: the same 400 names ``sampling.constraint``.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.convert import CONSTRAINT_LIMITS
from services.router.openai.errors import bad_request
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.v1 import worker_pb2

_STRUCTURED_OUTPUTS_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def output_constraint(
    body: ChatCompletionRequest | CompletionRequest,
) -> worker_pb2.OutputConstraint | None:
    """The request's constraint (None: unconstrained); ``OpenAIError`` 400 naming the field
    when it is malformed or more than one is given."""
    given: list[tuple[str, worker_pb2.OutputConstraint]] = []
    if body.response_format is not None:
        constraint = _from_response_format(body.response_format)
        if constraint is not None:
            given.append(("response_format", constraint))
    if body.guided_json is not None:
        given.append(("guided_json", _json_schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        regex = _spec_text(body.guided_regex, "guided_regex")
        given.append(("guided_regex", worker_pb2.OutputConstraint(regex=regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", _choice_list(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        grammar = _spec_text(body.guided_grammar, "guided_grammar")
        given.append(("guided_grammar", worker_pb2.OutputConstraint(grammar=grammar)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    if len(given) > 1:
        names = [name for name, _ in given]
        raise bad_request(f"{names[1]}: only one output constraint per request; got {names}")
    return given[0][1] if given else None


def _from_response_format(value: dict[str, Any]) -> worker_pb2.OutputConstraint | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return worker_pb2.OutputConstraint(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format.json_schema: an object with the schema under 'schema' is required",
                "response_format.json_schema",
            )
        return _json_schema(spec["schema"], "response_format.json_schema.schema")
    raise bad_request(
        f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
        "response_format.type",
    )


def _from_structured_outputs(value: dict[str, Any]) -> worker_pb2.OutputConstraint:
    kinds = [k for k in _STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(
            f"structured_outputs: set exactly one of {list(_STRUCTURED_OUTPUTS_KINDS)}; "
            f"got {kinds}",
            "structured_outputs",
        )
    kind = kinds[0]
    spec = value[kind]
    if kind == "json":
        return _json_schema(spec, "structured_outputs.json")
    if kind == "json_object":
        return worker_pb2.OutputConstraint(json_object=True)
    if kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise bad_request(
                "structured_outputs.choice: a list of strings", "structured_outputs.choice"
            )
        return _choice_list(spec, "structured_outputs.choice")
    if not isinstance(spec, str):
        raise bad_request(f"structured_outputs.{kind}: a string", f"structured_outputs.{kind}")
    constraint = worker_pb2.OutputConstraint()
    setattr(constraint, kind, _spec_text(spec, f"structured_outputs.{kind}"))  # regex or grammar
    return constraint


def _json_schema(schema: Any, param: str) -> worker_pb2.OutputConstraint:
    """A schema given as an object or as JSON text."""
    if isinstance(schema, str):
        return worker_pb2.OutputConstraint(json_schema=_spec_text(schema, param))
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema object", param)
    return worker_pb2.OutputConstraint(json_schema=_spec_text(json.dumps(schema), param))


def _choice_list(choices: list[str], param: str) -> worker_pb2.OutputConstraint:
    max_choices = CONSTRAINT_LIMITS.max_choices
    if len(choices) > max_choices:
        raise bad_request(f"{param}: {len(choices)} choices, more than {max_choices}", param)
    return worker_pb2.OutputConstraint(choice=worker_pb2.ChoiceList(choices=choices))


def _spec_text(text: str, param: str) -> str:
    num_bytes = len(text.encode())
    if num_bytes > CONSTRAINT_LIMITS.max_bytes:
        raise bad_request(
            f"{param}: {num_bytes} bytes, more than {CONSTRAINT_LIMITS.max_bytes}", param
        )
    return text
