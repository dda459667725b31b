"""The draft pipeline's data and training stages on a tiny target with SmolLM2's tokenizer:
per-shard temperatures, seeded sampling, and continuing a trained draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.draft_training.card import _reproduce_lines, write_model_card
from specdec.draft_training.datagen import generate_shards
from specdec.draft_training.train import _loss, load_shards, make_draft, records_of, train
from specdec.engine.token_map import input_rows
from tests.tiny_models import save_tiny_pair


@pytest.fixture(scope="module")
def target_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("draft-training")
    target, _ = save_tiny_pair(root)
    generate_shards(str(target), root / "data", batch_size=3, max_new_tokens=6, top_k=4,
                    max_shards=2, temperatures=(0.0, 0.7), seed=5, dtype=torch.bfloat16)
    return target, root / "data"


def test_shards_take_their_temperature_in_turn_and_sampling_is_seeded(
        target_and_data: tuple[Path, Path], tmp_path: Path) -> None:
    target, data = target_and_data
    greedy, sampled = (torch.load(p) for p in sorted(data.glob("shard-*.pt")))
    assert (greedy["temperature"], greedy["greedy"]) == (0.0, True)
    assert (sampled["temperature"], sampled["greedy"]) == (0.7, False)
    record = sampled["records"][0]
    assert record["topk_ids"].shape == (len(record["new_ids"]), 4)

    def sampled_ids(seed: int, out: Path) -> list[list[int]]:
        generate_shards(str(target), out, batch_size=3, max_new_tokens=6, top_k=4,
                        max_shards=2, temperatures=(0.0, 0.7), seed=seed, dtype=torch.bfloat16)
        return [r["new_ids"].tolist() for r in torch.load(out / "shard-00001.pt")["records"]]

    assert sampled_ids(5, tmp_path / "same") == [r["new_ids"].tolist() for r in sampled["records"]]
    assert sampled_ids(6, tmp_path / "other") != sampled_ids(5, tmp_path / "same")


def test_training_continues_the_given_draft(target_and_data: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    target, data = target_and_data
    records = records_of(load_shards(data))
    token_map = sorted({int(t) for r in records for t in r["topk_ids"].flatten()} | {1, 2})
    initial = tmp_path / "initial"
    draft = make_draft(str(target), token_map, num_layers=2)
    with torch.no_grad():  # so it differs from the draft a fresh run would make
        for parameter in draft.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    draft.save_pretrained(initial)
    (initial / "token_map.json").write_text(json.dumps({"target_ids": token_map}))
    (initial / "README.md").write_text("# old\n## Training data\n- the first recipe\n\n"
                                       "## Evaluation\n- old figures\n")

    # lr 0: the output is the given draft itself, not a fresh one made from the target
    unchanged = tmp_path / "unchanged"
    train(str(target), data, tmp_path / "work0", unchanged, epochs=1, batch_size=2, lr=0.0,
          init_draft=initial)
    before, after = (load_file(d / "model.safetensors") for d in (initial, unchanged))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert json.loads((unchanged / "token_map.json").read_text())["target_ids"] == token_map

    trained = tmp_path / "trained"
    summary = train(str(target), data, tmp_path / "work1", trained, epochs=20, batch_size=2,
                    lr=1e-2, init_draft=initial)
    assert summary["init_draft"] == str(initial)
    assert summary["init_card"] == ["- the first recipe"]
    assert summary["temperatures"] == {"0": 1, "0.7": 1}
    assert summary["dtypes"] == {"bfloat16": 2}
    report = {"num_prompts": 1, "max_new_tokens": 4, "threads": 2, "acceptance": [],
              "t_draft_1_ms": 1.0, "c": 0.1, "t_target_ms": {"1": 10.0},
              "bound_by_gamma_greedy": {"1": 1.2}, "best_gamma": 1, "best_bound": 1.2}
    (tmp_path / "work1" / "eval_report.json").write_text(json.dumps(report))
    write_model_card(trained, tmp_path / "work1")
    card = (trained / "README.md").read_text()
    assert "Stage 1, the draft this one continues" in card and "- the first recipe" in card
    assert "1/2 shards greedy, 1/2 shards sampled at T=0.7" in card
    assert ("--init-draft STAGE1_DRAFT --data-dtype bfloat16 --data-temperatures 0,0.7 "
            "--batch-size 3 --max-shards 2 --wide-shards 0 --epochs 20 --lr 0.01") in card
    assert "old figures" not in card

    def mean_loss(draft_dir: Path) -> float:
        from transformers import LlamaConfig, LlamaForCausalLM

        draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        unk_row = len(token_map)
        input_map = input_rows(token_map, LlamaConfig.from_pretrained(target).vocab_size)
        with torch.no_grad():
            return float(_loss(draft, records, input_map, unk_row))

    assert mean_loss(trained) < 0.9 * mean_loss(initial)


def test_stage_two_command_says_when_shards_came_in_several_dtypes() -> None:
    summary = {"init_draft": "D", "temperatures": {"0.7": 3}, "shards": {"shard": 1, "wide": 2},
               "sequences": 6, "epochs": 2, "lr": 2e-4}
    single = _reproduce_lines({**summary, "dtypes": {"bfloat16": 3}})
    assert not any("more than one dtype" in line for line in single)
    mixed = _reproduce_lines({**summary, "dtypes": {"bfloat16": 2, "float32": 1}})
    assert ("# its shards were generated in more than one dtype (2 in bfloat16, 1 in float32); "
            "this command generates all of them in bfloat16") in mixed
    assert mixed[-1] == single[-1]
