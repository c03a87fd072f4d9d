"""``splitserve client``: stream one generation from a router to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from services.common.convert import FINISH_REASON_NAMES
from services.common.router_channel import (
    add_router_credential_flags,
    open_router_channel,
    router_credentials,
)
from services.startup import ClusterNotReady, WaitMessages, wait_for_cluster
from splitserve.v1 import router_pb2, router_pb2_grpc

_RETRY_INTERVAL_S = 0.5


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``client``'s flags on its sub-parser."""
    parser.add_argument("prompt", help="prompt text (the user message with --chat)")
    parser.add_argument("--target", default="127.0.0.1:50051", help="router host:port")
    parser.add_argument("--chat", action="store_true", help="send as a chat message")
    parser.add_argument(
        "--model",
        default="",
        help="a served model (default: the router's) or a LoRA adapter of one",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="deadline of the call, including waiting for a router and workers still starting",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_router_credential_flags(parser)
    parser.set_defaults(func=run)


def build_request(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    sampling = router_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    for name in ("top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = router_pb2.GenerateRequest(sampling=sampling, model=args.model)
    if args.chat:
        request.messages.append(router_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        request.prompt = args.prompt
    return request


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    start_s = time.perf_counter()
    deadline_s = time.monotonic() + args.timeout_s
    first_token_s: float | None = None
    token_ids: list[int] = []
    text: list[str] = []
    last: router_pb2.GenerateResponse | None = None
    messages = WaitMessages(sys.stderr)
    may_read_status = True
    with open_router_channel(args.target, **router_credentials(args)) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            try:
                if may_read_status:
                    wait_for_cluster(stub, args.target, deadline_s, messages)
            except ClusterNotReady as exc:
                print(f"error: not serving after {args.timeout_s:g} s: {exc}", file=sys.stderr)
                return 2
            except grpc.RpcError as exc:
                # A data key may not read Status: wait through Generate's retries instead.
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                    return 2
                may_read_status = False
            try:
                calls = stub.Generate(
                    request, timeout=max(deadline_s - time.monotonic(), 0.0), wait_for_ready=True
                )
                for message in calls:
                    if first_token_s is None and message.token_ids:
                        first_token_s = time.perf_counter() - start_s
                    token_ids.extend(message.token_ids)
                    text.append(message.text)
                    if not args.json:
                        sys.stdout.write(message.text)
                        sys.stdout.flush()
                    last = message
                break
            except grpc.RpcError as exc:
                # UNAVAILABLE before anything streamed: the request was never admitted (its
                # decode worker went away after the check above), so it is sent again.
                retry = exc.code() == grpc.StatusCode.UNAVAILABLE and last is None
                if retry and time.monotonic() + _RETRY_INTERVAL_S < deadline_s:
                    messages.show(f"{exc.code().name}: {exc.details()}")
                    time.sleep(_RETRY_INTERVAL_S)
                    continue
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 2
    last = last or router_pb2.GenerateResponse()
    if args.json:
        print(
            json.dumps(
                {
                    "request_id": last.request_id,
                    "token_ids": token_ids,
                    "text": "".join(text),
                    "finish_reason": FINISH_REASON_NAMES.get(last.finish_reason),
                    "usage": {
                        "prompt_tokens": last.usage.prompt_tokens,
                        "completion_tokens": last.usage.completion_tokens,
                        "cached_tokens": last.usage.cached_tokens,
                    },
                    "ttft_s": round(first_token_s, 4) if first_token_s is not None else None,
                    "elapsed_s": round(time.perf_counter() - start_s, 4),
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
