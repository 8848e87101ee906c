"""The launcher's datasets checked before Megatron-LM reads them, as the examples check theirs.

Megatron-LM's own ``IndexedDataset`` trusts its files: a wrong dtype code in the ``.idx`` reads
the ``.bin`` as other numbers (tokens from misread bytes), a float dataset has its ids truncated,
a truncated ``.bin`` fails inside numpy without the file's name, and a token id outside the
vocabulary shows only when its batch comes (a negative one indexes the embedding from its end).
So, once Megatron-LM has parsed its arguments and built its tokenizer (its
``set_global_variables``, before torch.distributed starts), every dataset prefix its flags name
goes through the examples' opener (`megatron_dcp.data.open_dataset`: header, version, integer
dtype, lengths and pointers against the ``.bin``'s size, every token id in
``[0, tokenizer vocab_size)``, the id range cached by the index's checksum). A problem stops the
rank with one line naming the file (``SystemExit``: no traceback), with and without ``--dcp``.

The prefixes are those of Megatron-LM's own ``get_blend_and_blend_per_split`` (``--data-path``
and ``--data-args-path``, or ``--train-data-path``/``--valid-data-path``/``--test-data-path``
and ``--per-split-data-args-path``; weights interleaved with prefixes), so the check reads
exactly what Megatron-LM will. ``--mock-data`` and ``--sft`` (jsonl) read no indexed dataset.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Optional

from megatron_dcp import patching
from megatron_dcp.patching import PatchSet

NAME = "megatron-lm-data"
SOURCES = ("--data-path", "--data-args-path", "--train-data-path", "--valid-data-path",
           "--test-data-path", "--per-split-data-args-path")
"""The flags whose datasets are checked (Megatron-LM's blend flags)."""


def data_prefixes(args: argparse.Namespace) -> list[str]:
    """Every indexed-dataset prefix Megatron-LM will read for ``args`` (in flag order, each
    once), from Megatron-LM's own blend parser; [] for ``--mock-data`` and ``--sft``. A flag
    Megatron-LM cannot parse (a missing ``--data-args-path`` file, an odd blend) is a
    ValueError naming the flags."""
    if getattr(args, "mock_data", False) or getattr(args, "sft", False):
        return []
    from megatron.training.utils import get_blend_and_blend_per_split

    try:
        blend, per_split = get_blend_and_blend_per_split(args)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        given = [f for f in SOURCES if getattr(args, f[2:].replace("-", "_"), None) is not None]
        raise ValueError(f"{' / '.join(given) or 'the data flags'}: Megatron-LM cannot read the "
                         f"blend ({type(err).__name__}: {err}); give PREFIX, or WEIGHT PREFIX "
                         "pairs") from None
    blends = [blend] if blend is not None else list(per_split or ())
    out: list[str] = []
    for each in blends:
        for prefix in (each[0] if each is not None else ()):
            if prefix not in out:
                out.append(prefix)
    return out


def check_data_args(args: argparse.Namespace, vocab_size: Optional[int]) -> list[str]:
    """`data_prefixes` of ``args``, each opened and checked by the examples' opener
    (`megatron_dcp.data.open_dataset`; token ids against ``vocab_size`` unless None).
    Returns the prefixes; raises ValueError naming the first bad file."""
    from megatron_dcp.data import open_dataset

    prefixes = data_prefixes(args)
    for prefix in prefixes:
        if "://" in prefix:  # an object store (Megatron's multi-storage client): not local files
            continue
        open_dataset(prefix, vocab_size)
    return prefixes


def tokenizer_vocab_size(args: argparse.Namespace) -> Optional[int]:
    """The vocabulary token ids must fall in: the tokenizer's ``vocab_size`` (Megatron-LM's
    ``get_tokenizer()``), else the padded one, else None (no tokenizer built)."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer built (build_tokenizer=False)
        padded = getattr(args, "padded_vocab_size", None)
        return int(padded) if padded else None


def _checked(set_global_variables: Callable) -> Callable:
    """Megatron-LM's ``set_global_variables`` (args set, tokenizer built), then the data check:
    a bad dataset ends the rank with one line (status 1) before any dataset is built."""
    @functools.wraps(set_global_variables)
    def run(args: Any, *rest: Any, **kwargs: Any):
        out = set_global_variables(args, *rest, **kwargs)
        try:
            check_data_args(args, tokenizer_vocab_size(args))
        except (OSError, ValueError) as err:
            raise SystemExit(f"megatron_dcp.megatron.run: {err}") from None
        return out

    return run


def _install(patches: PatchSet) -> None:
    import megatron.training.global_vars as global_vars

    patches.replace("megatron.training.global_vars", "set_global_variables",
                    _checked(global_vars.set_global_variables), check=callable)


def enable_data_checks() -> None:
    """Check the datasets Megatron-LM's flags name when its arguments are set (idempotent).
    Without Megatron-LM's ``megatron.training`` (megatron-core 0.16's wheel) nothing reads its
    data flags: nothing to check."""
    import importlib.util

    try:
        if importlib.util.find_spec("megatron.training") is None:
            return
    except ModuleNotFoundError:  # no megatron at all
        return
    patching.apply(NAME, "megatron-core", _install)
