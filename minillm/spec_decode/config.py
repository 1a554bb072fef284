"""SpeculativeConfig: which proposer drafts tokens and how many (vLLM's speculative_config keys).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    {"model": "path/to/draft", "num_speculative_tokens": 4}          (method "draft_model")
    {"method": "layer_skip", "num_draft_layers": 8, "num_speculative_tokens": 4}
    {"method": "medusa", "model": "path/to/heads", "num_speculative_tokens": 3}   (medusa.py)
    {"method": "eagle", "model": "path/to/layer", "num_speculative_tokens": 4}    (eagle.py)

disable_by_batch_size: speculation is switched off in a step whose running batch is larger (a verify
of k + 1 tokens per sequence is nearly free while decode is memory-bound, not once the batch makes it
compute-bound); None keeps it on at every batch size.

min_acceptance_rate: speculation backs off per sequence where it does not pay. A running average of
each sequence's acceptance rate (half the last verify, half what came before) below this pauses its
drafting for 8 output tokens, then 16, 32, ... up to 128 while it stays below, and one verify step with
drafts after each pause decides again. Open-ended text gives the n-gram proposer almost nothing to find
(1-2 % accepted on the H100, notebook 09), and each of those verify steps costs more than a plain one.
None (the default) drafts whenever the proposer can.

adaptive: k is chosen per step (adaptive.py) from the batch size and the measured acceptance, in
0..num_speculative_tokens; saturation_tokens (the tokens at which a forward pass stops being
memory-bound; default 256) and draft_cost (a draft token's cost in plain steps; default per method)
are its cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..checks import check_int

METHODS = ("ngram", "draft_model", "layer_skip", "medusa", "eagle")
LEARNED = ("medusa", "eagle")  # drafters that read the target's hidden states (worker/hidden_states.py)
MAX_SPECULATIVE_TOKENS = 32  # more guesses than this are almost never all accepted, and cost a verify row each


@dataclass
class SpeculativeConfig:
    method: str | None = None  # None: "draft_model" when a model is given
    num_speculative_tokens: int | None = None  # k, draft tokens per sequence per step
    prompt_lookup_min: int | None = None  # ngram: shortest suffix to match (default 1)
    prompt_lookup_max: int | None = None  # ngram: longest suffix to match (default 3)
    model: object = None  # draft_model: a path, a model name, or a built model sharing the target's vocab;
    # medusa / eagle: a drafter folder (drafter_files.py) or a built MedusaHeads / EagleModel
    num_draft_layers: int | None = None  # layer_skip: the target's first L' layers draft
    disable_by_batch_size: int | None = None  # no drafts in a step with more running sequences
    min_acceptance_rate: float | None = None  # per sequence: pause drafting while its recent rate is lower
    adaptive: bool = False  # k per step from the batch size and the measured acceptance (adaptive.py)
    saturation_tokens: int = 256  # adaptive: tokens at which a forward pass becomes compute-bound
    draft_cost: float | None = None  # adaptive: a draft token's cost in plain decode steps (None: per method)

    @classmethod
    def from_dict(cls, d) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, not {type(d).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {allowed}")
        return cls(**d)

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS} (or give a draft 'model'), "
                             f"not {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (k, draft tokens per step)")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, prefix="speculative_config ")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"not {self.num_speculative_tokens}")
        check_int("disable_by_batch_size", self.disable_by_batch_size, 1, optional=True, prefix="speculative_config ")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be True or False, not {self.adaptive!r}")
        check_int("saturation_tokens", self.saturation_tokens, 1, prefix="speculative_config ")
        cost = self.draft_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0):
            raise ValueError(f"speculative_config draft_cost must be a number >= 0 or None, not {cost!r}")
        rate = self.min_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1):
            raise ValueError(f"speculative_config min_acceptance_rate must be a number in (0, 1) or None, not {rate!r}")
        owners = {"prompt_lookup_min": ("ngram",), "prompt_lookup_max": ("ngram",),
                  "model": ("draft_model", *LEARNED), "num_draft_layers": ("layer_skip",)}
        for key, methods in owners.items():
            if self.method not in methods and getattr(self, key) is not None:
                raise ValueError(f"speculative_config {key} belongs to method {' or '.join(map(repr, methods))}, "
                                 f"not {self.method!r}")
        if self.method == "ngram":
            self.prompt_lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            self.prompt_lookup_max = max(3, self.prompt_lookup_min) if self.prompt_lookup_max is None \
                else self.prompt_lookup_max
            check_int("prompt_lookup_min", self.prompt_lookup_min, 1, prefix="speculative_config ")
            check_int("prompt_lookup_max", self.prompt_lookup_max, 1, prefix="speculative_config ")
            if self.prompt_lookup_max < self.prompt_lookup_min:
                raise ValueError(f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                                 f"prompt_lookup_min ({self.prompt_lookup_min})")
        if self.method == "layer_skip":
            if self.num_draft_layers is None:
                raise ValueError("speculative_config method 'layer_skip' needs num_draft_layers (L')")
            check_int("num_draft_layers", self.num_draft_layers, 1, prefix="speculative_config ")
        if self.method in ("draft_model", *LEARNED) and self.model is None:
            raise ValueError(f"speculative_config method {self.method!r} needs a 'model' (a path or a built one)")

    def speculative_tokens(self, batch_size: int) -> int:
        """k for a step with this many running sequences (0: speculation off for the step)."""
        limit = self.disable_by_batch_size
        return 0 if limit is not None and batch_size > limit else self.num_speculative_tokens


def add_cli_args(parser) -> None:
    """--speculative-* flags (minillm generate / chat / bench): vLLM's speculative_config keys."""
    g = parser.add_argument_group("speculative decoding (chapter 09)")
    g.add_argument("--speculative-method", choices=METHODS, default=None,
                   help="draft tokens with: ngram (prompt lookup), layer_skip (the model's first layers), "
                        "draft_model, or trained medusa heads / an eagle layer (--speculative-model)")
    g.add_argument("--speculative-model", default=None, help="the draft model (same tokenizer): a file, folder or id")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="k, draft tokens per step")
    g.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest suffix matched (1)")
    g.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest suffix matched (3)")
    g.add_argument("--num-draft-layers", type=int, default=None, help="layer_skip: layers the draft keeps")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafts in steps with more running sequences than this")
    g.add_argument("--speculative-min-acceptance-rate", type=float, default=None,
                   help="a sequence whose recent drafts are accepted less often than this pauses drafting")


def from_cli_args(args) -> dict | None:
    """The speculative_config the flags name; None when none is given."""
    d = {"method": args.speculative_method, "model": args.speculative_model,
         "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": args.prompt_lookup_min,
         "prompt_lookup_max": args.prompt_lookup_max, "num_draft_layers": args.num_draft_layers,
         "disable_by_batch_size": args.speculative_disable_by_batch_size,
         "min_acceptance_rate": args.speculative_min_acceptance_rate}
    d = {k: v for k, v in d.items() if v is not None}
    if not d:
        return None
    if "method" not in d and "model" not in d:
        raise ValueError("--num-speculative-tokens and the other speculative flags need --speculative-method "
                         "or --speculative-model")
    return d
