"""Target.Verify / Target.Release: parse, validate, hand a VerifyJob to the batching
scheduler (specdec.serving.model_service), encode."""

from __future__ import annotations

from concurrent.futures import Executor

import grpc
import torch

from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import DECODE_ROWS, MAX_DECODE_STEPS
from specdec.engine.steps import VerifyJob, VerifyOutput
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving import wire
from specdec.serving.grpc_server import Service
from specdec.serving.grpc_status import rpc_errors
from specdec.serving.model_service import BatchLimits, SessionTable
from specdec.settings import default
from specdec.telemetry import names
from specdec.telemetry.service import Telemetry

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, runner: ModelRunner, *, session_ttl_s: float = default("session-ttl-s"),
                 max_draft_tokens: int = default("max-draft-tokens"),
                 telemetry: Telemetry | None = None,
                 executor: Executor | None = None, limits: BatchLimits | None = None) -> None:
        self.runner = runner
        self.telemetry = telemetry or Telemetry("target")
        self.telemetry.watch_runner(runner)
        self.sessions = SessionTable(runner, session_ttl_s, executor=executor, limits=limits)
        self.telemetry.watch_scheduler(self.sessions.scheduler)
        self.sessions.runner_role = "target"
        self.max_draft_tokens = max_draft_tokens

    def service(self) -> Service:
        return Service(SERVICE_NAME,
                       lambda s: target_pb2_grpc.add_TargetServicer_to_server(self, s))

    @rpc_errors
    def Verify(self, request: target_pb2.VerifyRequest,
               context: grpc.ServicerContext) -> target_pb2.VerifyResponse:
        params = wire.sampling_from_proto(request.sampling)
        if not params.greedy and params.seed is None:
            raise InvalidRequest("sampling.seed is required: the caller fixes it once per "
                                 "request so draft and target draw from one stream")
        vocab = self.runner.vocab.target_vocab_size
        sync = wire.sync_from_proto(request.sync, vocab)
        draft_tokens = list(request.draft_tokens)
        if len(draft_tokens) > self.max_draft_tokens:
            raise InvalidRequest(f"draft_tokens holds {len(draft_tokens)} tokens, more than "
                                 f"{self.max_draft_tokens}")
        wire.check_token_ids(draft_tokens, vocab, "draft_tokens")
        alternatives = wire.alternatives_from_proto(request.alternatives, vocab,
                                                    len(draft_tokens))
        if len(alternatives) > DECODE_ROWS:
            raise InvalidRequest(f"alternatives holds {len(alternatives)} tokens, more than "
                                 f"{DECODE_ROWS}")
        hidden_dtype = wire.hidden_dtype(request.hidden_dtype)
        if request.decode_steps > MAX_DECODE_STEPS:
            raise InvalidRequest(f"decode_steps is {request.decode_steps}, more than "
                                 f"{MAX_DECODE_STEPS}")
        stop_token_ids = tuple(request.stop_token_ids)
        wire.check_token_ids(stop_token_ids, vocab, "stop_token_ids")

        def make_job() -> VerifyJob:
            # Tensor work stays on the model's thread (see BatchScheduler.submit).
            probs = None
            if draft_tokens and not params.greedy:
                probs = wire.decode_probs(request.draft_probs,
                                          len(alternatives.q_nodes(len(draft_tokens))), vocab)
                # Row j is the q chain token j was drawn from (rows of a tree's other
                # nodes follow; the tree's rule checks their children).
                drawn = probs[torch.arange(len(draft_tokens)), torch.tensor(draft_tokens)]
                if bool((drawn <= 0).any()):  # a token cannot come from a row excluding it
                    raise InvalidRequest("draft_probs gives probability 0 to a draft token")
            return VerifyJob(sync, draft_tokens, probs, params, request.return_hidden_states,
                             alternatives, tuple(request.hidden_layers),
                             request.decode_steps, stop_token_ids)

        def finish(job: VerifyJob) -> tuple[VerifyOutput, common_pb2.HiddenStates | None]:
            out = job.output()
            return out, (None if out.hidden is None
                         else wire.encode_hidden(out.hidden, hidden_dtype))

        (out, hidden), batch = self.sessions.call(sync.session_id, make_job, finish, context)
        self.telemetry.record_step(
            forward_s=out.forward_s, tokens_processed=out.tokens_processed,
            kv_length=out.kv_length, committed_position=sync.committed_position,
            catch_up_tokens=len(sync.append), batch=batch,
            attributes={names.ACCEPTED: out.verdict.accepted_len,
                        names.STEPS: 1 + len(out.decoded)})
        response = target_pb2.VerifyResponse(
            accepted_len=out.verdict.accepted_len, next_token=out.verdict.next_token,
            kv_length=out.kv_length, forward_seconds=out.forward_s,
            batch=batch.to_proto())
        response.kept_alternatives.extend(out.verdict.branch_path)
        response.decoded_tokens.extend(out.decoded)
        if hidden is not None:
            response.hidden_states.CopyFrom(hidden)
        return response

    @rpc_errors
    def Release(self, request: target_pb2.TargetReleaseRequest,
                context: grpc.ServicerContext) -> target_pb2.TargetReleaseResponse:
        return target_pb2.TargetReleaseResponse(released=self.sessions.release(request.session_id))
