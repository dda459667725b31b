"""What one benchmark run measures: systems x draft lengths x sampling modes, and records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.core.sampling import SamplingParams

# target-only baselines, transformers' assisted generation, and specdec's two shapes.
TARGET_ONLY = "target-only"
HF_GENERATE = "hf-generate"
HF_ASSISTED = "hf-assisted"
LOCAL = "specdec-local"
GRPC = "specdec-grpc"
# llama.cpp on the same weights (specdec.bench.llama_cpp; skipped where it is missing).
LLAMA_CPP_BF16 = "llama-cpp-bf16"
LLAMA_CPP_Q8_0 = "llama-cpp-q8_0"
LLAMA_CPP_Q4_1 = "llama-cpp-q4_1"
LLAMA_CPP_NGRAM = "llama-cpp-ngram"
LLAMA_CPP_SYSTEMS = (LLAMA_CPP_BF16, LLAMA_CPP_Q8_0, LLAMA_CPP_Q4_1, LLAMA_CPP_NGRAM)
SYSTEMS = (TARGET_ONLY, HF_GENERATE, HF_ASSISTED, LOCAL, GRPC, *LLAMA_CPP_SYSTEMS)
# specdec in-process with the token-only draft hf-assisted runs, beside a feature draft
# (--systems ...,specdec-local-token-draft): the two drafts compared in one run.
LOCAL_TOKEN_DRAFT = "specdec-local-token-draft"
KNOWN_SYSTEMS = (*SYSTEMS, LOCAL_TOKEN_DRAFT)
SPECULATIVE = (LOCAL, GRPC)  # the systems whose bound the cost curves describe
DRAFTED = (*SPECULATIVE, LOCAL_TOKEN_DRAFT)
# Target-only through the same three services: the same-shape baseline of the gRPC runs.
GRPC_TARGET_ONLY = f"{GRPC} k=0"
LENGTHS = ("1", "2", "3", "4", "6", "8", "adaptive", "confident", "adaptive+a0")
# Besides fixed integers: "adaptive" as served (length per round + the confidence gate),
# "heuristic" (transformers' +2/-1, in-process only) and "confident" (the longest length
# every round, ended by the confidence gate alone: transformers' assisted generation's
# scheme, in specdec). A "+aN" suffix makes the draft a token tree with up to N
# alternatives per round (default: as served, SPECDEC_DRAFT_ALTERNATIVES for adaptive, a
# chain for fixed lengths); "adaptive+a0" is adaptive with the chain alone; "+fN" is the
# same with the alternatives one level deep (each follows a chain token). A
# "+pN" suffix sets prompt lookup's tokens per round (default: as served,
# SPECDEC_PROMPT_LOOKUP_TOKENS; "+p0" = off), "+sN" suffix decoding's (gRPC only;
# default: as served, SPECDEC_SUFFIX_MAX_TOKENS; "+s0" = off). Suffixes combine:
# "2+a0+p0".
SUFFIXES = {"a": "alternatives", "f": "alternatives one level deep",
            "p": "prompt lookup tokens", "s": "suffix decoding tokens"}
POLICIES = ("adaptive", "heuristic", "confident")
GATED = ("adaptive", "confident")  # the policies the confidence gate applies to


@dataclass(frozen=True)
class SamplingMode:
    name: str
    temperature: float = 0.0
    top_p: float = 1.0

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=seed)


MODES = {
    "greedy": SamplingMode("greedy"),
    "t1": SamplingMode("t1", temperature=1.0),
    "top-p": SamplingMode("top-p", temperature=1.0, top_p=0.9),
}


@dataclass(frozen=True)
class BenchConfig:
    system: str
    length: str = "-"  # "1".."16", one of POLICIES, or "-" without a draft

    @property
    def name(self) -> str:
        return self.system if self.length == "-" else f"{self.system} k={self.length}"

    @property
    def draft_length(self) -> str:
        """The length without its suffixes: "2+a0+p0" -> "2"."""
        return self.length.partition("+")[0]

    def _suffix(self, letter: str) -> int | None:
        for option in self.length.split("+")[1:]:
            if option[:1] == letter:
                return int(option[1:])
        return None

    @property
    def alternatives(self) -> int | None:
        """A token tree's alternatives per round a "+aN" or "+fN" suffix sets (None: as
        served)."""
        tree = self._suffix("a")
        return tree if tree is not None else self._suffix("f")

    @property
    def alternative_depth(self) -> int:
        """Levels below the chain the alternatives may go: 1 with "+fN", else 0 (no
        limit)."""
        return 1 if self._suffix("f") is not None else 0

    @property
    def lookup_tokens(self) -> int | None:
        """Prompt lookup's tokens per round a "+pN" suffix sets (None: as served)."""
        return self._suffix("p")

    @property
    def suffix_tokens(self) -> int | None:
        """Suffix decoding's tokens per round a "+sN" suffix sets (None: as served)."""
        return self._suffix("s")

    @property
    def fixed_length(self) -> int | None:
        return int(self.draft_length) if self.draft_length.isdigit() else None

    @property
    def policy(self) -> str:
        """The length without a gate suffix: "adaptive@0.6" -> "adaptive"."""
        return self.draft_length.partition("@")[0]

    @property
    def gate(self) -> float | None:
        """The confidence gate a "POLICY@VALUE" length sets (None: the default)."""
        _, at, value = self.draft_length.partition("@")
        return float(value) if at else None


def _is_fraction(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def build_configs(systems: tuple[str, ...], lengths: tuple[str, ...]) -> list[BenchConfig]:
    for system in systems:
        if system not in KNOWN_SYSTEMS:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(KNOWN_SYSTEMS)}")
    for full_length in lengths:
        length, *options = full_length.split("+")
        for option in options:
            if option[:1] not in SUFFIXES or not option[1:].isdigit():
                raise ValueError(f"draft length {full_length!r}: suffixes are " + ", ".join(
                    f"+{letter}N ({what}, N >= 0)" for letter, what in SUFFIXES.items()))
        policy, at, gate = length.partition("@")
        if at and (policy not in GATED or not _is_fraction(gate)):
            raise ValueError(f"draft length {length!r}: only adaptive@G and confident@G take "
                             "a confidence gate G in [0, 1]")
        if not (length.isdigit() and int(length) > 0) and policy not in POLICIES:
            raise ValueError(f"draft length {length!r}: a positive integer or one of "
                             f"{', '.join(POLICIES)}")
    configs: list[BenchConfig] = []
    for system in systems:
        if system == GRPC:
            configs.append(BenchConfig(GRPC, "0"))
        if system in DRAFTED:
            configs += [BenchConfig(system, length) for length in lengths
                        if not (system == GRPC and length.startswith("heuristic"))]
        else:
            configs.append(BenchConfig(system))
    return configs


@dataclass
class RunRecord:
    """One generation: one config, one sampling mode, one prompt, one repeat."""

    config: str
    system: str
    length: str
    mode: str
    prompt_id: str
    category: str
    repeat: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    rounds: int = 0  # target forwards, the prefill included
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0  # wait on the draft (model + transport + serialisation)
    draft_forward_s: float = 0.0  # model time inside the draft
    verify_s: float = 0.0
    verify_forward_s: float = 0.0
    wire_bytes: int = 0
    lookup_draft_tokens: int = 0  # prompt lookup's part of draft_tokens
    lookup_accepted_tokens: int = 0  # and of accepted_tokens
    chosen: list[int] = field(default_factory=list)  # per-round draft lengths (local only)
    token_ids: list[int] = field(default_factory=list)  # greedy runs only
    workload: str = "prompts"  # the prompt's (specdec.bench.workloads)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
