"""One-GPU check of DCP's attention kernels and runtime; prints and writes a JSON report.

    python tools/gpu_check.py --out runs/gpu_check.json                 # one GPU, bf16, < 8 min
    python tools/gpu_check.py --device cpu --out runs/gpu_check_cpu.json  # small, float32

Sections (each catches its own failure, is recorded, and the next one runs; the summary says
PASS / FAIL / SKIP per section; the exit status is 1 if any section failed):

* ``environment``: torch / CUDA versions, the device, which attention backends exist.
* ``exactness``: every backend that runs on the device, on packed varlen GQA input (causal,
  non-causal, video spatial and temporal groups), forward and backward, against the exact kernel
  in float64 on the CPU (same rounded inputs).
* ``ring``: ring degrees 2, 4, 8 and hybrid layouts simulated in one process (blocks merged as the
  ring does) against one full-sequence call of the same backend.
* ``throughput``: TFLOP/s of the ring-block path and of the local packed path against one flash
  varlen call on the same attention work (targets on CUDA: >= 0.7x and >= 0.9x).
* ``run_plan``: the reference decoder through `megatron_dcp.runtime.executor.run_plan` at world
  size 1 (NCCL on CUDA), recompute 0 and all layers, equal gradients; on CUDA the task part runs
  under ``torch.cuda.set_sync_debug_mode("error")`` (a sync found is reported, then the step is
  run again without the check).
* ``megatron``: the same for a megatron-core GPTModel with DCP's layer spec (skipped when
  megatron-core does not import).
* ``calibration``: ``--dcp_hardware auto`` on the device and the online calibration over 8
  planned steps of the reference decoder: predicted vs measured step time, the fitted factors.
* ``profile``: the hardware profiler CLI writing ``runs/hardware_<device>.json`` (subprocess with a
  time limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_dcp.runtime import backends, kernels  # noqa: E402
from megatron_dcp.runtime.layout import ShardLayout  # noqa: E402
from megatron_dcp.runtime.ring import ring_in_one_process  # noqa: E402

# Sizes per device: (packed lengths of the exactness/ring checks, heads, kv heads, head dim).
SIZES = {
    "cuda": dict(lengths=(1000, 37, 513, 2048), heads=8, kv_heads=2, head_dim=128, frame=64,
                 ring_lengths=(3000, 777, 8192), ring_layouts=((1, 2), (1, 4), (1, 8), (2, 2),
                                                              (2, 4)),
                 long=65536, long_heads=32, long_kv=8, pack=(64, 1024), model_hidden=1024,
                 model_layers=4, model_heads=16, model_kv=4, model_lengths=(3000, 900, 4096, 50)),
    "cpu": dict(lengths=(100, 7, 53, 200), heads=4, kv_heads=2, head_dim=16, frame=8,
                ring_lengths=(90, 31, 200), ring_layouts=((1, 2), (1, 4), (1, 8), (2, 2)),
                long=1024, long_heads=4, long_kv=2, pack=(8, 128), model_hidden=32,
                model_layers=2, model_heads=4, model_kv=2, model_lengths=(40, 9, 64, 3)),
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2,
             torch.float16: 1e-2}


class Skip(Exception):
    """A section that cannot run here (the reason is recorded)."""


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (in float64, on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def packed(lengths, heads, kv_heads, head_dim, device, dtype, seed=0):
    """Random packed q, k, v, dout of ``lengths`` (rounded to ``dtype``) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(n, h, head_dim, generator=gen).to(dtype).to(device)
            for h in (heads, kv_heads, kv_heads, heads)]


def local_fwd_bwd(q, k, v, dout, meta, causal, scale, groups, backend):
    """``[out, dq, dk, dv]`` of `kernels.local_attention` through autograd with ``backend``."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with kernels.forced_backend(backend):
        out = kernels.local_attention(*ins, meta, causal=causal, softmax_scale=scale,
                                      groups=groups)
        return [out.detach(), *torch.autograd.grad(out, ins, dout)]


def timed(fn: Callable, device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up (CUDA events on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- sections
def section_environment(ctx) -> dict:
    """Versions and which backends exist."""
    dev = ctx["device"]
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": str(dev), "dtype": str(ctx["dtype"])}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
        info["capability"] = list(torch.cuda.get_device_capability(dev))
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import flash_attn
        info["flash_attn"] = flash_attn.__version__
    except Exception:  # noqa: BLE001 - optional
        info["flash_attn"] = None
    probe = torch.zeros(1, 1, 64, dtype=ctx["dtype"], device=dev)
    info["backends"] = {b: backends.supports(b, probe) for b in kernels.BACKENDS}
    info["selected_backend"] = kernels.resolve_backend(probe)
    try:
        import megatron.core
        info["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except Exception:  # noqa: BLE001 - optional
        info["megatron_core"] = None
    return info


def _device_backends(ctx) -> list[str]:
    probe = torch.zeros(1, 1, ctx["size"]["head_dim"], dtype=ctx["dtype"], device=ctx["device"])
    return [b for b in kernels.BACKENDS if backends.supports(b, probe)]


def section_exactness(ctx) -> dict:
    """Every backend vs the float64 CPU exact kernel: packed varlen GQA, four cases."""
    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    lengths, frame = sz["lengths"], sz["frame"]
    q, k, v, dout = packed(lengths, sz["heads"], sz["kv_heads"], sz["head_dim"], dev, dtype)
    scale = sz["head_dim"] ** -0.5
    meta_host = ShardLayout.build(lengths, 1, 1, 0).meta()
    cases = {"causal": (True, None), "non-causal": (False, None),
             "video-spatial": (False, lambda p: p // frame),
             "video-temporal": (True, lambda p: p % frame)}
    results, failures, refs = {}, [], {}
    for backend in _device_backends(ctx):
        for name, (causal, fn) in cases.items():
            if name not in refs:
                refs[name] = local_fwd_bwd(*(t.cpu().double() for t in (q, k, v, dout)),
                                           meta_host, causal, scale,
                                           kernels.attention_groups(fn, meta_host), "torch")
            ref = refs[name]
            meta = meta_host.to(dev)
            got = local_fwd_bwd(q, k, v, dout, meta, causal, scale,
                                kernels.attention_groups(fn, meta), backend)
            errs = {label: rel_err(g, r) for label, g, r in zip(("out", "dq", "dk", "dv"), got,
                                                                   ref)}
            results[f"{backend}/{name}"] = errs
            if max(errs.values()) > TOLERANCE[dtype]:
                failures.append(f"{backend}/{name}: {errs}")
    if failures:
        raise AssertionError("; ".join(failures))
    return {"tolerance": TOLERANCE[dtype], "lengths": list(lengths), "errors": results}


def section_ring(ctx) -> dict:
    """Ring and hybrid layouts simulated in one process vs one full-sequence call."""
    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    lengths = sz["ring_lengths"]
    q, k, v, dout = packed(lengths, sz["heads"], sz["kv_heads"], sz["head_dim"], dev, dtype, 1)
    scale = sz["head_dim"] ** -0.5
    meta = ShardLayout.build(lengths, 1, 1, 0).meta().to(dev)
    backend = kernels.resolve_backend(q)
    results, failures = {}, []
    for causal in (True, False):
        want = local_fwd_bwd(q, k, v, dout, meta, causal, scale, None, backend)
        for u, r in sz["ring_layouts"]:
            with kernels.forced_backend(backend):
                got = ring_in_one_process(q, k, v, lengths, u, r, causal=causal, scale=scale,
                                          dout=dout)
            errs = {label: rel_err(g, w) for label, g, w in zip(("out", "dq", "dk", "dv"), got,
                                                                   want)}
            key = f"{'causal' if causal else 'non-causal'}/ulysses {u} x ring {r}"
            results[key] = errs
            if max(errs.values()) > TOLERANCE[dtype]:
                failures.append(f"{key}: {errs}")
    if failures:
        raise AssertionError("; ".join(failures))
    return {"backend": backend, "tolerance": TOLERANCE[dtype], "lengths": list(lengths),
            "errors": results}


def _single_call(q, k, v, dout, lengths, scale):
    """Forward + backward of one kernel call over all of ``lengths`` (the yardstick): torch's
    flash varlen ops on CUDA, torch's fused CPU op per sequence on the CPU."""
    if q.device.type == "cuda":
        cu = torch.tensor([0, *lengths], device=q.device).cumsum(0).to(torch.int32)
        m = max(lengths)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)

        def run():
            o, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True,
                                                             False, scale=scale)[:2]
            torch.ops.aten._flash_attention_backward(dout, q, k, v, o, lse, cu, cu, m, m, 0.0,
                                                     True, rng, unused, scale=scale)
        return run

    def run_cpu():
        start = 0
        for n in lengths:
            qs, ks, vs, ds = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v, dout))
            o, lse = backends._CPU_FWD(qs, ks, vs, 0.0, True, scale=scale)
            backends._CPU_BWD(ds, qs, ks, vs, o, lse, 0.0, True, scale=scale)
            start += n
    return run_cpu


def _causal_flops(lengths, heads, head_dim) -> float:
    """Forward + backward FLOPs of causal attention (2 + 5 matmuls over the visible pairs)."""
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return 7 * 2 * pairs * heads * head_dim


def section_throughput(ctx) -> dict:
    """Ring-block path and local packed path vs one varlen call, same work (TFLOP/s)."""
    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    heads, kv, dim = sz["long_heads"], sz["long_kv"], sz["head_dim"]
    scale, reps = dim ** -0.5, 5 if dev.type == "cuda" else 2
    out = {}
    # ring: one long sequence; every rank's blocks of a degree-8 ring (the whole work, split)
    lengths = [sz["long"]]
    q, k, v, dout = packed(lengths, heads, kv, dim, dev, dtype, 2)
    flops = _causal_flops(lengths, heads, dim)
    t_ref = timed(_single_call(q, k, v, dout, lengths, scale), dev, reps)
    t_ring = timed(lambda: ring_in_one_process(q, k, v, lengths, 1, 8, causal=True, scale=scale,
                                               dout=dout), dev, reps)
    out["ring8"] = {"tokens": lengths[0], "single_call_tflops": flops / t_ref / 1e12,
                    "ring_blocks_tflops": flops / t_ring / 1e12, "ratio": t_ref / t_ring}
    # local: many packed sequences through local_attention (autograd) vs one call
    count, n = sz["pack"]
    lengths = [n] * count
    q, k, v, dout = packed(lengths, heads, kv, dim, dev, dtype, 3)
    meta = ShardLayout.build(lengths, 1, 1, 0).meta().to(dev)
    flops = _causal_flops(lengths, heads, dim)
    backend = kernels.resolve_backend(q)
    t_ref = timed(_single_call(q, k, v, dout, lengths, scale), dev, reps)
    t_local = timed(lambda: local_fwd_bwd(q, k, v, dout, meta, True, scale, None, backend), dev,
                    reps)
    out["local_packed"] = {"sequences": count, "tokens": n, "backend": backend,
                           "single_call_tflops": flops / t_ref / 1e12,
                           "local_tflops": flops / t_local / 1e12, "ratio": t_ref / t_local}
    if dev.type == "cuda":
        misses = [f"{name} {out[name]['ratio']:.2f} < {goal}"
                  for name, goal in (("ring8", 0.7), ("local_packed", 0.9))
                  if out[name]["ratio"] < goal]
        if misses:
            raise AssertionError("below target: " + ", ".join(misses) + f" ({out})")
    else:
        out["note"] = "CPU: ratios reported, targets apply to CUDA only"
    return out


def _grads_equal(a: dict, b: dict, tol: float) -> dict:
    zero = [n for n, g in a.items() if not bool(g.abs().sum() > 0)]
    if len(zero) == len(a):
        raise AssertionError("all gradients are zero: the step did not run")
    worst = max(rel_err(a[n], b[n]) for n in a)
    if not worst <= tol:
        raise AssertionError(f"gradients differ between recompute depths: {worst:.2e} > {tol}")
    return {"max_rel_diff": worst}


def _sync_checked(dev, fn, found: list):
    """Run ``fn`` under the CUDA sync checker (records a sync instead of failing the section)."""
    if dev.type != "cuda":
        return fn(False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(True)
    except Exception as exc:  # noqa: BLE001 - a sync inside the task part
        found.append("".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return fn(False)


def section_run_plan(ctx) -> dict:
    """The reference decoder through run_plan, recompute 0 vs all layers, degree-1 tasks."""
    from megatron_dcp.models import Decoder, DecoderConfig
    from megatron_dcp.plan.plan import Plan, Task
    from megatron_dcp.runtime.executor import run_plan
    from megatron_dcp.runtime.groups import GroupPool

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    lengths = sz["model_lengths"]
    cfg = DecoderConfig(vocab_size=512, hidden_size=sz["model_hidden"],
                        num_layers=sz["model_layers"], num_heads=sz["model_heads"],
                        num_kv_heads=sz["model_kv"], max_position=max(lengths))
    gen = torch.Generator().manual_seed(4)
    batch = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    pool = GroupPool()
    found: list[str] = []

    def step(ckpt: int):
        model = Decoder(cfg, seed=5).to(device=dev, dtype=dtype)
        tasks = (Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=ckpt),
                 Task(id=1, ranks=(0,), seqs=(2, 3), recompute_layers=ckpt, start=1.0))
        plan = Plan(tasks=tasks, lengths=lengths, world_size=1)

        def run(check: bool):
            for p in model.parameters():
                p.grad = None

            def forward_step(ids, pos, labels):
                if check:
                    torch.cuda.set_sync_debug_mode("error")
                return model.loss(ids, pos, labels)

            def backward(loss):
                loss.backward()
                if check:
                    torch.cuda.set_sync_debug_mode(0)
            stats = run_plan(plan, batch, 0, forward_step, pool=pool, backward=backward,
                             device=dev, max_position=cfg.max_position)
            return stats.loss, {n: p.grad.clone() for n, p in model.named_parameters()}
        return _sync_checked(dev, run, found)

    loss0, g0 = step(0)
    loss_all, g_all = step(cfg.num_layers)
    result = {"loss": loss0, "loss_recompute_all": loss_all,
              **_grads_equal(g0, g_all, 3e-2 if dtype in (torch.bfloat16, torch.float16)
                             else 1e-5)}
    if dev.type == "cuda":
        result["host_syncs_in_task"] = found or "none found"
        if found:
            raise AssertionError(f"host sync inside a task: {found[0]}")
    return result


def section_megatron(ctx) -> dict:
    """A megatron-core GPTModel (DCP spec) through DCPForwardBackward, recompute 0 vs all."""
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as exc:  # noqa: BLE001 - optional dependency
        raise Skip(f"megatron-core does not import: {exc}")
    from functools import partial

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.cpu import enable_cpu, seed_rng
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.plan.plan import Plan, Task

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    if dev.type == "cpu":
        enable_cpu()
    parallel_state.initialize_model_parallel()
    lengths, vocab = sz["model_lengths"], 512
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    found: list[str] = []

    def step(ckpt: int):
        seed_rng(7)
        cfg = TransformerConfig(
            num_layers=sz["model_layers"], hidden_size=sz["model_hidden"],
            num_attention_heads=sz["model_heads"], num_query_groups=sz["model_kv"],
            use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
            bias_activation_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False,
            bias_dropout_fusion=False, calculate_per_token_loss=True)
        model = GPTModel(cfg, get_gpt_layer_dcp_spec(), vocab_size=vocab,
                         max_sequence_length=max(lengths), position_embedding_type="rope")
        model = model.to(dev)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), module=model)
        tasks = (Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=ckpt),
                 Task(id=1, ranks=(0,), seqs=(2, 3), recompute_layers=ckpt, start=1.0))
        plan = Plan(tasks=tasks, lengths=lengths, world_size=1)

        def loss_func(loss_mask, output):
            losses = output.view(-1).float()
            loss = (losses * loss_mask.view(-1)).sum()
            return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}

        def run(check: bool):
            ddp.zero_grad_buffer()

            def forward_step(data_iterator, model):
                b = next(data_iterator)
                out = model(b["tokens"], b["position_ids"], b["attention_mask"],
                            labels=b["labels"], packed_seq_params=b["packed_seq_params"])
                return out, partial(loss_func, b["loss_mask"])
            driver = DCPForwardBackward(DCPConfig(enabled=True))
            if check:
                torch.cuda.set_sync_debug_mode("error")
            driver(forward_step_func=forward_step, data_iterator=iter([GlobalBatch(seqs, plan)]),
                   model=[ddp], num_microbatches=1, seq_length=0, micro_batch_size=1)
            if check:
                torch.cuda.set_sync_debug_mode(0)
            return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        return _sync_checked(dev, run, found)

    try:
        result = _grads_equal(step(0), step(sz["model_layers"]),
                              3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    finally:
        destroy_model_parallel()  # Megatron's, and the group globals it leaves set
    if dev.type == "cuda":
        # the whole Megatron step ran under the checker (its own reductions may sync)
        result["host_syncs_in_step"] = found or "none found"
    return result


def section_profile(ctx) -> dict:
    """The hardware profiler CLI (tools/profile_hardware.py, or tools/profile.py) by subprocess."""
    dev = ctx["device"]
    script = next((os.path.join(ROOT, "tools", n) for n in ("profile_hardware.py", "profile.py")
                   if os.path.exists(os.path.join(ROOT, "tools", n))), None)
    if script is None:
        raise Skip("no hardware profiler in tools/")
    out = os.path.join(ROOT, "runs", f"hardware_{ctx['hardware_name']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, script, "--device", dev.type, "--out", out,
           "--name", ctx["hardware_name"]]
    cmd += ["--dtype", "bfloat16"] if dev.type == "cuda" else ["--quick", "--ranks", "0"]
    limit = max(30.0, ctx["deadline"] - time.monotonic())
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"profiler ran past {limit:.0f} s: {' '.join(cmd)}")
    if res.returncode != 0:
        raise AssertionError(f"profiler exit {res.returncode}: {res.stderr[-2000:]}")
    return {"command": " ".join(cmd), "out": out, "tail": res.stdout[-1500:]}


def section_calibration(ctx) -> dict:
    """``--dcp_hardware auto`` on this device, then the online calibration over a few planned
    steps of the reference decoder (world 1, a 2k-token pack budget so each step has several
    tasks): predicted vs measured step time per step, and the fitted factors (how far the
    starting numbers are from this device)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from plain_torch import TorchEngine

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder, DecoderConfig
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    sz, dev, dtype = ctx["size"], ctx["device"], ctx["dtype"]
    longest = max(sz["model_lengths"])
    cfg = DecoderConfig(vocab_size=512, hidden_size=sz["model_hidden"],
                        num_layers=sz["model_layers"], num_heads=sz["model_heads"],
                        num_kv_heads=sz["model_kv"], max_position=longest)
    model = Decoder(cfg, seed=5).to(device=dev, dtype=dtype)
    pool = GroupPool()
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), pool.world_group)
    driver = StepDriver(DCPConfig(enabled=True, pack_tokens=max(longest // 2, 8)), pool=pool,
                        model_shape=model.shape(), device=dev)
    start = driver.hardware.name
    gen = torch.Generator().manual_seed(6)
    rows = []
    for _ in range(8):
        count = int(torch.randint(6, 16, (1,), generator=gen))
        lengths = [max(2, int(longest * float(torch.rand(1, generator=gen)) ** 3))
                   for _ in range(count)]
        batch = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
        result = driver.step(engine, batch)
        rows.append({"tasks": len(result.plan.tasks), "step_s": round(result.wall_s, 5),
                     "predicted_s": round(result.predicted_s, 5),
                     "calibration_error": result.calibration_error})
    hw = driver.hardware
    return {"auto": start, "steps": rows, "factors": dict(hw.calibration or ()),
            "step_overhead_s": hw.step_overhead_s}


def _init_world(dev) -> str:
    """A one-rank process group (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import before_init_process_group

    backend = "nccl" if dev.type == "cuda" else "gloo"
    store = tempfile.NamedTemporaryFile(prefix="dcp_gpu_check_", delete=False).name
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    before_init_process_group()
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), **kwargs)
    return backend


SECTIONS = {"environment": section_environment, "exactness": section_exactness,
            "ring": section_ring, "throughput": section_throughput,
            "run_plan": section_run_plan, "megatron": section_megatron,
            "calibration": section_calibration, "profile": section_profile}


def main(argv=None) -> int:
    """Run the sections, print the summary, write the JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "float64"], default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--out", default=os.path.join("runs", "gpu_check.json"))
    p.add_argument("--skip", nargs="*", default=[], choices=list(SECTIONS),
                   help="sections to leave out")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds for the whole script (the profiler gets what is left)")
    p.add_argument("--hardware-name", default=None, help="default: h200 on CUDA, cpu otherwise")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    ctx = {"device": dev, "dtype": dtype, "size": SIZES[dev.type],
           "deadline": time.monotonic() + args.budget,
           "hardware_name": args.hardware_name or ("h200" if dev.type == "cuda" else "cpu")}
    report: dict = {"command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
                    "sections": {}}
    world = None
    for name, fn in SECTIONS.items():
        if name in args.skip:
            report["sections"][name] = {"status": "SKIP", "reason": "--skip"}
            continue
        start = time.monotonic()
        try:
            if name in ("run_plan", "megatron", "calibration") and world is None:
                world = _init_world(dev)
            entry = {"status": "PASS", "result": fn(ctx)}
        except Skip as exc:
            entry = {"status": "SKIP", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - every section reports, the next one runs
            entry = {"status": "FAIL", "error": "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]}
        entry["seconds"] = round(time.monotonic() - start, 2)
        report["sections"][name] = entry
        print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
        if entry["status"] == "FAIL":
            print(entry["error"], flush=True)
    if world is not None:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()  # freed now: no NCCL thread outlives the interpreter
    report["summary"] = {n: e["status"] for n, e in report["sections"].items()}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print("[gpu_check] summary: " + ", ".join(f"{n} {s}" for n, s in report["summary"].items()))
    return 1 if "FAIL" in report["summary"].values() else 0


if __name__ == "__main__":
    sys.exit(main())
