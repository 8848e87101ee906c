"""`DCPConfig`: the one source of every DCP setting.

The same dataclass has three faces, all generated from the fields below and their docstrings:

* CLI / DeepSpeed flags: ``DCPConfig.add_arguments(parser)`` gives ``--dcp``, ``--dcp_max_degree`` ...
  (DeepSpeed's underscore style, like ``--deepspeed_config``);
* Megatron flags: ``DCPConfig.add_arguments(parser, style="megatron")`` gives ``--dcp``,
  ``--dcp-max-degree`` ... (Megatron's dashed style; argparse dest is the same);
* DeepSpeed JSON: the ``"dcp"`` section, ``DCPConfig.from_dict(cfg["dcp"])``; unknown keys are an error.

Pure Python: importable without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

POLICIES = ("dcp", "dcp-inter", "dcp-intra", "bucket", "packed", "static", "greedy-cp")
LAYOUTS = ("auto", "ulysses", "ring", "hybrid")
ULYSSES_SCOPES = ("any", "node")
RECOMPUTE_MODES = ("auto", "none", "full")
LOSS_REDUCTIONS = ("token", "sequence", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                   "seq-mean-token-sum-norm")
"""Loss normalisations (`megatron_dcp.runtime.targets.LossWeights`): ``token`` (= RL trainers'
``token-mean``), ``sequence`` (= ``seq-mean-token-mean``), ``seq-mean-token-sum`` and
``seq-mean-token-sum-norm`` (the names verl's ``loss_agg_mode`` uses)."""
IGNORE_INDEX = -100
"""Label of a token without a next-token target (a sequence's last token, padding); the loss
ignores it (torch's ``cross_entropy`` default)."""
OVERSIZE_MODES = ("error", "truncate", "skip")
SCHEDULES = ("auto", "free", "lockstep")
CALIBRATION_MODES = ("on", "off")
PLAN_AHEAD_MODES = ("on", "off")
LONG_SEQUENCE_MODES = ("auto", "on", "off")
WITHOUT_DCP = ("skip_nonfinite",)
"""Fields every engine honours in its plain data-parallel run too (no ``--dcp`` needed)."""


class DCPConfigError(ValueError):
    """A DCP setting is invalid (unknown key, value out of range, bad combination)."""


def int_flag(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (``--train-iters -2`` is an error
    naming the value, not a run of zero iterations)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


MAX_WORLD_SIZE = 1 << 20
"""Largest world a plan may have (a plan JSON's ``world_size``: per-rank tables are sized by it;
the tools' ``--gpus``)."""


def world_size_flag(text: str) -> int:
    """An argparse ``type`` for a tool's ``--gpus``: a whole number of ranks from 1 to the plan
    format's ``MAX_WORLD_SIZE`` (1,048,576): a larger world is refused before minutes of work
    that no plan could hold."""
    value = int_flag(1)(text)
    if value > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"{value}: more than {MAX_WORLD_SIZE:,} ranks, the "
                                         "plan format's cap")
    return value


def arg_value(args: Any, name: str, default: Any = None) -> Any:
    """``args.name`` (a parsed flag of Megatron's or the examples'), ``default`` where the
    namespace lacks it or holds None (a flag left unset)."""
    value = getattr(args, name, default)
    return default if value is None else value


def file_in_the_way(folder: str) -> str:
    """Why ``folder`` cannot be a folder (``"is a file"``, ``"lies under F, which is a file"``):
    its nearest existing path is a file; ``""`` when nothing is in the way."""
    import os

    blocker = os.path.abspath(folder)
    while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)
    if not os.path.exists(blocker) or os.path.isdir(blocker):
        return ""
    return "is a file" if blocker == os.path.abspath(folder) else \
        f"lies under {blocker}, which is a file"


def output_file(text: str) -> str:
    """An argparse ``type``: a file path the run can write (its folder exists and is writable,
    and it is not a folder; an existing file opens for writing: not a file of /proc, which root's
    `os.access` passes), checked at start, not at the first row after the model is built."""
    import os
    import stat

    folder = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder or empty: give a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist (create it "
                                         "first)")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    if os.path.exists(text):  # root passes os.access; a file of /proc or /sys refuses the write
        try:
            fd = os.open(text, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)  # nothing written
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):  # what opening to append does
                    os.lseek(fd, 0, os.SEEK_END)
            finally:
                os.close(fd)
        except OSError as err:
            raise argparse.ArgumentTypeError(f"{text}: cannot be written ({err.strerror or err}):"
                                             " give a file path") from None
    return text


def float_flag(minimum: float = 0.0, *, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number above ``minimum`` (or at least it, ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            bound = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"{value}: must be a finite number {bound} {minimum}")
        return value

    parse.__name__ = "number"
    return parse


@dataclass
class DCPConfig:
    """Data-centric parallel settings; see each field's docstring (also the ``--help`` text)."""

    enabled: bool = False
    """Turn data-centric parallel on (flag: ``--dcp``)."""

    policy: str = "dcp"
    """Planner: dcp (inter+intra), dcp-inter, dcp-intra, or a baseline: bucket, packed, static, greedy-cp."""

    max_degree: Optional[int] = None
    """Largest sequence-parallel degree (ranks per sequence) the planner may use; default: the DCP world."""

    attention_layout: str = "auto"
    """Sequence-parallel attention: auto (ulysses where heads divide, else hybrid/ring), ulysses, ring, hybrid."""

    ulysses_scope: str = "any"
    """Where Ulysses sub-groups may lie: any, or node (inside one node; groups spanning nodes run ring across nodes: fewer communicators per rank)."""

    recompute: str = "auto"
    """Activation recompute: auto (fewest recomputed layers that fit memory), none, full (every layer)."""

    memory_budget_gb: Optional[float] = None
    """Memory per rank the planner may fill, in GiB; default: the hardware's memory x memory_fraction."""

    memory_fraction: float = 0.9
    """Share of device memory usable when memory_budget_gb is not given."""

    max_tokens_per_rank: Optional[int] = None
    """A budget in tokens (as Megatron's --max-seqlen-per-dp-cp-rank): the most tokens of a task one rank holds; longer sequences split over more ranks. The memory budget still applies; recompute does not raise the cap."""

    hardware: str = "auto"
    """Cost-model hardware: auto (the preset of the GPU the run is on, or a CPU start that calibration corrects; planning offline: h200), a preset name (h200, h100, a100) or a profile JSON (tools/profile_hardware.py)."""

    calibration: str = "on"
    """Online calibration of the cost model from the measured task and step times of recent steps: on, or off (plans a pure function of the lengths and the hardware given)."""

    plan_ahead: str = "on"
    """Plan the next global batch on a background thread while the current step runs (when the caller passes the next batch's lengths: both examples, deepspeed_plugin and DCPForwardBackward do), with the hardware fit the current step started with: on, or off (plan at the start of every step, with the latest fit)."""

    ranks_per_node: Optional[int] = None
    """Ranks per node for the cost model's link speeds; default: the hardware preset's value."""

    pack_tokens: Optional[int] = None
    """Token budget of one packed task of short sequences; default: chosen by the planner from memory."""

    loss_reduction: str = "token"
    """Loss normalisation over the global batch (w: a target's weight, 1 unless the batch carries weights): token (= token-mean: sum of w x loss / sum of w), sequence (= seq-mean-token-mean: mean over sequences of their weighted means), seq-mean-token-sum (mean over sequences of their weighted sums), seq-mean-token-sum-norm (sum of w x loss / a constant: the batch's norm, default its longest sequence)."""

    oversize: str = "error"
    """A sequence that fits no degree in memory: error (name it), truncate (to the largest that fits), skip."""

    schedule: str = "auto"
    """Micro-step schedule: free (ranks run different numbers of micro-steps), lockstep (every rank runs the same slots, each slot one number of recomputed layers: what ZeRO-2/3's sharded gradients and parameters need), auto (lockstep for ZeRO-2/3, else free)."""

    liveness_interval_s: float = 60.0
    """Seconds between the liveness watch's probes (by the first and the last rank); a rank that misses two in a row (stopped, hung in a device call, dead) is named on every rank and the job ends then, not at the collective timeout; 0: no watch (a stalled rank is named when a collective times out)."""

    long_sequences: str = "auto"
    """Long-sequence choices per task: a task whose sequence fits no degree, layout and recomputed layers in memory recomputes every layer and gets MLP tiles, loss tiles and the fewest layer inputs offloaded to host memory that fit (docs/USAGE.md, "Long sequences"). on: every plan may use them; auto: a batch whose longest sequence fits no group plainly is planned with them, every other batch as with off (its plan unchanged), and off where the engine cannot run them (recompute none, pipeline stages, experts, a model or loss without tiled losses); off: never (a sequence that fits no group is dcp.oversize's). A bare --dcp-long-sequences means on; JSON true/false mean on/off."""

    skip_nonfinite: bool = False
    """A step whose loss or gradient norm is not finite is skipped (no update, counted in the log) instead of stopping the job before it saves; honoured with and without --dcp (an fp16 loss scaler's overflow steps are skipped by the engine either way)."""

    def __post_init__(self) -> None:
        if isinstance(self.long_sequences, bool):  # JSON true / false, the field's older type
            self.long_sequences = "on" if self.long_sequences else "off"
        if self.long_sequences == "auto" and self.recompute == "none":
            self.long_sequences = "off"  # a long task recomputes every layer
        self.validate()

    @property
    def long_sequences_on(self) -> bool:
        """Whether every plan may use long-sequence choices (``long_sequences="on"``)."""
        return self.long_sequences == "on"

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field's type and range; the error names the field and its value."""
        self._check_types()

        def one_of(name: str, allowed: tuple) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise DCPConfigError(f"dcp.{name}={value!r}: must be one of {', '.join(allowed)}")

        one_of("policy", POLICIES)
        one_of("attention_layout", LAYOUTS)
        one_of("ulysses_scope", ULYSSES_SCOPES)
        one_of("recompute", RECOMPUTE_MODES)
        one_of("loss_reduction", LOSS_REDUCTIONS)
        one_of("oversize", OVERSIZE_MODES)
        one_of("schedule", SCHEDULES)
        one_of("calibration", CALIBRATION_MODES)
        one_of("plan_ahead", PLAN_AHEAD_MODES)
        one_of("long_sequences", LONG_SEQUENCE_MODES)
        if self.max_degree is not None and self.max_degree < 1:
            raise DCPConfigError(f"dcp.max_degree={self.max_degree!r}: must be a positive integer")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise DCPConfigError(f"dcp.memory_budget_gb={self.memory_budget_gb!r}: must be > 0")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise DCPConfigError(f"dcp.max_tokens_per_rank={self.max_tokens_per_rank!r}: must "
                                 "be a positive integer")
        if not 0 < self.memory_fraction <= 1:
            raise DCPConfigError(f"dcp.memory_fraction={self.memory_fraction!r}: must be in (0, 1]")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise DCPConfigError(f"dcp.ranks_per_node={self.ranks_per_node!r}: must be >= 1")
        if self.pack_tokens is not None and self.pack_tokens < 1:
            raise DCPConfigError(f"dcp.pack_tokens={self.pack_tokens!r}: must be >= 1")
        if self.liveness_interval_s < 0:
            raise DCPConfigError(f"dcp.liveness_interval_s={self.liveness_interval_s!r}: must be "
                                 ">= 0 (0: no watch)")
        if self.long_sequences == "on" and self.recompute == "none":
            raise DCPConfigError("dcp.long_sequences needs dcp.recompute auto or full: a long "
                                 "task recomputes every layer (its tiles and offloaded inputs "
                                 "are recomputed in backward)")
        if not self.hardware:
            raise DCPConfigError("dcp.hardware='': must name a preset or a profile JSON")

    def _check_types(self) -> None:
        """JSON gives strings, floats and booleans where the fields want others: ``"10"`` for a
        number, ``"no"`` for a bool (truthy), ``true`` or ``100.5`` for an integer. None of them
        is coerced."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _field_type(f)
            if value is None and "Optional" in str(f.type):
                continue
            if kind is bool:
                ok = isinstance(value, bool)
                want = "true or false"
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
                want = "an integer"
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value)
                want = "a finite number"
            else:
                ok = isinstance(value, str)
                want = "a string"
            if not ok:
                raise DCPConfigError(f"dcp.{f.name}={value!r} ({type(value).__name__}): must be "
                                     f"{want}")

    def check_world(self, dcp_world_size: int) -> None:
        """Errors that need the DCP world size (known once the job runs)."""
        if self.max_degree is not None and self.max_degree > dcp_world_size:
            raise DCPConfigError(
                f"dcp.max_degree={self.max_degree} exceeds the DCP world size {dcp_world_size}"
            )

    # ------------------------------------------------------------------ dict / JSON face
    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> "DCPConfig":
        """Build from DeepSpeed's ``"dcp"`` JSON section. ``"enabled"`` defaults to True there;
        unknown keys and values of the wrong type (`validate`) are errors naming the key."""
        if not isinstance(section, dict):
            raise DCPConfigError('the "dcp" config section must be an object, got '
                                 f"{type(section).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise DCPConfigError(
                f'unknown key(s) in the "dcp" config section: {", ".join(unknown)}; '
                f"known keys: {', '.join(sorted(known))}"
            )
        values = {"enabled": True, **section}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> "DCPConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ argparse face
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, style: str = "deepspeed") -> argparse.ArgumentParser:
        """Add ``--dcp`` and its knobs to ``parser``.

        ``style="deepspeed"``: ``--dcp_max_degree``, with ``--dcp-max-degree`` accepted too
        (DeepSpeed scripts mix both spellings); ``style="megatron"``: ``--dcp-max-degree``.
        Every flag's dest is ``dcp`` / ``dcp_<field>`` in both styles.
        """
        if style not in ("deepspeed", "megatron"):
            raise ValueError(f"style must be 'deepspeed' or 'megatron', got {style!r}")
        sep = "_" if style == "deepspeed" else "-"
        group = parser.add_argument_group("DCP", "Data-centric parallel (megatron-dcp)")
        docs = _field_docs()
        for f in fields(cls):
            help_text = docs.get(f.name, "")
            if f.name == "enabled":
                group.add_argument("--dcp", dest="dcp", action="store_true", help=help_text)
                continue
            flag = "--dcp" + sep + f.name.replace("_", sep)
            flags = [flag] if sep == "-" else [flag, "--dcp-" + f.name.replace("_", "-")]
            dest = "dcp_" + f.name
            kind = _field_type(f)
            kwargs: dict[str, Any] = dict(dest=dest, default=None, help=f"{help_text} (default: {f.default})")
            if kind is bool:  # a switch: given is True, absent None (the JSON or default decides)
                group.add_argument(*flags, action="store_true", **kwargs)
                continue
            choices = _CHOICES.get(f.name)
            if choices:
                kwargs["choices"] = choices
            if f.name in _BARE:
                kwargs.update(nargs="?", const=_BARE[f.name])
            group.add_argument(*flags, type=kind, **kwargs)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, base: Optional["DCPConfig"] = None, *,
                  style: str = "deepspeed", used_without_dcp: tuple[str, ...] = ()
                  ) -> "DCPConfig":
        """Config from parsed flags; flags given override ``base`` (e.g. the JSON section).

        Without ``--dcp`` (and without ``base.enabled``), a ``--dcp*`` knob would be silently
        ignored, so it is an error (named in ``style``), except the fields in
        ``used_without_dcp``: those the engine's plain data-parallel run honours as well.
        """
        values = (base or cls()).to_dict()
        if getattr(args, "dcp", False):
            values["enabled"] = True
        for f in fields(cls):
            if f.name == "enabled":
                continue
            v = getattr(args, "dcp_" + f.name, None)
            if v is not None:
                values[f.name] = v
        config = cls(**values)
        if not config.enabled:
            given = sorted(f.name for f in fields(cls) if f.name != "enabled"
                           and f.name not in used_without_dcp + WITHOUT_DCP
                           and getattr(args, "dcp_" + f.name, None) is not None)
            if given:
                sep = "_" if style == "deepspeed" else "-"
                flags = ", ".join("--dcp" + sep + name.replace("_", sep) for name in given)
                raise DCPConfigError(f"{flags} given without --dcp (add --dcp to turn DCP on)")
        return config


_CHOICES = {
    "policy": POLICIES,
    "attention_layout": LAYOUTS,
    "ulysses_scope": ULYSSES_SCOPES,
    "recompute": RECOMPUTE_MODES,
    "loss_reduction": LOSS_REDUCTIONS,
    "oversize": OVERSIZE_MODES,
    "schedule": SCHEDULES,
    "calibration": CALIBRATION_MODES,
    "plan_ahead": PLAN_AHEAD_MODES,
    "long_sequences": LONG_SEQUENCE_MODES,
}
_BARE = {"long_sequences": "on"}
"""Choice flags that may be given bare, and what that means (a switch's older spelling)."""


def _field_type(f: dataclasses.Field) -> type:
    """The Python type of a field (bool, int, float or str), from its annotation."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if t == "bool":
        return bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def _field_docs() -> dict[str, str]:
    """Field docstrings (the string literal under each field), read from this file's source."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(DCPConfig))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()  # type: ignore[attr-defined]
    return docs
