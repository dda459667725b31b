"""Streaming self-distillation: a producer fills a bounded queue, the trainer drains it.

The producer (producers.py) turns contexts from the conversation source
(stream_prompts.py) into labelled records in its own thread; the queue holds at most
`queue_size` records, so the producer waits while the trainer is behind and nothing
piles up in memory or on disk. The trainer takes fresh records first and, while none
has arrived, trains again on records it has seen fewer than `passes` times.

A run starts from the given draft, or from the checkpoint in the work dir when there is
one (weights, optimiser, counters and the held-out curve: a run resumes), and stops at
its time budget. A draft directory that holds the curve of its own streaming run
(CURVE_FILE, committed beside its bfloat16 weights) resumes on any machine: with no
checkpoint in the work dir, the run continues that curve and its counters, with a fresh
optimiser (its state is not committed). Every `checkpoint_every_s` it saves the
checkpoint, measures the held-out curve (heldout.py) and hands its weights to a producer
that samples with the draft. Progress lines go to stdout.
"""

from __future__ import annotations

import copy
import json
import math
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel

from specdec.draft_training.card import write_stream_card
from specdec.draft_training.eagle3_train import (
    draft_token_map,
    eagle3_loss,
    make_eagle3_draft,
    measure_eagle3_agreement,
)
from specdec.draft_training.heldout import (
    CURVE_FILE,
    GENERATED,
    PLOT_FILE,
    POINT_COUNTERS,
    HeldOutSet,
    held_out_sets,
    load_or_build_held_out,
    measure_agreement,
    plot_curve,
    read_curve,
    write_curve,
)
from specdec.draft_training.producers import (
    DraftWrittenProducer,
    MixedProducer,
    Producer,
    TargetDecodingProducer,
    TargetWriter,
    measure_producers,
)
from specdec.draft_training.stream_prompts import ChatFormat, Context, ConversationSource
from specdec.draft_training.stream_settings import PRODUCERS, StreamSettings
from specdec.draft_training.train import (
    Record,
    _loss,
    build_token_map,
    load_draft,
    make_draft,
)
from specdec.engine.eagle3 import Eagle3DraftForCausalLM
from specdec.engine.models import parse_device
from specdec.engine.token_map import (
    has_token_map,
    input_rows,
    read_token_map,
    write_token_map,
)

CHECKPOINT_FILE = "stream_checkpoint.pt"
HELD_OUT_FILE = "held_out_{}.pt"  # per held-out set, by its name
SUMMARY_FILE = "stream_summary.json"
WARMUP_STEPS = 50


def _lr(settings: StreamSettings, optimiser_steps: int, elapsed_s: float) -> float:
    """Warm-up over the optimiser state's first steps, then cosine over this run."""
    warmup = min(1.0, (optimiser_steps + 1) / WARMUP_STEPS)
    decay = 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed_s / settings.time_budget_s)))
    return settings.lr * warmup * (0.1 + 0.9 * decay)


class DraftWeights:
    """The trainer's latest weights for a producer that samples with the draft."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self._state: dict[str, torch.Tensor] = {}

    def publish(self, draft: torch.nn.Module) -> None:
        state = {name: t.detach().clone() for name, t in draft.state_dict().items()}
        with self._lock:
            self._state, self.version = state, self.version + 1

    def take(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self._lock:
            return self.version, self._state


class ProducerThread(threading.Thread):
    """Produces records into `records` until `stop` is set; an error stops it and is
    kept for the trainer to raise."""

    def __init__(self, producer: Producer, source: ConversationSource, records: queue.Queue,
                 settings: StreamSettings, weights: DraftWeights, first_batch: int) -> None:
        super().__init__(name="stream-producer", daemon=True)
        self.producer, self.source, self.records = producer, source, records
        self.settings, self.weights = settings, weights
        self.batch_index = first_batch
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.produced: Counter[str] = Counter()  # labelled tokens per context kind

    def run(self) -> None:
        torch.set_num_threads(1)  # the trainer has the other core
        seen_version = 0
        try:
            while not self.stop.is_set():
                if isinstance(self.producer, DraftWrittenProducer | MixedProducer):
                    version, state = self.weights.take()
                    if version != seen_version:
                        self.producer.load_draft_state(state)
                        seen_version = version
                temperatures = self.settings.temperatures
                temperature = temperatures[self.batch_index % len(temperatures)]
                torch.manual_seed(self.settings.seed * 1_000_003 + self.batch_index)
                self.batch_index += 1
                contexts = self.source.next_batch(self.settings.produce_batch)
                if not contexts:  # every written turn of the batch was refused
                    continue
                for record in self.producer.produce(contexts, temperature):
                    self.source.remember(record["prompt_ids"].tolist(),
                                         record["new_ids"].tolist())
                    self.produced[str(record["kind"])] += len(record["new_ids"])
                    while not self.stop.is_set():
                        try:
                            self.records.put(record, timeout=0.5)
                            break
                        except queue.Full:
                            continue
        except BaseException as error:  # handed to the trainer, which raises it
            self.error = error


@dataclass
class Progress:
    """What the checkpoint keeps besides weights and optimiser state."""

    step: int = 0
    tokens: int = 0  # distinct labelled tokens received
    trained_tokens: int = 0  # labelled tokens in optimiser steps (reuse included)
    records: int = 0
    elapsed_s: float = 0.0  # over all runs
    cpu_s: float = 0.0  # the process's CPU time (every thread) over all runs
    batches: int = 0  # producer batches made (sets the next one's temperature and seed)
    optimiser_steps: int = 0  # steps the optimiser state has taken (its warm-up reads them)
    # The counters of the draft directory's curve point this stage continues from, if any.
    continued_from: dict[str, Any] | None = None


def _save_checkpoint(path: Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     progress: Progress) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": optimizer.state_dict(),
                "progress": asdict(progress)}, tmp)
    tmp.rename(path)


def make_producer(name: str, target_dir: str, target: PreTrainedModel, draft_dir: Path,
                  token_map: list[int], end: int, settings: StreamSettings,
                  state_layers: tuple[int, ...] = ()) -> Producer:
    if state_layers and name != "target-generate":
        raise ValueError(f"an EAGLE-3 draft trains on the target's states, which the "
                         f"target-generate producer keeps; --producer {name} does not")
    if name == "draft-written":
        sampler, _ = load_draft(draft_dir)  # a copy: the trainer owns the other
        sampler.to(target.device)  # type: ignore[arg-type]  # transformers' .to stub
        return DraftWrittenProducer(target, sampler, token_map, end, top_k=settings.top_k,
                                    max_new_tokens=settings.max_new_tokens)
    if name == "mix":
        return MixedProducer([make_producer(part, target_dir, target, draft_dir, token_map, end,
                                            settings) for part in ("draft-written",
                                                                   "target-generate")])
    if name == "target-runner":
        # The target as the services serve it by default (--dtype auto): int8 weights
        # where the operator runs, the tuned kernels, every conversation in one forward.
        from specdec.engine.backends.cpu import load_causal_lm
        from specdec.engine.runner import ModelRunner
        from specdec.settings import INT8_IF_AVAILABLE

        loaded = load_causal_lm(target_dir, torch.device("cpu"), torch.bfloat16,
                                progress=False, linear_kernel=INT8_IF_AVAILABLE)
        runner = ModelRunner(loaded.model, row_invariance=loaded.row_invariance)
        return TargetDecodingProducer(loaded.model, end, top_k=settings.top_k,
                                      max_new_tokens=settings.max_new_tokens,
                                      backend="runner", runner=runner, seed=settings.seed)
    return TargetDecodingProducer(target, end, top_k=settings.top_k,
                                  max_new_tokens=settings.max_new_tokens, backend="generate",
                                  seed=settings.seed, state_layers=state_layers)


def load_target(target_dir: str, device: torch.device) -> PreTrainedModel:
    """The target in bfloat16 on `device`, for inference."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    target.to(device)  # type: ignore[arg-type]  # transformers' .to stub
    return target


def measure(target_dir: str, draft_dir: Path, settings: StreamSettings,
            excluded: list[str]) -> dict[str, Any]:
    """Labelled tokens/s of every producer on the same contexts: one batch of
    settings.produce_batch contexts per temperature (measure_producers)."""
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(target_dir, parse_device(settings.device))
    _, token_map = load_draft(draft_dir)
    end = ChatFormat(tokenizer).end_of_turn
    source = ConversationSource(tokenizer, TargetWriter(target, end), excluded=excluded,
                                seed=settings.seed, mix=(1.0, 0.0, 0.0))
    # the runner producer is the CPU backend's: measured only where the run is on the CPU
    names = [name for name in PRODUCERS if name != "mix"
             and (name != "target-runner" or target.device.type == "cpu")]
    producers = [make_producer(name, target_dir, target, draft_dir, token_map, end, settings)
                 for name in names]
    report = measure_producers(producers, lambda: source.next_batch(settings.produce_batch),
                               settings.temperatures)
    return {"threads": torch.get_num_threads(), "contexts_per_batch": settings.produce_batch,
            "max_new_tokens": settings.max_new_tokens, "producers": report}


def new_draft(target_dir: str, out_dir: Path, settings: StreamSettings, *, vocab_size: int,
              num_layers: int, batches: int = 6) -> Path:
    """A draft for a target that has none yet, in out_dir (kept: a later run reuses it):
    the target's embeddings and first layers (train.make_draft) over the ids that carry
    the most of the target's probability mass in a few batches of its own answers
    (train.build_token_map). Llama-family targets."""
    if has_token_map(out_dir):
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_target(target_dir, parse_device(settings.device))
    chat = ChatFormat(tokenizer)
    source = ConversationSource(tokenizer, TargetWriter(target, chat.end_of_turn),
                                seed=settings.seed, mix=settings.mix)
    producer = TargetDecodingProducer(target, chat.end_of_turn, top_k=settings.top_k,
                                      max_new_tokens=settings.max_new_tokens)
    size = settings.produce_batch
    contexts: list[Context] = []
    for _ in range(4 * batches):  # refused written turns leave a batch short
        if len(contexts) < batches * size:
            contexts += source.next_batch(size)
    records = [record for index in range(min(batches, math.ceil(len(contexts) / size)))
               for record in producer.produce(
                   contexts[index * size: (index + 1) * size],
                   settings.temperatures[index % len(settings.temperatures)])]
    always = sorted({chat.end_of_turn, *chat.user_prefix, *chat.assistant_prefix})
    token_map = build_token_map(records, vocab_size, always)
    draft = make_draft(target_dir, token_map, num_layers)
    draft.save_pretrained(out_dir, safe_serialization=True)
    write_token_map(out_dir, token_map)
    return out_dir


def stream_distill(target_dir: str, init_draft: Path, work_dir: Path, out_dir: Path,
                   settings: StreamSettings, excluded: list[str] | None = None,
                   target: PreTrainedModel | None = None) -> dict[str, Any]:
    """Distil the draft in init_draft (or the work dir's checkpoint) on a stream of
    labelled contexts for settings.time_budget_s, continuing the curve and counters of
    the checkpoint or else of init_draft's own streaming curve; write it (bfloat16), its
    token map, the curve and its plot to out_dir. `target`: the loaded target (bfloat16 by
    default), for callers that already hold it."""
    torch.set_num_threads(1)  # the producer thread has the other core
    device = parse_device(settings.device)
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if target is None:
        target = load_target(target_dir, device)
    else:
        target.to(device)  # type: ignore[arg-type]  # transformers' .to stub
        target.eval()
    draft: LlamaForCausalLM
    if settings.draft_kind == "eagle3":
        draft = load_or_make_eagle3(init_draft, target_dir, target)
        token_map = draft_token_map(draft)
    else:
        draft, token_map = load_draft(init_draft)
    draft.to(device)  # type: ignore[arg-type]  # float32 weights: the trainer's copy
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad],
                                  lr=settings.lr, weight_decay=0.0)
    checkpoint, curve_path = work_dir / CHECKPOINT_FILE, work_dir / CURVE_FILE
    progress, curve = Progress(), []
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress = Progress(**{"optimiser_steps": state["progress"]["step"],
                               **state["progress"]})
        curve = read_curve(curve_path)
        print(f"resuming at step {progress.step}, {progress.tokens:,} tokens", flush=True)
    elif same_kind(init_draft, settings) and (curve := read_curve(init_draft / CURVE_FILE)):
        counters = {key: curve[-1][key] for key in POINT_COUNTERS if key in curve[-1]}
        progress = Progress(**counters, continued_from=counters)
        unmeasured = sum("top1_agreement" not in point for point in curve)
        print(f"continuing the committed curve at {progress.tokens:,} tokens, step "
              f"{progress.step:,}; optimiser state starts fresh"
              + (f"; its {unmeasured} points before the hand-written set measured the "
                 "prompt sets only (their figures under "
                 f"{GENERATED!r})" if unmeasured else ""), flush=True)
    handwritten, generated = [
        load_or_build_held_out(work_dir / HELD_OUT_FILE.format(name), target, tokenizer,
                               token_map, conversations, settings.held_out_tokens)
        for name, conversations in held_out_sets(settings.held_out_prompts).items()]

    def measure_set(model: LlamaForCausalLM, held_out: HeldOutSet) -> dict[str, Any]:
        if isinstance(model, Eagle3DraftForCausalLM):
            return measure_eagle3_agreement(model, target, held_out, settings.ttt_steps)
        return measure_agreement(model, held_out)

    def measure(model: LlamaForCausalLM) -> dict[str, Any]:
        """The hand-written set's figures, the prompt sets' under GENERATED."""
        return {**measure_set(model, handwritten), GENERATED: measure_set(model, generated)}

    end = ChatFormat(tokenizer).end_of_turn
    if not checkpoint.exists():  # the starting draft's point, as measured here
        _record_point(curve, curve_path, draft, measure, progress, float("nan"))
    source = ConversationSource(tokenizer, TargetWriter(target, end), excluded=excluded or (),
                                seed=settings.seed + progress.batches, mix=settings.mix,
                                max_context=settings.max_context)
    # at least two producer batches, so the producer never waits on a whole batch
    records: queue.Queue[Record] = queue.Queue(
        maxsize=max(settings.queue_size, 2 * settings.produce_batch))
    weights = DraftWeights()
    weights.publish(draft)
    producer = ProducerThread(
        make_producer(settings.producer, target_dir, target, init_draft, token_map, end,
                      settings, draft.eagle3.aux_layer_ids
                      if isinstance(draft, Eagle3DraftForCausalLM) else ()),
        source, records, settings, weights, progress.batches)
    producer.start()
    unk_row = len(token_map)
    input_map = input_rows(token_map, int(target.config.vocab_size))
    draft_rows = torch.where(input_map == unk_row, -1, input_map)  # EAGLE-3: no UNK row
    reusable: deque[tuple[Record, int]] = deque()  # (record, times used)
    losses: deque[float] = deque(maxlen=50)
    run_started = time.monotonic()
    earlier_s, earlier_cpu_s = progress.elapsed_s, progress.cpu_s
    cpu_started = time.process_time()
    last_checkpoint = last_progress = run_started
    run_tokens = 0
    draft.train()
    try:
        while time.monotonic() - run_started < settings.time_budget_s:
            batch = _next_batch(records, reusable, settings, producer)
            if batch is None:
                continue
            fresh = [record for record, used in batch if used == 0]
            run_tokens += sum(len(r["new_ids"]) for r in fresh)
            progress.tokens += sum(len(r["new_ids"]) for r in fresh)
            progress.records += len(fresh)
            progress.trained_tokens += sum(len(r["new_ids"]) for r, _ in batch)
            for group in optimizer.param_groups:
                group["lr"] = _lr(settings, progress.optimiser_steps,
                                  time.monotonic() - run_started)
            loss = (eagle3_loss(draft, [r for r, _ in batch], draft_rows, settings.ttt_steps)
                    if isinstance(draft, Eagle3DraftForCausalLM)
                    else _loss(draft, [r for r, _ in batch], input_map, unk_row))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            progress.step += 1
            progress.optimiser_steps += 1
            losses.append(float(loss.detach()))
            reusable.extend((r, used + 1) for r, used in batch if used + 1 < settings.passes)
            now = time.monotonic()
            if now - last_progress >= settings.progress_every_s:
                last_progress = now
                print(f"step {progress.step} tokens {progress.tokens:,} "
                      f"({run_tokens / (now - run_started):.0f}/s this run) "
                      f"loss {sum(losses) / len(losses):.3f} queue {records.qsize()} "
                      f"elapsed {(now - run_started) / 60:.1f} min", flush=True)
            if now - last_checkpoint >= settings.checkpoint_every_s:
                last_checkpoint = now
                progress.batches = producer.batch_index
                progress.elapsed_s = earlier_s + now - run_started
                progress.cpu_s = earlier_cpu_s + time.process_time() - cpu_started
                _checkpoint(checkpoint, curve, curve_path, draft, optimizer, measure,
                            progress, losses)
                weights.publish(draft)
    finally:
        producer.stop.set()
        producer.join(timeout=600)
    progress.batches = producer.batch_index
    elapsed = time.monotonic() - run_started
    progress.elapsed_s = earlier_s + elapsed
    progress.cpu_s = earlier_cpu_s + time.process_time() - cpu_started
    _checkpoint(checkpoint, curve, curve_path, draft, optimizer, measure, progress, losses)
    summary = {"settings": asdict(settings), "progress": asdict(progress),
               "run_s": round(elapsed, 1), "run_tokens": run_tokens,
               "tokens_per_s_this_run": round(run_tokens / max(elapsed, 1e-9), 1),
               "produced_by_kind": dict(producer.produced),
               "written_turns": source.written_turns,
               "dropped_written_turns": source.dropped_turns,
               "near_duplicate_turns": source.near_duplicates,
               "continued_from": progress.continued_from,
               "init_draft": str(init_draft), "target": Path(target_dir).name,
               "device_name": device_name(device), "curve": curve}
    (work_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    if isinstance(draft, Eagle3DraftForCausalLM):
        _write_eagle3(draft, out_dir, curve, target)
    else:
        _write_draft(draft, token_map, out_dir, curve)
        if (init_draft / "README.md").exists():  # the starting draft's card, this stage added
            write_stream_card(out_dir, init_draft / "README.md", summary)
    return summary


def same_kind(init_draft: Path, settings: StreamSettings) -> bool:
    """Whether the run trains init_draft itself, so its curve is this draft's: an EAGLE-3
    run from a token draft makes a new draft over that draft's vocabulary."""
    from specdec.engine.eagle3_formats import directory_layout

    return (directory_layout(init_draft) is not None) == (settings.draft_kind == "eagle3")


def device_name(device: torch.device) -> str:
    """The hardware a run trained on, for its summary and model card."""
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)}"
    return f"{os.cpu_count()} CPU cores"


def _next_batch(records: queue.Queue[Record], reusable: deque[tuple[Record, int]],
                settings: StreamSettings,
                producer: ProducerThread) -> list[tuple[Record, int]] | None:
    """Fresh records first; reused ones while none is waiting; None after a second
    without either (the caller checks its budget and asks again)."""
    batch: list[tuple[Record, int]] = []
    while len(batch) < settings.train_batch:
        if producer.error is not None:
            raise RuntimeError("the stream's producer failed") from producer.error
        try:
            batch.append((records.get(timeout=0.0 if reusable else 1.0), 0))
        except queue.Empty:
            if reusable:
                batch.append(reusable.popleft())
            elif not batch:
                return None
    return batch


def _record_point(curve: list[dict[str, Any]], path: Path, draft: LlamaForCausalLM,
                  measure: Callable[[LlamaForCausalLM], dict[str, Any]], progress: Progress,
                  loss: float) -> None:
    counters = asdict(progress)
    point = {**{key: counters[key] for key in POINT_COUNTERS},
             "elapsed_s": round(progress.elapsed_s, 1), "cpu_s": round(progress.cpu_s, 1),
             "loss": None if math.isnan(loss) else round(loss, 4), **measure(draft)}
    curve.append(point)
    write_curve(path, curve)
    generated = point[GENERATED]
    print(f"held-out top-1 agreement / expected acceptance: hand-written "
          f"{point['top1_agreement']:.4f} / {point['expected_acceptance']:.4f}, prompt sets "
          f"{generated['top1_agreement']:.4f} / {generated['expected_acceptance']:.4f} at "
          f"{progress.tokens:,} tokens", flush=True)


def _checkpoint(path: Path, curve: list[dict[str, Any]], curve_path: Path,
                draft: LlamaForCausalLM, optimizer: torch.optim.Optimizer,
                measure: Callable[[LlamaForCausalLM], dict[str, Any]], progress: Progress,
                losses: deque[float]) -> None:
    _save_checkpoint(path, draft, optimizer, progress)
    _record_point(curve, curve_path, draft, measure, progress,
                  sum(losses) / len(losses) if losses else float("nan"))
    draft.train()


def _write_draft(draft: LlamaForCausalLM, token_map: list[int], out_dir: Path,
                 curve: list[dict[str, Any]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = copy.deepcopy(draft)
    torch.nn.Module.to(stored, torch.bfloat16)  # transformers' .to stub takes no dtype
    stored.save_pretrained(out_dir, safe_serialization=True)
    write_token_map(out_dir, token_map)
    write_curve(out_dir / CURVE_FILE, curve)
    plot_curve(curve, out_dir / PLOT_FILE, "held-out acceptance of the draft, streaming stage")


def load_or_make_eagle3(init_draft: Path, target_dir: str,
                        target: PreTrainedModel) -> Eagle3DraftForCausalLM:
    """init_draft when it is an EAGLE-3 draft (either layout; float32, embeddings frozen),
    else a new one over init_draft's draft vocabulary (its token_map.json)."""
    from specdec.engine.eagle3_formats import directory_layout, load_eagle3, target_facts

    if directory_layout(init_draft) is not None:
        draft = load_eagle3(init_draft, torch.float32, target_facts(target.config), target_dir)
        draft.model.embed_tokens.weight.requires_grad_(False)
        return draft
    token_map = read_token_map(init_draft)
    return make_eagle3_draft(target, token_map)


def _write_eagle3(draft: Eagle3DraftForCausalLM, out_dir: Path, curve: list[dict[str, Any]],
                  target: PreTrainedModel) -> None:
    """The draft in the speculators layout (bfloat16, the target's embeddings left out:
    loaders take them from the target), with the curve and its plot."""
    from specdec.engine.eagle3_formats import save_speculators

    stored = copy.deepcopy(draft)
    torch.nn.Module.to(stored, torch.bfloat16)  # transformers' .to stub takes no dtype
    name = str(getattr(target.config, "_name_or_path", "") or "target")
    save_speculators(stored, out_dir, name, list(target.config.architectures or []),
                     shared_embeddings=True)
    write_curve(out_dir / CURVE_FILE, curve)
    plot_curve(curve, out_dir / PLOT_FILE, "held-out acceptance of the EAGLE-3 draft")
