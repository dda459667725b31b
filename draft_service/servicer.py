"""Draft.Propose / Draft.Release: parse, validate, hand a DraftJob to the batching
scheduler (specdec.serving.model_service: draft steps in lockstep with other proposals),
encode q."""

from __future__ import annotations

from concurrent.futures import Executor

import grpc

from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.engine.steps import DraftJob, DraftOutput
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving import wire
from specdec.serving.grpc_server import Service
from specdec.serving.grpc_status import rpc_errors
from specdec.serving.model_service import BatchLimits, SessionTable
from specdec.settings import default
from specdec.telemetry.service import Telemetry

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, runner: ModelRunner, *, session_ttl_s: float = default("session-ttl-s"),
                 max_draft_tokens: int = default("max-draft-tokens"),
                 telemetry: Telemetry | None = None,
                 precision: str = "", executor: Executor | None = None,
                 limits: BatchLimits | None = None) -> None:
        self.runner = runner
        self.precision = precision  # specdec.engine.draft_precision.Choice.describe()
        self.telemetry = telemetry or Telemetry("draft")
        self.telemetry.watch_runner(runner)
        self.sessions = SessionTable(runner, session_ttl_s, executor=executor, limits=limits)
        self.telemetry.watch_scheduler(self.sessions.scheduler)
        self.sessions.runner_role = "draft"
        self.max_draft_tokens = max_draft_tokens

    def service(self) -> Service:
        return Service(SERVICE_NAME, lambda s: draft_pb2_grpc.add_DraftServicer_to_server(self, s))

    @rpc_errors
    def Propose(self, request: draft_pb2.ProposeRequest,
                context: grpc.ServicerContext) -> draft_pb2.ProposeResponse:
        params = wire.sampling_from_proto(request.sampling)
        if not params.greedy and params.seed is None:
            raise InvalidRequest("sampling.seed is required: the caller fixes it once per "
                                 "request so draft and target draw from one stream")
        sync = wire.sync_from_proto(request.sync, self.runner.vocab.target_vocab_size)
        if not 1 <= request.num_tokens <= self.max_draft_tokens:
            raise InvalidRequest(f"num_tokens must be in [1, {self.max_draft_tokens}], "
                                 f"got {request.num_tokens}")
        if not 0.0 <= request.min_confidence <= 1.0:
            raise InvalidRequest(f"min_confidence must be in [0, 1], got {request.min_confidence}")
        if not 0 <= request.num_alternatives <= DECODE_ROWS:
            raise InvalidRequest(f"num_alternatives must be in [0, {DECODE_ROWS}], got "
                                 f"{request.num_alternatives}")
        if request.max_alternative_depth < 0:
            raise InvalidRequest(f"max_alternative_depth must be 0 (no limit) or more, got "
                                 f"{request.max_alternative_depth}")
        if self.runner.needs_target_hidden and not request.HasField("target_hidden_states"):
            raise InvalidRequest(
                "this draft reads the target's hidden states: send target_hidden_states "
                "(one row per sync.append_tokens token; see Describe)")
        if not self.runner.needs_target_hidden and request.HasField("target_hidden_states"):
            raise InvalidRequest("target_hidden_states given to a draft that does not read "
                                 "them (Describe reports target_hidden_size 0)")

        def make_job() -> DraftJob:
            # Tensor work stays on the model's thread (see BatchScheduler.submit).
            target_hidden = None
            if self.runner.needs_target_hidden:
                target_hidden = wire.decode_hidden(
                    request.target_hidden_states, len(sync.append),
                    self.runner.target_hidden_size, "target_hidden_states")
            return DraftJob(self.runner, sync, request.num_tokens, params,
                            request.min_confidence, target_hidden, request.num_alternatives,
                            request.max_alternative_depth)

        def finish(job: DraftJob) -> tuple[DraftOutput, common_pb2.DraftProbs | None]:
            out = job.output()
            # Rows are over the draft's own columns; the token map (if any) names them.
            probs = (None if out.probs is None
                     else wire.encode_probs(out.probs, self.runner.vocab.token_map))
            return out, probs

        (out, probs), batch = self.sessions.call(sync.session_id, make_job, finish, context)
        # Catch-up tokens in one forward, then one step per further draft token.
        self.telemetry.record_step(
            forward_s=out.forward_s, tokens_processed=len(sync.append) + len(out.tokens) - 1,
            kv_length=out.kv_length, committed_position=sync.committed_position,
            catch_up_tokens=len(sync.append), batch=batch)
        response = draft_pb2.ProposeResponse(tokens=out.tokens, kv_length=out.kv_length,
                                             forward_seconds=out.forward_s,
                                             batch=batch.to_proto())
        if out.alternatives:
            response.alternatives.CopyFrom(wire.alternatives_to_proto(out.alternatives))
        if probs is not None:
            response.probs.CopyFrom(probs)
        return response

    @rpc_errors
    def Describe(self, request: draft_pb2.DescribeRequest,
                 context: grpc.ServicerContext) -> draft_pb2.DescribeResponse:
        reader = self.runner.hidden_reader
        response = draft_pb2.DescribeResponse(target_hidden_size=self.runner.target_hidden_size,
                                              precision=self.precision)
        if reader is not None:
            response.target_hidden_layers.extend(reader.spec.layers)
            response.hidden_dtype = reader.spec.wire_dtype
        return response

    @rpc_errors
    def Release(self, request: draft_pb2.DraftReleaseRequest,
                context: grpc.ServicerContext) -> draft_pb2.DraftReleaseResponse:
        return draft_pb2.DraftReleaseResponse(released=self.sessions.release(request.session_id))
