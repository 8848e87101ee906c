"""Checkpoints of a megatron-core training job: model chunks, optimizer, iteration and any extra
resumable state (the data position, DCP's planner), saved atomically and verified before load.

Two formats (``ckpt_format``, Megatron-LM's ``--ckpt-format`` names where they exist):

* ``"torch"``: every rank writes one file ``TAG/rank_{r}.pt`` (its model chunks' state dict,
  its optimizer's state, the extra state), checksummed as it is written, and reads it back with
  ``torch.load(weights_only=True)``. It loads only at the layout it was saved with: world size,
  tensor- and pipeline-parallel sizes, the model chunks per rank (virtual pipeline stages) and
  the optimizer kind are recorded in the manifest and a difference is refused, naming it.
* ``"torch_dist"``: Megatron's distributed checkpointing (`megatron.core.dist_checkpointing`):
  each model chunk's ``sharded_state_dict`` (``model``, or ``model0``, ``model1`` ... per
  virtual stage, as Megatron-LM names them) and the optimizer's are written as global tensors,
  so a load at another data-parallel size reassembles what each rank holds now. Layer keys are
  global: megatron-core numbers a chunk's layers from its offset in the whole model (the chunk's
  ``vp_stage``, interleaved over the stages), so the chunks must be built with their
  ``vp_stage``. The distributed optimizer is saved as ``dp_reshardable`` (megatron-core 0.16's
  other formats fail without Apex or Transformer Engine: docs/MEGATRON.md): its states follow
  the gradient buffers of each chunk, so with it TP, PP and the virtual stages must match. The
  iteration and the extra state go beside them in ``TAG/state.pt`` (rank 0's, read by every
  rank with ``weights_only=True``). Without the distributed optimizer a load may change TP or PP,
  but a tensor whose global shape differs from the checkpoint's (the padded vocabulary, a
  multiple of ``--make-vocab-size-divisible-by`` x TP) is refused, naming the flag value that
  fits: megatron-core would load the overlapping rows and keep the others random.

No file runs code on load (`megatron_dcp.runtime.safe_load`): ``rank_{r}.pt``, ``state.pt`` and
``common.pt`` are read with ``weights_only=True``; torch.distributed.checkpoint's ``.metadata``
(which torch reads with ``pickle.load``) with an unpickler admitting only its own classes, on
every rank before megatron-core reads anything, and megatron-core's load itself reads through
`SafeFileSystemReader` (also checking the byte items torch's planner would unpickle fully). A
refusal names the file and the class, on every rank alike.

Both go through `megatron_dcp.runtime.checkpoint_dir`: written into ``TAG.partial``, every file's
size and CRC-32 in the manifest (Megatron's files are checksummed by reading them back once),
``latest`` moved only after every rank confirmed; a load verifies every file first and falls
back from a corrupt ``latest`` to the newest checkpoint that verifies
(`megatron_dcp.runtime.checkpoint_verify`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp import patching
from megatron_dcp.megatron.parallel import MegatronParallel, job_parallel
from megatron_dcp.patching import PatchSet
from megatron_dcp.runtime.checkpoint_dir import CheckpointError, save_atomically, save_file
from megatron_dcp.runtime.checkpoint_verify import agree, split_load_path, verify_checkpoint
from megatron_dcp.runtime.safe_load import SafeFileSystemReader, load_weights

FORMATS = ("torch", "torch_dist")
_LEGACY = {"virtual_pipeline": 1}  # what a manifest written before the key was recorded held
STATE_FILE = "state.pt"  # torch_dist: iteration and extra state beside Megatron's files
COMMON_FILE = "common.pt"  # torch_dist: megatron-core's non-sharded state
# the distributed optimizer's format that reshards in every dimension (megatron-core 0.16)
SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def parallel_layout(model: Any, optimizer: Any,
                    parallel: Optional[MegatronParallel] = None) -> dict[str, Any]:
    """The layout a checkpoint records: world, tensor-, pipeline- and data-parallel sizes (of
    ``parallel``, Megatron's layout of the job; ``None``: the job's, `job_parallel`), the model
    chunks per rank (``virtual_pipeline``: 1 without virtual stages) and whether the optimizer
    is Megatron's distributed one."""
    parallel = parallel if parallel is not None else job_parallel()
    return {"world_size": dist.get_world_size(),
            "tensor_parallel": parallel.tensor,
            "pipeline_parallel": parallel.pipeline,
            "virtual_pipeline": len(_chunks(model)),
            "data_parallel": dist.get_world_size(parallel.data_group),
            "distributed_optimizer": is_distributed_optimizer(optimizer)}


def is_distributed_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or one it chains) is Megatron's `DistributedOptimizer`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer)
               for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _chunks(model: Any) -> list:
    """The model chunks (a list under virtual pipelines), each unwrapped from Megatron's DDP."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [getattr(c, "module", c) for c in chunks]


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"  # Megatron-LM's keys


def save_checkpoint(save_dir: str, iteration: int, model: Any, optimizer: Any,
                    extra: Optional[dict] = None, *, ckpt_format: str = "torch",
                    parallel: Optional[MegatronParallel] = None) -> str:
    """Collective: save model chunk(s) (Megatron DDP or their modules), ``optimizer`` (a torch
    optimizer or Megatron's), ``iteration`` and ``extra`` (tensors and plain types) as
    ``SAVE_DIR/iter_{iteration}`` and point ``latest`` at it; returns its path. ``parallel``:
    Megatron's layout of the job (``None``: the job's, `job_parallel`)."""
    _check_format(ckpt_format)
    meta = {**parallel_layout(model, optimizer, parallel), "ckpt_format": ckpt_format,
            "iteration": iteration}
    rank = dist.get_rank()
    if ckpt_format == "torch":
        state = {"model": [c.state_dict() for c in _chunks(model)],
                 "optimizer": _optimizer_state(optimizer), "iteration": iteration,
                 "extra": extra}

        def write(tag: str) -> dict[str, str]:
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            path = os.path.join(save_dir, tag, f"rank_{rank}.pt")
            return {path: save_file(state, path)}  # checksummed while written
    else:
        def write(tag: str) -> dict[str, str]:
            from megatron.core import dist_checkpointing

            path = os.path.join(save_dir, tag)
            os.makedirs(path, exist_ok=True)
            dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), path)
            if rank != 0:
                return {}
            target = os.path.join(path, STATE_FILE)
            return {target: save_file({"iteration": iteration, "extra": extra}, target)}
    return save_atomically(save_dir, f"iter_{iteration}", write, meta=meta)


def load_checkpoint(load: str, model: Any, optimizer: Any, *, ckpt_format: str = "torch",
                    vocab_size: Optional[int] = None,
                    vocab_divisible_by: Optional[int] = None,
                    parallel: Optional[MegatronParallel] = None) -> tuple[int, Optional[dict]]:
    """Collective: restore model chunk(s) and ``optimizer`` from ``load`` (a save directory, its
    ``latest`` loaded, or one checkpoint in it), verified first; returns ``(iteration, extra)``.
    Raises `CheckpointError` naming what differs when the checkpoint cannot load here: another
    format, (``"torch"``) another layout, (``"torch_dist"``) a tensor of another global shape
    (the padded vocabulary: ``vocab_size``, the real one, and ``vocab_divisible_by``, Megatron's
    ``--make-vocab-size-divisible-by``, give the value that would fit); a file that asks for
    anything its format does not hold is refused (`megatron_dcp.runtime.safe_load`), on every
    rank alike, before anything is loaded. ``parallel``: Megatron's layout of the job
    (``None``: the job's, `job_parallel`)."""
    _check_format(ckpt_format)
    parallel = parallel if parallel is not None else job_parallel()
    load_dir, tag = split_load_path(load)
    tag, manifest = verify_checkpoint(load_dir, tag)
    path = os.path.join(load_dir, tag)
    saved_format = manifest.get("ckpt_format", "torch")
    if saved_format != ckpt_format:
        raise CheckpointError(f"checkpoint {path} is in format {saved_format!r}: load it with "
                              f"--ckpt-format {saved_format} (this run: {ckpt_format})")
    want = parallel_layout(model, optimizer, parallel)
    if ckpt_format == "torch":
        keys = ["world_size", "tensor_parallel", "pipeline_parallel", "virtual_pipeline",
                "distributed_optimizer"]
        why = "; the per-rank format loads only at the layout it was saved with (torch_dist " \
              "reshards)"
    elif want["distributed_optimizer"]:
        keys = ["tensor_parallel", "pipeline_parallel", "virtual_pipeline",
                "distributed_optimizer"]
        why = "; the distributed optimizer's states (dp_reshardable) reshard over data " \
              "parallel only"
    else:
        keys, why = ["distributed_optimizer"], ""
    saved = {**_LEGACY, **manifest}
    differ = {k: (saved.get(k), want[k]) for k in keys if saved.get(k) != want[k]}
    if differ:
        raise CheckpointError(f"checkpoint {path} was saved with "
                              + ", ".join(f"{k}={a} (this run: {b})" for k, (a, b) in
                                          differ.items()) + why)
    if ckpt_format == "torch":
        state = _read(os.path.join(path, f"rank_{dist.get_rank()}.pt"))
        for chunk, saved in zip(_chunks(model), state["model"], strict=True):
            chunk.load_state_dict(saved)
        _load_optimizer_state(optimizer, state["optimizer"])
    else:
        state = _load_torch_dist(path, model, optimizer, vocab_size, vocab_divisible_by,
                                 parallel.tensor)
    return int(state["iteration"]), state["extra"]


def _load_torch_dist(path: str, model: Any, optimizer: Any, vocab_size: Optional[int],
                     divisible_by: Optional[int], tensor_parallel: int) -> dict:
    """Collective: every file of the torch_dist checkpoint ``path`` that unpickles checked on
    every rank (and the tensors' global shapes against this run's, at ``tensor_parallel``)
    before megatron-core reads any, then its load through the safe reader; returns
    ``state.pt``'s content."""
    from megatron.core import dist_checkpointing

    create_optimizer_states(optimizer)
    sharded = _sharded_state(model, optimizer, is_loading=True)
    problem, state = "", {}
    try:  # every file that unpickles, checked on every rank before Megatron reads any
        state = _read(os.path.join(path, STATE_FILE))
        if os.path.exists(os.path.join(path, COMMON_FILE)):  # megatron-core 0.16's format
            _read(os.path.join(path, COMMON_FILE))
        problem = shape_problem(path, sharded, saved_shapes(path), vocab_size, divisible_by,
                                tensor_parallel)
    except CheckpointError as err:
        problem = str(err)
    except Exception as err:  # noqa: BLE001 - raised on every rank alike by agree, not alone
        problem = f"checkpoint {path}: {type(err).__name__}: {err}"
    agree(problem)  # raises on every rank when any rank found a problem
    strategies = {"sharded_strategy": _safe_sharded_strategy()}
    if "common_strategy" in inspect.signature(dist_checkpointing.load).parameters:
        strategies["common_strategy"] = _safe_common_strategy()  # 0.16: common.pt
    with _safe_torch_dist_reads():  # 0.19: the common state is an item of the torch_dist files
        loaded = dist_checkpointing.load(sharded, path, **strategies)
    chunks = _chunks(model)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[_model_key(i, len(chunks))])
    with torch.no_grad():  # fp32: the optimizer's shards are views of the parameters
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_steps(optimizer, loaded["optimizer"])
    return state


def _check_format(ckpt_format: str) -> None:
    if ckpt_format not in FORMATS:
        raise ValueError(f"ckpt_format {ckpt_format!r}: one of {', '.join(FORMATS)}")


def _read(path: str) -> dict:
    """``torch.load(weights_only=True)``: tensors and plain types, nothing in the file runs (a
    file that asks for more is refused naming it and the class: `load_weights`)."""
    return load_weights(path)


def saved_shapes(path: str) -> dict[str, tuple]:
    """The global shape of every tensor in the torch_dist checkpoint ``path``, from its
    ``.metadata`` (read with only its own classes admitted)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(path).read_metadata()
    return {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


_VOCAB_KEYS = ("word_embeddings.weight", "output_layer.weight")


def shape_problem(path: str, sharded: dict, saved: dict[str, tuple],
                  vocab_size: Optional[int], divisible_by: Optional[int],
                  tensor_parallel: int) -> str:
    """Why this rank's tensors cannot load from the checkpoint's (a global shape differs:
    megatron-core loads the overlapping part of a tensor it marks ``allow_shape_mismatch``,
    the padded vocabulary rows among them, and leaves the rest as initialised), or ``""``.
    ``tensor_parallel``: this run's size, for the ``--make-vocab-size-divisible-by`` that
    fits."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    differ = {}
    for tensor in nested_values(sharded):
        if isinstance(tensor, ShardedTensor) and tensor.key in saved and \
                tuple(tensor.global_shape) != saved[tensor.key]:
            differ.setdefault(tensor.key, (saved[tensor.key], tuple(tensor.global_shape)))
    if not differ:
        return ""
    vocab = {k: v for k, v in differ.items() if k.endswith(_VOCAB_KEYS)}
    text = (f"checkpoint {path} holds tensors of another shape than this run builds: "
            + ", ".join(f"{k} {list(a)} (this run: {list(b)})" for k, (a, b) in
                        list(differ.items())[:4]) + (" ..." if len(differ) > 4 else ""))
    if vocab:
        (saved_rows, *_), (rows, *_) = next(iter(vocab.values()))
        text += (f"; the padded vocabulary differs ({saved_rows} rows saved, {rows} here): "
                 "Megatron pads it to a multiple of --make-vocab-size-divisible-by x "
                 "tensor-parallel size, so a change of tensor parallelism changes it, and "
                 "loading would keep the extra rows random (a different model)")
        hint = _divisible_by_hint(saved_rows, vocab_size, tensor_parallel)
        if hint:
            text += f"; resume with --make-vocab-size-divisible-by {hint}, which pads to " \
                    f"{saved_rows} here"
        elif divisible_by is not None:
            text += "; no --make-vocab-size-divisible-by pads to the saved size at this " \
                    "tensor-parallel size"
    return text


def _divisible_by_hint(saved_rows: int, vocab_size: Optional[int], tp: int) -> Optional[int]:
    """The largest ``--make-vocab-size-divisible-by`` that pads ``vocab_size`` to
    ``saved_rows`` at tensor-parallel size ``tp``, or None."""
    if vocab_size is None:
        return None
    for d in range(saved_rows // tp, 0, -1):
        m = d * tp
        if -(-vocab_size // m) * m == saved_rows:
            return d
    return None


SAFE_READS = "megatron-safe-reads"
"""The registry name of the checked reader megatron-core's torch_dist loads read through."""


def _safe_reader(path: Any, *args: Any, **kwargs: Any) -> SafeFileSystemReader:
    return SafeFileSystemReader(path)


def _install_safe_reads(patches: PatchSet) -> None:
    """megatron-core's torch_dist strategies read through `SafeFileSystemReader` (``.metadata``
    with its own classes only; byte items checked ``weights_only``): the module function they
    call for a reader is replaced (0.19's serialization reads the common state with the same
    function, imported)."""
    from megatron.core.dist_checkpointing import serialization

    patches.replace("megatron.core.dist_checkpointing.strategies.torch",
                    "_get_filesystem_reader", _safe_reader, aliases=False)
    if hasattr(serialization, "_get_filesystem_reader"):
        patches.replace("megatron.core.dist_checkpointing.serialization",
                        "_get_filesystem_reader", _safe_reader, aliases=False)


def _safe_torch_dist_reads() -> ContextManager[None]:
    """While inside, megatron-core's torch_dist loads read through the checked reader
    (`_install_safe_reads`); undone on exit."""
    return patching.scoped(SAFE_READS, lambda: patching.apply(SAFE_READS, "megatron-core",
                                                              _install_safe_reads))


def _safe_sharded_strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return TorchDistLoadShardedStrategy()


def _safe_common_strategy() -> Any:
    """megatron-core's common load strategy with ``common.pt`` read by `load_weights`
    (explicitly ``weights_only``, whatever torch's default or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
    say)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> Any:
            return load_weights(os.path.join(str(checkpoint_dir), COMMON_FILE))

    return SafeCommonLoad()


def _sharded_state(model: Any, optimizer: Any, is_loading: bool) -> dict:
    """Megatron-LM's sharded state dict: ``model`` (``model0``, ``model1`` ... with virtual
    pipelines) and ``optimizer``, whose states follow the model's sharded tensors."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError("ckpt_format 'torch_dist' saves Megatron's optimizer "
                              "(get_megatron_optimizer), not a torch.optim optimizer")
    chunks = _chunks(model)
    state = {_model_key(i, len(chunks)): c.sharded_state_dict(metadata=SHARDING_METADATA)
             for i, c in enumerate(chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                      metadata=SHARDING_METADATA)
    return state


def create_optimizer_states(optimizer: Any) -> None:
    """Give a fresh Megatron optimizer's torch optimizer its states (one step on zero gradients:
    zero moments, ``step`` 1), which the load then overwrites. Without Apex or Transformer
    Engine, megatron-core's ``DistributedOptimizer.state_dict`` (0.16 and 0.19; called to build
    the state dict a load fills) reads torch Adam's ``step`` and fails on an optimizer that
    never stepped. Only before a load that overwrites the parameters and states: the step
    moves parameters where weight decay is set."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = o.optimizer
        if inner is None or inner.state:
            continue
        params = [p for g in inner.param_groups for p in g["params"] if p.numel()]
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        for p in params:
            p.grad = None


def _restore_steps(optimizer: Any, loaded: dict) -> None:
    """Set torch Adam's ``step`` of every parameter to the saved step count, one tensor each.
    Without Apex or Transformer Engine, megatron-core 0.16's ``DistributedOptimizer`` keeps
    the step in its param groups, and its load gives every parameter one shared ``step``
    tensor (which torch's multi-tensor Adam then increments once per parameter) and then
    overwrites it with the step of the optimizer the load started from."""
    steps = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            steps.update(g["step"] for g in node.get("param_groups", ()) if "step" in g)
            for value in node.values():
                collect(value)

    collect(loaded)
    if not steps:
        return  # Apex/TE Adam: no per-parameter step
    if len(steps) != 1:
        raise CheckpointError(f"the checkpoint's optimizer holds different step counts {steps}")
    step = float(steps.pop())
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in getattr(o.optimizer, "state", {}).values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _optimizer_state(optimizer: Any) -> list:
    """What this rank's optimizer holds: torch's state dict, or per Megatron optimizer the
    state of the torch optimizer over this rank's shard and its fp32 master shards."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer.state_dict()]
    return [(o.optimizer.state_dict(),
             [t.detach().clone() for g in getattr(o, "shard_fp32_from_float16_groups", [])
              for t in g]) for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _load_optimizer_state(optimizer: Any, state: Sequence) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state[0])
        return
    for o, (inner, masters) in zip(getattr(optimizer, "chained_optimizers", [optimizer]), state):
        o.optimizer.load_state_dict(inner)
        shards = [t for g in getattr(o, "shard_fp32_from_float16_groups", []) for t in g]
        for t, saved in zip(shards, masters):
            t.data.copy_(saved)
