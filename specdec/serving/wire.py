"""Core types <-> specdec.v1 messages, shared by the services and their clients.

q travels as raw little-endian float32 (bit-exact: the acceptance test must see the very
values the draft sampled from), either dense over the draft's columns or sparse
(ids + values) when top-k/top-p/min-p leave most of each row at 0; `encode_probs` picks
whichever is smaller. Everything that arrives from the network is checked here and
rejected with InvalidRequest naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specdec.core.history import SyncPoint
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import Alternatives
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2

_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


# -- sampling parameters ----------------------------------------------------------------
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                        top_p=params.top_p, min_p=params.min_p)
    if params.seed is not None:
        message.seed = params.seed
    return message


def sampling_from_proto(message: common_pb2.SamplingParams,
                        field: str = "sampling") -> SamplingParams:
    """Validated SamplingParams; top_p 0 means off, like 1."""
    top_p = 1.0 if message.top_p == 0 else message.top_p  # proto default 0 = off
    params = SamplingParams(temperature=message.temperature, top_k=message.top_k,
                            top_p=top_p, min_p=message.min_p,
                            seed=message.seed if message.HasField("seed") else None)
    try:
        params.validate()
    except ValueError as error:
        raise InvalidRequest(str(error).replace("sampling.", f"{field}.", 1)) from None
    return params


# -- sync points ------------------------------------------------------------------------
def sync_to_proto(sync: SyncPoint) -> common_pb2.SyncPoint:
    return common_pb2.SyncPoint(session_id=sync.session_id,
                                committed_position=sync.committed_position,
                                fingerprint=sync.fingerprint, append_tokens=sync.append,
                                prefill_length=sync.prefill_length)


def check_token_ids(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"{field}[{index}] = {token} is outside the vocabulary "
                                 f"[0, {vocab_size})")


def sync_from_proto(message: common_pb2.SyncPoint, vocab_size: int) -> SyncPoint:
    if not message.session_id:
        raise InvalidRequest("sync.session_id is required")
    tokens = list(message.append_tokens)
    check_token_ids(tokens, vocab_size, "sync.append_tokens")
    if message.prefill_length > len(tokens):
        raise InvalidRequest(f"sync.prefill_length = {message.prefill_length} exceeds the "
                             f"{len(tokens)} append_tokens")
    return SyncPoint(message.session_id, message.committed_position, message.fingerprint,
                     tokens, message.prefill_length if message.committed_position == 0 else 0)


# -- alternatives -----------------------------------------------------------------------
def alternatives_to_proto(alternatives: Alternatives) -> common_pb2.Alternatives:
    return common_pb2.Alternatives(tokens=alternatives.tokens, parents=alternatives.parents)


def alternatives_from_proto(message: common_pb2.Alternatives, vocab_size: int,
                            num_draft_tokens: int, field: str = "alternatives") -> Alternatives:
    """Checked token ids and one parent per token, each a node before it."""
    tokens = list(message.tokens)
    if len(message.parents) != len(tokens):
        raise InvalidRequest(f"{field} has {len(tokens)} tokens but {len(message.parents)} "
                             "parents: give one parent per token")
    check_token_ids(tokens, vocab_size, f"{field}.tokens")
    alternatives = Alternatives(tuple(tokens), tuple(message.parents))
    try:
        alternatives.check(num_draft_tokens)
    except ValueError as error:
        raise InvalidRequest(f"{field}.parents: {error}") from None
    return alternatives


# -- q ----------------------------------------------------------------------------------
def encode_probs(probs: torch.Tensor, column_ids: torch.Tensor | None = None
                 ) -> common_pb2.DraftProbs:
    """probs [rows, width] fp32; column j is target id column_ids[j] (default j)."""
    probs = probs.detach().to("cpu", torch.float32).contiguous()
    rows, width = probs.shape
    nonzero = probs > 0
    nnz = int(nonzero.sum())
    dense_bytes = 4 * rows * width + (4 * width if column_ids is not None else 0)
    if 8 * nnz < dense_bytes:
        row_index, col_index = nonzero.nonzero(as_tuple=True)  # row-major order
        ids = col_index if column_ids is None else column_ids.cpu()[col_index]
        return common_pb2.DraftProbs(sparse=common_pb2.SparseProbs(
            row_lengths=nonzero.sum(dim=1).tolist(),
            ids=ids.numpy().astype(_I32).tobytes(),
            values=probs[row_index, col_index].numpy().astype(_F32).tobytes()))
    dense = common_pb2.DenseProbs(num_rows=rows, values=probs.numpy().astype(_F32).tobytes())
    if column_ids is not None:
        dense.column_ids = column_ids.cpu().numpy().astype(_I32).tobytes()
    return common_pb2.DraftProbs(dense=dense)


def decode_probs(message: common_pb2.DraftProbs, num_rows: int, vocab_size: int,
                 field: str = "draft_probs") -> torch.Tensor:
    """Dense [num_rows, vocab_size] fp32 q; InvalidRequest on any inconsistency."""
    layout = message.WhichOneof("layout")
    if layout == "dense":
        dense = message.dense
        values = _floats(dense.values, f"{field}.dense.values")
        if dense.num_rows != num_rows or num_rows == 0 or values.numel() % num_rows:
            raise InvalidRequest(f"{field}.dense holds {values.numel()} values for "
                                 f"{dense.num_rows} rows; expected {num_rows} equal rows")
        width = values.numel() // num_rows
        rows = values.view(num_rows, width)
        if dense.column_ids:
            columns = _ints(dense.column_ids, f"{field}.dense.column_ids")
            if columns.numel() != width:
                raise InvalidRequest(f"{field}.dense.column_ids names {columns.numel()} "
                                     f"columns for rows of {width} values")
            _check_ids(columns, vocab_size, f"{field}.dense.column_ids")
            out = torch.zeros(num_rows, vocab_size, dtype=torch.float32)
            out[:, columns] = rows
        elif width > vocab_size:
            raise InvalidRequest(f"{field}.dense rows of {width} values exceed the "
                                 f"vocabulary of {vocab_size}")
        elif width == vocab_size:
            return rows  # the common case: same vocabulary, nothing to scatter
        else:
            out = torch.zeros(num_rows, vocab_size, dtype=torch.float32)
            out[:, :width] = rows
    elif layout == "sparse":
        sparse = message.sparse
        ids = _ints(sparse.ids, f"{field}.sparse.ids")
        values = _floats(sparse.values, f"{field}.sparse.values")
        lengths = torch.tensor(list(sparse.row_lengths), dtype=torch.long)
        if lengths.numel() != num_rows or int(lengths.sum()) != ids.numel() \
                or ids.numel() != values.numel():
            raise InvalidRequest(f"{field}.sparse: {lengths.numel()} rows of "
                                 f"{int(lengths.sum())} entries, {ids.numel()} ids and "
                                 f"{values.numel()} values; expected {num_rows} rows")
        _check_ids(ids, vocab_size, f"{field}.sparse.ids")
        out = torch.zeros(num_rows, vocab_size, dtype=torch.float32)
        out[torch.repeat_interleave(torch.arange(num_rows), lengths), ids] = values
    else:
        raise InvalidRequest(f"{field} is required for a sampled request with draft tokens")
    return out


# -- target hidden states ------------------------------------------------------------------
# HiddenStates.dtype -> bytes per value and the little-endian integer view that carries
# it (bfloat16 has no numpy type: its bits travel as uint16).
_HIDDEN_DTYPES: dict[str, tuple[torch.dtype, np.dtype[Any]]] = {
    "float16": (torch.float16, np.dtype("<u2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float32": (torch.float32, np.dtype("<u4"))}
_BITS = {2: torch.int16, 4: torch.int32}


def hidden_dtype(name: str) -> str:
    """The HiddenStates.dtype `name` means ("" is float16); InvalidRequest if unknown."""
    name = name or "float16"
    if name not in _HIDDEN_DTYPES:
        raise InvalidRequest(f"hidden state dtype must be one of {', '.join(_HIDDEN_DTYPES)}, "
                             f"got {name!r}")
    return name


def encode_hidden(hidden: torch.Tensor, dtype: str = "float16") -> common_pb2.HiddenStates:
    torch_dtype, carrier = _HIDDEN_DTYPES[hidden_dtype(dtype)]
    values = hidden.detach().to("cpu", torch_dtype).contiguous()
    bits = values.view(_BITS[carrier.itemsize]).numpy().astype(carrier)
    return common_pb2.HiddenStates(num_rows=hidden.shape[0], hidden_size=hidden.shape[1],
                                   values=bits.tobytes(),
                                   dtype="" if dtype == "float16" else dtype)


def decode_hidden(message: common_pb2.HiddenStates, num_rows: int, hidden_size: int,
                  field: str) -> torch.Tensor:
    """[num_rows, hidden_size] float32, checked against what the caller expects."""
    if (message.num_rows, message.hidden_size) != (num_rows, hidden_size):
        raise InvalidRequest(
            f"{field} must hold {num_rows} rows of {hidden_size} values (one per appended "
            f"token), got {message.num_rows} x {message.hidden_size}")
    dtype = hidden_dtype(message.dtype)
    torch_dtype, carrier = _HIDDEN_DTYPES[dtype]
    if len(message.values) != carrier.itemsize * num_rows * hidden_size:
        raise InvalidRequest(f"{field}.values must be {num_rows * hidden_size} {dtype} "
                             f"values, got {len(message.values)} bytes")
    bits = np.frombuffer(message.values, dtype=carrier).astype(carrier.newbyteorder("="))
    values = torch.from_numpy(bits.view(f"i{carrier.itemsize}")).view(torch_dtype)
    hidden = values.float().reshape(num_rows, hidden_size)
    if not bool(torch.isfinite(hidden).all()):
        raise InvalidRequest(f"{field} must be finite")
    return hidden


def _floats(raw: bytes, field: str) -> torch.Tensor:
    if len(raw) % 4:
        raise InvalidRequest(f"{field} must be whole float32 values")
    values = torch.from_numpy(np.frombuffer(raw, dtype=_F32).astype(np.float32))
    # One pass: NaN fails `>= 0`, and +inf is the only value left to exclude.
    if not bool((values >= 0).all()) or bool(torch.isinf(values).any()):
        raise InvalidRequest(f"{field} must be finite and non-negative")
    return values


def _ints(raw: bytes, field: str) -> torch.Tensor:
    if len(raw) % 4:
        raise InvalidRequest(f"{field} must be whole int32 values")
    return torch.from_numpy(np.frombuffer(raw, dtype=_I32).astype(np.int64))


def _check_ids(ids: torch.Tensor, vocab_size: int, field: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequest(f"{field} must be token ids in [0, {vocab_size})")
