"""Structured output through real clusters over gRPC: the constrained greedy output is the
offline engine's, colocated and disaggregated over each KV transfer backend (the prefill worker
samples the first token under the constraint, the decode worker's matcher is advanced over it),
after its decode worker is killed mid-stream (the next one is advanced over every token sent),
and under preemptions on the decode worker; every output satisfies its constraint and ends
with ``stop``, and a bad constraint (or one over the constraint budget) is ``INVALID_ARGUMENT``
at the router, naming the field, with no worker involved."""

from __future__ import annotations

import json
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.constraint import Constraint, ConstraintKind
from kvtransfer.registry import available_backends
from loadtest.fixtures.schemas import random_schema
from services.common.convert import constraint_to_proto
from splitserve.v1 import router_pb2, worker_pb2
from tests.services.conftest import NUM_KV_BLOCKS, greedy

MAX_TOKENS = 200
SCHEMAS = [random_schema(random.Random(seed)) for seed in range(8)]
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
CHOICES = ("approve", "reject", "escalate to a human")
PLACES = ["colocated"] + [
    f"disaggregated-{name}" for name in available_backends() if name != "inproc"
]


def constraints() -> list[Constraint]:
    schemas = [Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(s)) for s in SCHEMAS]
    return [
        *schemas,
        Constraint(ConstraintKind.REGEX, REGEX),
        Constraint(ConstraintKind.CHOICE, choices=CHOICES),
    ]


def prompt(i: int) -> list[int]:
    rng = random.Random(100 + i)
    return [rng.randrange(3, 400) for _ in range(20 + 3 * i)]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> list[list[int]]:
    """The offline engine's constrained greedy token ids, one per constraint."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, constraint=c) for c in constraints()
    ]
    outputs = llm.generate([prompt(i) for i in range(len(params))], params)
    assert all(o.finish_reason == "stop" for o in outputs)
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module", params=PLACES)
def client(request, start_cluster):
    if request.param == "colocated":
        _, client = start_cluster(num_prefill=0, num_decode=1, mode="colocated")
    else:
        backend = request.param.removeprefix("disaggregated-")
        _, client = start_cluster(
            num_prefill=1, num_decode=1, extra_worker_flags=("--kv-transfer", backend)
        )
    return client


def test_constrained_greedy_output_is_the_offline_engines_and_satisfies_it(client, offline):
    for i, (constraint, want) in enumerate(zip(constraints(), offline, strict=True)):
        sampling = greedy(MAX_TOKENS)
        sampling.constraint.CopyFrom(constraint_to_proto(constraint))
        got = client.generate(token_ids=prompt(i), sampling=sampling)
        assert got.token_ids == want, constraint
        assert got.last.finish_reason == router_pb2.FINISH_REASON_STOP
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            jsonschema.validate(json.loads(got.text), SCHEMAS[i])
        elif constraint.kind is ConstraintKind.REGEX:
            assert re.fullmatch(REGEX, got.text), got.text
        else:
            assert got.text in CHOICES


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (worker_pb2.OutputConstraint(json_schema="{not json"), "sampling.constraint.json_schema"),
        (worker_pb2.OutputConstraint(regex="(unclosed"), "sampling.constraint.regex"),
        (worker_pb2.OutputConstraint(grammar="start: nowhere"), "sampling.constraint.grammar"),
        (worker_pb2.OutputConstraint(choice=worker_pb2.ChoiceList()), "at least one choice"),
        (worker_pb2.OutputConstraint(), "set one of json_schema"),
        (
            worker_pb2.OutputConstraint(
                choice=worker_pb2.ChoiceList(choices=[f"c{i}" for i in range(100_000)])
            ),
            "sampling.constraint.choice: 100000 choices, more than 10000",
        ),
    ],
    ids=["json", "regex", "grammar", "no_choices", "no_kind", "too_many_choices"],
)
def test_a_bad_constraint_is_invalid_argument_at_the_router(client, constraint, message):
    sampling = greedy(8)
    sampling.constraint.CopyFrom(constraint)
    with pytest.raises(grpc.RpcError) as error:
        client.generate(token_ids=prompt(0), sampling=sampling)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    # Nothing else was harmed: the next request is served.
    assert len(client.generate(token_ids=prompt(1), sampling=greedy(3)).token_ids) == 3


LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "maxLength": 12},
    "minItems": 10,
    "maxItems": 10,
}


def long_constrained(max_tokens: int = 300) -> tuple[SamplingParams, router_pb2.SamplingParams]:
    """The same long JSON constraint as engine params (the reference) and as gRPC params."""
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(LONG_SCHEMA))
    engine = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
    sampling = greedy(max_tokens)
    sampling.constraint.CopyFrom(constraint_to_proto(constraint))
    return engine, sampling


def test_a_constrained_stream_migrates_when_its_decode_worker_dies(start_cluster, tiny_llama_dir):
    local, client = start_cluster(num_prefill=1, num_decode=2)
    engine_params, sampling = long_constrained()
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    want = llm.generate([prompt(3)], engine_params)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) > 30
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=prompt(3), sampling=sampling), timeout=120
    )
    token_ids: list[int] = []
    text = ""
    killed = False
    for message in call:
        token_ids.extend(message.token_ids)
        text += message.text
        if not killed and len(token_ids) >= 15:
            busy = [w for w in client.status().workers if w.role == 2 and w.load.num_running]
            victim = next(p for p in local.workers("decode") if p.address == busy[0].address)
            victim.signal(signal.SIGKILL)
            killed = True
    assert killed and token_ids == want.token_ids
    jsonschema.validate(json.loads(text), LONG_SCHEMA)


def test_constrained_output_is_unchanged_by_preemptions_on_the_decode_worker(
    start_cluster, tiny_llama_dir
):
    # 24 blocks of 16 tokens on each worker: six long streams preempt one another.
    flags = ("--num-kv-blocks", "24", "--max-model-len", "352")
    _, client = start_cluster(num_prefill=1, num_decode=1, extra_worker_flags=flags)
    engine_params, sampling = long_constrained()
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    prompts = [prompt(i) for i in range(6)]
    want = [o.token_ids for o in llm.generate(prompts, [engine_params] * len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(
            pool.map(lambda p: client.generate(token_ids=p, sampling=sampling).token_ids, prompts)
        )
    assert got == want
    decode = next(w for w in client.status().workers if w.role == 2)
    assert decode.load.num_preemptions > 0
