"""Conversions between the wire messages (``splitserve.v1``) and engine / kvtransfer types.

Torch-free, so the router can use it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from engine.constraint import Constraint, ConstraintKind, ConstraintLimits
from engine.grammar_pool import GrammarPool
from engine.sampling_params import SamplingParams
from kvtransfer.base import KVRef, PeerInfo
from splitserve.v1 import router_pb2, worker_pb2

if TYPE_CHECKING:
    from engine.sampler import TokenLogprobs
    from engine.stats import EngineStats

FINISH_REASONS = {
    None: router_pb2.FINISH_REASON_UNSPECIFIED,
    "": router_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": router_pb2.FINISH_REASON_STOP,
    "length": router_pb2.FINISH_REASON_LENGTH,
    "abort": router_pb2.FINISH_REASON_ABORT,
    "tool_calls": router_pb2.FINISH_REASON_TOOL_CALLS,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items() if k}
# The budget the router validates constraints in: the one the workers compile them in (their
# default ConstraintLimits).
CONSTRAINT_LIMITS = ConstraintLimits()
# The router's validations of constraints: off the event loop and the threads that prepare
# requests.
_VALIDATIONS: GrammarPool[None] = GrammarPool(Constraint.validate, CONSTRAINT_LIMITS)


def sampling_params_from_client(msg: router_pb2.SamplingParams) -> SamplingParams:
    """Engine params from a client's message (unset fields take the engine defaults).

    Raises ``ValueError`` naming the field, as ``SamplingParams`` validation does. The
    constraint is built, not validated: see ``validate_client_constraint``.
    """
    defaults = SamplingParams()
    constraint = constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else defaults.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        repetition_penalty=(
            msg.repetition_penalty
            if msg.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        presence_penalty=(
            msg.presence_penalty if msg.HasField("presence_penalty") else defaults.presence_penalty
        ),
        frequency_penalty=(
            msg.frequency_penalty
            if msg.HasField("frequency_penalty")
            else defaults.frequency_penalty
        ),
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=constraint,
    )


async def validate_client_constraint(constraint: Constraint | None) -> None:
    """``ValueError`` naming the field (``constraint.<kind>: ...``) when a client's
    ``constraint`` is over its budget of size or time, or does not compile, so that it never
    reaches a worker. The event loop runs on meanwhile (the check runs on the shared
    validation threads, for up to the budget's ``compile_timeout_s``)."""
    if constraint is None:
        return
    try:
        await _VALIDATIONS.wait(constraint)
    except ValueError as exc:
        raise ValueError(f"constraint.{exc}") from None


def constraint_from_proto(msg: worker_pb2.OutputConstraint) -> Constraint:
    """Raises ``ValueError`` naming the field when no kind is set or a choice list is empty
    (the constraint itself is checked by ``Constraint.validate``)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("constraint: set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError("constraint.json_object: must be true when set")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        if not msg.choice.choices:
            raise ValueError("constraint.choice: needs at least one choice")
        return Constraint(ConstraintKind.CHOICE, choices=tuple(msg.choice.choices))
    return Constraint(ConstraintKind(kind), getattr(msg, kind))


def constraint_to_proto(constraint: Constraint) -> worker_pb2.OutputConstraint:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return worker_pb2.OutputConstraint(json_object=True)
    if kind is ConstraintKind.CHOICE:
        choices = worker_pb2.ChoiceList(choices=constraint.choices)
        return worker_pb2.OutputConstraint(choice=choices)
    msg = worker_pb2.OutputConstraint()
    setattr(msg, kind.value, constraint.spec)  # json_schema, regex or grammar: a string each
    return msg


# The sampling fields that a worker's message carries as they are (the same name and value).
_SCALAR_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
)


def sampling_params_to_worker(params: SamplingParams) -> worker_pb2.WorkerSamplingParams:
    """The model-facing part of ``params``; stop strings stay with the router."""
    msg = worker_pb2.WorkerSamplingParams(
        **{name: getattr(params, name) for name in _SCALAR_SAMPLING_FIELDS},
        stop_token_ids=params.stop_token_ids,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return msg


def sampling_params_from_worker(msg: worker_pb2.WorkerSamplingParams) -> SamplingParams:
    """Raises ``ValueError`` naming the field on a bad value."""
    return SamplingParams(
        **{name: getattr(msg, name) for name in _SCALAR_SAMPLING_FIELDS},
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=(constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None),
    )


def logprobs_to_proto(logprobs: TokenLogprobs) -> worker_pb2.TokenLogprob:
    return worker_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top=[worker_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def peer_info_to_proto(info: PeerInfo) -> worker_pb2.KVPeerInfo:
    return worker_pb2.KVPeerInfo(**field_values(info, PeerInfo))


def peer_info_from_proto(msg: worker_pb2.KVPeerInfo) -> PeerInfo:
    return PeerInfo(**field_values(msg, PeerInfo))


def kv_ref_to_proto(ref: KVRef) -> worker_pb2.KVRef:
    return worker_pb2.KVRef(**field_values(ref, KVRef))


def kv_ref_from_proto(msg: worker_pb2.KVRef) -> KVRef:
    fields = field_values(msg, KVRef)
    return KVRef(**{**fields, "block_ids": tuple(msg.block_ids)})


def field_values(source: object, dataclass_type: type) -> dict[str, Any]:
    """``source``'s values of ``dataclass_type``'s fields, by name: ``source`` is an instance,
    or a message that names those fields alike (so that either converts into the other)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(dataclass_type)}


def load_to_proto(
    stats: EngineStats,
    *,
    num_kv_leases: int = 0,
    num_transfers_failed: int = 0,
    num_leases_expired: int = 0,
    shutting_down: bool = False,
) -> worker_pb2.WorkerLoad:
    # The engine's figures are named as the message's fields (kv_usage is a property).
    from_stats = {
        f.name: getattr(stats, f.name)
        for f in worker_pb2.WorkerLoad.DESCRIPTOR.fields
        if hasattr(stats, f.name)
    }
    return worker_pb2.WorkerLoad(
        **from_stats,
        num_kv_leases=num_kv_leases,
        num_transfers_failed=num_transfers_failed,
        num_leases_expired=num_leases_expired,
        shutting_down=shutting_down,
    )
