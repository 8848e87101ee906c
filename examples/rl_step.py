"""A reinforcement-learning policy step on a megatron-core ``GPTModel`` under DCP, exact in every
loss mode RL trainers use (verl's ``loss_agg_mode``); the API: docs/POSTTRAINING.md.

  torchrun --nproc_per_node 4 examples/rl_step.py                  # every mode, each checked
  torchrun --nproc_per_node 4 examples/rl_step.py --loss-agg-mode seq-mean-token-sum-norm \\
      --steps 3 --no-check

What an RL trainer hands its actor each step, as DCP takes it (a `WeightedBatch`):

- ``sequences``: prompt + sampled response token ids (rollouts: an inference engine's; here
  sampled from the policy itself on rank 0 and broadcast, responses ending at an end token or
  at ``--max-response``, so lengths vary);
- ``labels``: the sampled tokens: the default next-token labels (token ``i``'s target is token
  ``i + 1``), so a target's cross-entropy is ``-log p(sampled token)``;
- ``weights``: the response mask over those targets (1 where the target is a response token);
- ``scales``: the advantages, one per sequence (GRPO: a response's reward minus its group's
  mean, over the group's standard deviation; a per-token tensor works alike).

The step's loss is the vanilla policy gradient ``sum(mask x A x (-log p))`` normalised by the mode
(``DCPConfig.loss_reduction``), its gradient summed over the data-parallel ranks by Megatron's
DDP: `DCPForwardBackward` runs the plan of the batch (sequences split over groups of ranks, packed,
recomputed) and the result is the one-device one. With ``--check`` (the default) rank 0 compares
the loss and every gradient with `reference`: verl's ``agg_loss`` on a padded ``[B, L]`` batch
through Megatron's own local attention, on one device. CPU (gloo, fp32) or CUDA (NCCL).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from megatron_dcp.runtime.targets import WeightedBatch

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""verl's ``loss_agg_mode`` names (`megatron_dcp.config.LOSS_REDUCTIONS` holds them)."""
VOCAB = 64
END_TOKENS = 4
"""Token ids below this end a response (a tiny model's stand-in for EOS)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss-agg-mode", choices=MODES + ("all",), default="all",
                   help="verl's loss_agg_mode (DCPConfig.loss_reduction); all: each in turn")
    p.add_argument("--steps", type=int, default=1, help="policy steps per mode")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="responses sampled per prompt")
    p.add_argument("--max-response", type=int, default=24,
                   help="longest response; also the constant of seq-mean-token-sum-norm (verl "
                        "divides by the padded response length)")
    p.add_argument("--advantages", choices=("grpo", "reward"), default="grpo",
                   help="grpo: reward minus its group's mean, over the group's std; reward: the "
                        "reward itself (REINFORCE without a baseline)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare loss and gradients with the one-device reference (rank 0)")
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "group_size", "max_response"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def init(seed: int) -> None:
    """Process group (gloo on CPU, NCCL on CUDA), Megatron's parallel state (data parallel
    only), its RNG, the CPU patches."""
    from megatron.core import parallel_state

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        enable_cpu()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    parallel_state.initialize_model_parallel()
    seed_rng(seed)


def build_policy(dcp: bool = True):
    """A tiny GPTModel (RoPE, GQA, SwiGLU, RMSNorm; fp32): DCP's layer spec, or Megatron's local
    one (the reference); and the planner's `ModelShape` of it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec
    from megatron_dcp.plan.model import ModelShape

    warnings.filterwarnings("ignore")
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, kv_channels=4, use_cpu_initialization=True,
        params_dtype=torch.float32, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        calculate_per_token_loss=True)  # DCP weights every token itself
    spec = get_gpt_layer_dcp_spec() if dcp else get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=128,
                     position_embedding_type="rope")
    if torch.cuda.is_available():
        model.cuda()
    shape = ModelShape(num_layers=2, hidden_size=32, num_heads=8, ffn_hidden_size=48,
                       vocab_size=VOCAB, num_kv_heads=4, head_dim=4, max_position=128,
                       tied_embeddings=True, name="rl-gpt")
    return model, shape


@torch.no_grad()
def sample_rollouts(model, prompts, group_size: int, max_response: int, seed: int):
    """``group_size`` responses per prompt, sampled from ``model`` (no cache: a tiny model);
    a response ends after its first end token or at ``max_response`` tokens. Returns
    ``[(prompt, response)]``, group by group."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        rows = prompt.repeat(group_size, 1).to(device)
        ended = torch.zeros(group_size, dtype=torch.bool)
        lengths = torch.full((group_size,), max_response)
        for t in range(max_response):
            pos = torch.arange(rows.shape[1], device=device).repeat(group_size, 1)
            logits = model(rows, pos, None)[:, -1].float().cpu()
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            lengths[(token < END_TOKENS) & ~ended] = t + 1
            ended |= token < END_TOKENS
            rows = torch.cat([rows, token[:, None].to(device)], dim=1)
            if bool(ended.all()):
                break
        out += [(prompt, rows[g, len(prompt):len(prompt) + int(lengths[g])].cpu())
                for g in range(group_size)]
    return out


def reward(response: torch.Tensor) -> float:
    """A toy verifier: the share of even token ids in the response."""
    return float((response % 2 == 0).double().mean())


def grpo_advantages(rewards, group_size: int) -> list[float]:
    """GRPO's outcome advantage: reward minus its group's mean, over the group's std."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    return adv.reshape(-1).tolist()


def rl_batch(rollouts, advantages, norm: float) -> WeightedBatch:
    """The actor's batch: prompt + response tokens, the response mask over the next-token
    targets (the sampled tokens), the advantages as per-sequence scales; ``norm``: the
    constant of ``seq-mean-token-sum-norm``."""
    sequences, masks = [], []
    for prompt, response in rollouts:
        seq = torch.cat([prompt, response])
        mask = torch.zeros(len(seq), dtype=torch.float64)
        mask[len(prompt) - 1:len(seq) - 1] = 1.0  # targets that are response tokens
        sequences.append(seq)
        masks.append(mask)
    return WeightedBatch(sequences, weights=masks, scales=list(advantages), norm=norm)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's per-token form: (sum of token losses, tokens, report)."""
    loss = (output_tensor.view(-1).float() * loss_mask.view(-1).float()).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float().detach()])}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: the token losses ``-log p(label)`` of a micro-batch (DCP
    weights each by mask x advantage x the mode's factor); the task travels as
    ``packed_seq_params``."""
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                   packed_seq_params=b["packed_seq_params"])
    return output, partial(loss_func, b["loss_mask"])


def policy_step(step_fn, ddp, optimizer, batch: WeightedBatch, plan=None):
    """One policy update on ``batch``: DCP's forward and backward (gradients in DDP's
    ``main_grad``, summed over the ranks), then ``optimizer`` (``None``: the gradients are left
    for the caller). Returns the step's `StepResult` (``loss``: the mode's loss)."""
    from megatron_dcp.megatron.step import GlobalBatch

    ddp.zero_grad_buffer()
    reports = step_fn(forward_step_func=forward_step,
                      data_iterator=iter([GlobalBatch(batch, plan)]), model=[ddp],
                      num_microbatches=1, seq_length=0, micro_batch_size=1)
    if optimizer is not None:
        for p in ddp.parameters():
            p.grad = p.main_grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return reports.result


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm: float):
    """verl's ``agg_loss`` of a padded ``[B, L]`` loss matrix under ``mode``."""
    seq_sum = (loss_mat * mask).sum(-1)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1)).mean()
    return seq_sum.sum() / norm  # seq-mean-token-sum-norm: a constant (verl: the response width)


def reference(model, batch: WeightedBatch, mode: str):
    """One device, verl's way: the batch right-padded to ``[B, L]``, log-probabilities of the
    labels from the logits, ``loss_mat = -A x log p``, `agg_loss`. Returns (loss, gradients by
    parameter name, magnitude): the magnitude is the same aggregation of ``|loss_mat|``, the
    size of the loss's terms (GRPO's zero-mean advantages make the loss itself nearly cancel,
    so its rounding is relative to this)."""
    width, rows = max(len(s) for s in batch), len(batch)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.float64)
    adv = torch.zeros(rows, width, dtype=torch.float64)
    for i, seq in enumerate(batch):
        n = len(seq)
        tokens[i, :n], mask[i, :n] = seq, batch.weights[i]
        labels[i, :n] = batch.labels[i].clamp(min=0)
        adv[i, :n] = batch.scales[i]
    device = next(model.parameters()).device
    positions = torch.arange(width).repeat(rows, 1)
    logits = model(tokens.to(device), positions.to(device), None).float().cpu()
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0].double()
    loss_mat = -adv * logp
    loss = agg_loss(loss_mat, mask, mode, batch.norm)
    magnitude = float(agg_loss(loss_mat.detach().abs(), mask, mode, batch.norm))
    loss.backward()
    return (float(loss), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()},
            magnitude)


def relative_errors(result, ddp, ref) -> tuple[float, float]:
    """(loss, worst gradient) relative errors of a DCP step against `reference`'s (the loss's
    relative to its magnitude)."""
    ref_loss, ref_grads, magnitude = ref
    worst = 0.0
    for name, p in ddp.module.named_parameters():
        g, want = p.main_grad.detach().cpu().double(), ref_grads[name].double()
        worst = max(worst, float((g - want).norm() / want.norm().clamp_min(1e-30)))
    return abs(result.loss - ref_loss) / max(magnitude, 1e-30), worst


def rollout_batch(policy, args, step: int) -> WeightedBatch:
    """Rank 0 samples the step's rollouts and scores them; every rank gets the batch."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    prompts = [torch.randint(END_TOKENS, VOCAB, (int(n),), generator=gen)
               for n in torch.randint(3, 20, (args.prompts,), generator=gen)]
    made = [None]
    if dist.get_rank() == 0:
        rollouts = sample_rollouts(policy, prompts, args.group_size, args.max_response,
                                   seed=args.seed + step)
        rewards = [reward(r) for _, r in rollouts]
        made = [(rollouts, rewards if args.advantages == "reward" else
                 grpo_advantages(rewards, args.group_size))]
    dist.broadcast_object_list(made, src=0)
    rollouts, advantages = made[0]
    return rl_batch(rollouts, advantages, norm=args.max_response)


def main(argv=None) -> int:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.cpu.core import seed_rng
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward

    args = parse_args(argv)
    init(args.seed)
    rank, failed = dist.get_rank(), False
    for mode in MODES if args.loss_agg_mode == "all" else (args.loss_agg_mode,):
        seed_rng(args.seed)  # the same policy on every rank (rank 0's reference drew numbers)
        model, shape = build_policy()
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), module=model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
        step_fn = DCPForwardBackward(DCPConfig(enabled=True, loss_reduction=mode),
                                     model_shape=shape)
        for step in range(args.steps):
            batch = rollout_batch(model, args, step)
            ref = None
            if args.check and rank == 0:  # the same weights, Megatron's own attention
                plain, _ = build_policy(dcp=False)
                plain.load_state_dict({k: v for k, v in model.state_dict().items()
                                       if "_extra_state" not in k}, strict=False)
                ref = reference(plain, batch, mode)
            result = policy_step(step_fn, ddp, optimizer, batch)
            line = (f"{mode} step {step + 1}: loss {result.loss:.6f}, {len(batch)} sequences, "
                    f"{result.tokens} response tokens trained, degrees "
                    f"{sorted({t.degree for t in result.plan.tasks})}")
            if ref is not None:  # main_grad holds the step's gradients until the next step
                loss_err, grad_err = relative_errors(result, ddp, ref)
                failed |= max(loss_err, grad_err) > 1e-5
                line += f"; vs one device: loss {loss_err:.1e}, gradients {grad_err:.1e}"
            if rank == 0:
                print(line, flush=True)
        step_fn.close()
    destroy_model_parallel()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
