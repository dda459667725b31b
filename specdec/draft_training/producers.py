"""Producers of labelled contexts for streaming distillation.

A labelled context is the record `train._loss` consumes: prompt_ids, new_ids (the text
the draft learns to continue) and, at each position of new_ids, the target's T=1
distribution as its top-k target ids and probabilities (`train._loss` restricts it to the
draft vocabulary). Two producers make them:

- `DraftWrittenProducer`: the draft samples the answers (it is small, so this is quick)
  and the target scores the whole text in one forward, as DistillSpec does: the draft
  learns on the text it writes itself.
- `TargetDecodingProducer`: the target writes the answers and its distribution at each
  step is the label, decoded either with transformers' `generate` or with the project's
  batched runner (`ModelRunner.extend_batch`, one packed forward per step). For an
  EAGLE-3 draft it also keeps the inputs of the layers the draft reads (`aux_states`, at
  every position), labels and states both from one scoring forward after `generate`.

Which is faster is measured by `measure_producers` (docs/models.md has the figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from specdec.core.history import TokenHistory
from specdec.draft_training.stream_prompts import Context
from specdec.draft_training.train import Record, right_pad
from specdec.engine.extend import ExtendRequest
from specdec.engine.hidden_states import Capture
from specdec.engine.runner import ModelRunner
from specdec.engine.token_map import input_rows


def top_k_labels(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The T=1 distribution of each row of logits as (ids int32, probs float16), top k,
    on the CPU (records live there, whatever device the model runs on)."""
    top = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu()


def cut_at(ids: list[int], end: int) -> list[int]:
    """ids up to and including the first `end`."""
    return ids[: ids.index(end) + 1] if end in ids else ids


def make_record(kind: str, temperature: float, prompt_ids: list[int], new_ids: list[int],
                top_ids: torch.Tensor, top_probs: torch.Tensor) -> Record:
    return {"prompt_ids": torch.tensor(prompt_ids, dtype=torch.int32),
            "new_ids": torch.tensor(new_ids, dtype=torch.int32),
            "topk_ids": top_ids, "topk_probs": top_probs,
            "kind": kind, "temperature": temperature}  # type: ignore[dict-item]


def target_aux_states(target: PreTrainedModel, layers: tuple[int, ...],
                      ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state [B, T, H], the inputs of `layers` side by side [B, T, n*H])
    from one forward of the target's decoder. Only this thread's forward is kept: the
    trainer measures while the producer's thread runs the same target."""
    capture = Capture(target, layers, this_thread_only=True)
    try:
        last = target.model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    finally:
        capture.remove()
    if not layers:
        return last, last.new_zeros(last.shape[:-1] + (0,))
    return last, torch.cat([capture.states[key] for key in layers], dim=-1)


def score(target: PreTrainedModel, prompts: list[list[int]], answers: list[list[int]],
          top_k: int, state_layers: tuple[int, ...] = (), chunk: int = 64
          ) -> list[tuple[torch.Tensor, ...]]:
    """The target's labels for each answer after its prompt, from one forward over the
    right-padded sequences (chunk at a time) in the target's dtype; the head runs on the
    answer rows only. With state_layers, each answer also gets the inputs of those
    decoder layers at every position of prompt + answer (bfloat16, on the CPU): what an
    EAGLE-3 draft reads."""
    labelled: list[tuple[torch.Tensor, ...]] = []
    device = target.device
    for begin in range(0, len(prompts), chunk):
        part_prompts, part_answers = prompts[begin: begin + chunk], answers[begin: begin + chunk]
        sequences = [p + a for p, a in zip(part_prompts, part_answers, strict=True)]
        ids, mask = right_pad([torch.tensor(s, dtype=torch.long) for s in sequences])
        with torch.inference_mode():
            hidden, states = target_aux_states(target, state_layers, ids.to(device),
                                               mask.to(device))
            rows = torch.cat([torch.full((len(a),), row) for row, a in enumerate(part_answers)])
            cols = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(a))
                              for p, a in zip(part_prompts, part_answers, strict=True)])
            rows, cols = rows.to(device), cols.to(device)
            top_ids, top_probs = top_k_labels(target.lm_head(hidden[rows, cols]), top_k)
            lengths = [len(a) for a in part_answers]
            for row, (ids_part, probs_part) in enumerate(zip(
                    top_ids.split(lengths), top_probs.split(lengths), strict=True)):
                if state_layers:
                    row_states = states[row, : len(sequences[row])].to(torch.bfloat16).cpu()
                    labelled.append((ids_part, probs_part, row_states))
                else:
                    labelled.append((ids_part, probs_part))
    return labelled


Labels = tuple[torch.Tensor, torch.Tensor]  # top-k ids [B, new, k] int32, probs float16


def generate(model: PreTrainedModel, prompts: list[list[int]], temperature: float,
             max_new_tokens: int, end: int, *, pad: int, label_top_k: int = 0,
             suppress: list[int] | None = None) -> tuple[list[list[int]], Labels | None]:
    """transformers' generate over left-padded prompts (ids in the model's own rows), on
    the model's device: each continuation cut after `end`, and with label_top_k > 0 the
    top-k labels of the raw logits at every step (top_k_labels), on the CPU."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    greedy = temperature == 0.0
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]  # transformers' stub
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy, **({} if greedy else {"temperature": temperature,
                                                            "top_k": 0, "top_p": 1.0}),
            eos_token_id=end, pad_token_id=pad, suppress_tokens=suppress,
            return_dict_in_generate=True, output_logits=label_top_k > 0)
        labels = None
        if label_top_k > 0:  # per step, so no [B, new, V] tensor is ever stacked
            steps = [top_k_labels(step, label_top_k) for step in out.logits]
            labels = (torch.stack([i for i, _ in steps], dim=1),
                      torch.stack([p for _, p in steps], dim=1))
    new = [cut_at(row, end) for row in out.sequences[:, width:].tolist()]
    return new, labels


class TargetWriter:
    """The target sampling text (user turns for the conversation source)."""

    def __init__(self, target: PreTrainedModel, end: int) -> None:
        self.target, self.end = target, end

    def __call__(self, prefixes: list[list[int]], temperature: float,
                 max_new_tokens: int) -> list[list[int]]:
        return generate(self.target, prefixes, temperature, max_new_tokens, self.end,
                        pad=self.end)[0]


class DraftWrittenProducer:
    """The draft writes, the target labels by scoring. `load_draft_state` takes the
    trainer's newer weights, so the text stays the current draft's."""

    name = "draft-written"

    def __init__(self, target: PreTrainedModel, draft: LlamaForCausalLM, token_map: list[int],
                 end: int, *, top_k: int, max_new_tokens: int) -> None:
        self.target, self.draft = target, draft.eval()
        self.token_map = torch.tensor(token_map)
        self.unk_row = len(token_map)
        self.input_map = input_rows(token_map, int(target.config.vocab_size))
        self.end, self.top_k, self.max_new_tokens = end, top_k, max_new_tokens

    def load_draft_state(self, state: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(state)

    def produce(self, contexts: list[Context], temperature: float) -> list[Record]:
        prompts = [c.prompt_ids for c in contexts]
        end_row = int(self.input_map[self.end])
        rows, _ = generate(self.draft, [self.input_map[torch.tensor(p)].tolist() for p in prompts],
                           temperature, self.max_new_tokens, end_row, pad=end_row,
                           suppress=[self.unk_row])  # the UNK row is never proposed
        answers = [self.token_map[torch.tensor(r, dtype=torch.long)].tolist() for r in rows]
        kept = [i for i, answer in enumerate(answers) if answer]
        labels = score(self.target, [prompts[i] for i in kept], [answers[i] for i in kept],
                       self.top_k)
        return [make_record(contexts[i].kind, temperature, prompts[i], answers[i], *label)
                for i, label in zip(kept, labels, strict=True)]


class TargetDecodingProducer:
    """The target writes and labels in the same pass: its distribution at each decoding
    step. backend "generate": transformers' generate; "runner": the project's batched
    runner, every live conversation's next token in one packed forward."""

    def __init__(self, target: PreTrainedModel, end: int, *, top_k: int, max_new_tokens: int,
                 backend: str = "generate", runner: ModelRunner | None = None,
                 seed: int = 0, state_layers: tuple[int, ...] = ()) -> None:
        if state_layers and backend != "generate":
            raise ValueError("the target's layer states come with the generate backend only")
        self.name = f"target-{backend}"
        self.target, self.end, self.backend = target, end, backend
        self.state_layers = state_layers
        self.top_k, self.max_new_tokens = top_k, max_new_tokens
        self.runner = runner
        self.generator = torch.Generator().manual_seed(seed)

    def produce(self, contexts: list[Context], temperature: float) -> list[Record]:
        prompts = [c.prompt_ids for c in contexts]
        if self.backend == "runner":
            answers, step_logits = self._decode_on_runner(prompts, temperature)
            return [make_record(c.kind, temperature, c.prompt_ids, answer,
                                *top_k_labels(rows, self.top_k))
                    for c, answer, rows in zip(contexts, answers, step_logits, strict=True)]
        if self.state_layers:  # labels and states from one scoring forward
            answers, _ = generate(self.target, prompts, temperature, self.max_new_tokens,
                                  self.end, pad=self.end)
            records = []
            for c, answer, (top_ids, top_probs, states) in zip(
                    contexts, answers, score(self.target, prompts, answers, self.top_k,
                                             self.state_layers), strict=True):
                record = make_record(c.kind, temperature, c.prompt_ids, answer, top_ids,
                                     top_probs)
                record["aux_states"] = states
                records.append(record)
            return records
        answers, labels = generate(self.target, prompts, temperature, self.max_new_tokens,
                                   self.end, pad=self.end, label_top_k=self.top_k)
        assert labels is not None
        top_ids, top_probs = labels
        return [make_record(c.kind, temperature, c.prompt_ids, answer,
                            top_ids[row, : len(answer)].clone(),
                            top_probs[row, : len(answer)].clone())
                for row, (c, answer) in enumerate(zip(contexts, answers, strict=True))]

    def _decode_on_runner(self, prompts: list[list[int]], temperature: float
                          ) -> tuple[list[list[int]], list[torch.Tensor]]:
        runner = self.runner
        assert runner is not None
        histories = [TokenHistory(p) for p in prompts]
        answers: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        last = [runner.extend(f"stream-{i}", 0, 0, p).logits[-1]  # prefills run alone
                for i, p in enumerate(prompts)]
        live = list(range(len(prompts)))
        while live:
            for i in live:
                logits[i].append(last[i])
                token = self._pick(last[i], temperature)
                answers[i].append(token)
            live = [i for i in live
                    if answers[i][-1] != self.end and len(answers[i]) < self.max_new_tokens]
            requests = []
            for i in live:
                history = histories[i]
                requests.append(ExtendRequest(f"stream-{i}", len(history),
                                              history.fingerprint(), [answers[i][-1]]))
                history.extend([answers[i][-1]])
            for i, result in zip(live, runner.extend_batch(requests), strict=True):
                if isinstance(result, Exception):
                    raise result
                last[i] = result.logits[-1]
        for i in range(len(prompts)):
            runner.release(f"stream-{i}")
        return answers, [torch.stack(rows) for rows in logits]

    def _pick(self, logits: torch.Tensor, temperature: float) -> int:
        if temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class MixedProducer:
    """Batches in turn from each producer: the draft's text and the target's."""

    name = "mix"

    def __init__(self, producers: list[Producer]) -> None:
        self.producers = producers
        self.batches = 0

    def load_draft_state(self, state: dict[str, torch.Tensor]) -> None:
        for producer in self.producers:
            if isinstance(producer, DraftWrittenProducer):
                producer.load_draft_state(state)

    def produce(self, contexts: list[Context], temperature: float) -> list[Record]:
        producer = self.producers[self.batches % len(self.producers)]
        self.batches += 1
        return producer.produce(contexts, temperature)


Producer = DraftWrittenProducer | TargetDecodingProducer | MixedProducer


def measure_producers(producers: list[Producer], contexts: Callable[[], list[Context]],
                      temperatures: tuple[float, ...], rounds: int = 1) -> dict[str, Any]:
    """Labelled tokens per second of each producer on the same contexts (one batch per
    temperature per round); the time to write the contexts is not counted."""
    batches = [(contexts(), t) for _ in range(rounds) for t in temperatures]
    report: dict[str, Any] = {}
    for producer in producers:
        tokens, started = 0, time.perf_counter()
        for batch, temperature in batches:
            tokens += sum(len(r["new_ids"]) for r in producer.produce(batch, temperature))
        elapsed = time.perf_counter() - started
        report[producer.name] = {"labelled_tokens": tokens, "seconds": round(elapsed, 2),
                                 "tokens_per_s": round(tokens / elapsed, 1)}
    return report
