"""`specdec export-draft`: write a draft in the speculators layout, which vLLM and SGLang
load as an EAGLE-3 speculator (specdec.engine.eagle3_formats)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.settings import add_settings

FORMATS = ("speculators",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-draft", help="write an EAGLE-3 draft in the speculators layout (vLLM, SGLang)")
    parser.add_argument("draft", help="the draft: a directory or hub id in the speculators "
                                      "or the EAGLE-3/SpecForge layout")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--format", default=FORMATS[0], choices=FORMATS,
                        help="the layout to write (default: %(default)s)")
    parser.add_argument("--verifier", default="",
                        help="the target named in speculators_config.verifier (default: "
                             "--target-model)")
    add_settings(parser, ["target-model"], grouped=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from specdec.engine import models
    from specdec.engine.eagle3_formats import save_speculators

    source = models.resolve(args.draft, progress=False)
    directory = models.eagle3_source(source)
    if directory is None:
        raise ValueError(_not_eagle3(source))
    draft = models.load_eagle3_for(directory, None, args.target_model)
    target_config = AutoConfig.from_pretrained(models.resolve(args.target_model,
                                                              progress=False))
    out = save_speculators(draft, Path(args.out), args.verifier or args.target_model,
                           list(getattr(target_config, "architectures", None) or []),
                           tokenizer_dir=directory)
    print(f"wrote {out} (speculators eagle3: {draft.eagle3.draft_vocab_size}-token draft "
          f"vocabulary, aux layers {list(draft.eagle3.aux_layer_ids)})")
    return 0


def _not_eagle3(source: Path | str) -> str:
    """Why a draft that is not EAGLE-3 has no speculators form."""
    from specdec.engine.feature_draft import TARGET_HIDDEN_SIZE_KEY

    config = Path(source) / "config.json"
    if config.is_file() and TARGET_HIDDEN_SIZE_KEY in json.loads(config.read_text()):
        return (f"{source} is specdec's feature draft, which has no speculators form: it "
                "reads the target's final state (EAGLE-3 reads layer inputs) through one "
                "fc over [embedding; state] into a standard decoder layer (EAGLE-3 norms the "
                "two halves apart and attends over both), so an EAGLE-3 loader would "
                "compute something else")
    return (f"{source} is not an EAGLE-3 draft; only EAGLE-3 drafts (speculators or "
            "EAGLE-3/SpecForge layout) export to the speculators layout")
