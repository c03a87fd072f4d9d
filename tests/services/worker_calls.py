"""Calling a prefill and a decode worker directly, as the router does: a prefill, then a decode
that pulls its KV."""

from __future__ import annotations

import grpc

from engine import SamplingParams
from services.common.convert import sampling_params_to_worker
from services.service_process import ServiceProcess
from splitserve.v1 import worker_pb2, worker_pb2_grpc


class Workers:
    """Direct gRPC stubs of one prefill and one decode worker process."""

    def __init__(self, prefill: ServiceProcess, decode: ServiceProcess) -> None:
        self.prefill_process = prefill
        self._channels = [grpc.insecure_channel(p.address) for p in (prefill, decode)]
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self._channels[0])
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self._channels[1])

    def prefill_then_decode(
        self, request_id: str, prompt: list[int], max_tokens: int
    ) -> tuple[list[int], worker_pb2.DecodeResponse]:
        """Prefill on the prefill worker, then decode with its KV; all tokens and the last
        decode message."""
        sampling = sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=max_tokens))
        first = self.prefill_only(request_id, prompt, max_tokens)
        return self.decode_with(request_id, prompt, sampling, first)

    def prefill_only(
        self, request_id: str, prompt: list[int], max_tokens: int
    ) -> worker_pb2.PrefillResponse:
        sampling = sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=max_tokens))
        request = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling
        )
        return self.prefill.Prefill(request, timeout=30)

    def decode_with(
        self,
        request_id: str,
        prompt: list[int],
        sampling: worker_pb2.WorkerSamplingParams,
        first: worker_pb2.PrefillResponse,
    ) -> tuple[list[int], worker_pb2.DecodeResponse]:
        request = worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=[first.token_id],
            sampling=sampling,
            kv_ref=first.kv_ref,
            kv_peer=first.kv_peer,
        )
        token_ids = [first.token_id]
        last = None
        for last in self.decode.Decode(request, timeout=60):
            token_ids.extend(last.token_ids)
        assert last is not None and last.finished
        return token_ids, last

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
