"""DCP in a plain torch loop: an engine is three methods (and a scope) on `StepEngine`.

    torchrun --nproc_per_node 2 examples/plain_torch.py --dcp --train-iters 4

`TorchEngine` is everything an engine needs (`megatron_dcp.runtime.step.StepEngine`): the
driver plans, checks, runs the tasks and weights the loss; the gradients are SUM-reduced once.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist

from megatron_dcp.config import int_flag
from megatron_dcp.models.common import token_losses
from megatron_dcp.runtime.executor import reduce_gradients
from megatron_dcp.runtime.step import StepEngine


class TorchEngine(StepEngine):
    """A torch module and optimizer under `StepDriver`: no DDP, one SUM all-reduce per step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group=None):
        self.model, self.optimizer, self.group = model, optimizer, group

    def forward_loss(self, shard, per_token: bool) -> torch.Tensor:
        logits = self.model(shard.input_ids, shard.position_ids, task=shard.task)
        losses = token_losses(logits, shard.labels)  # chunked: no whole fp32 copy of the logits
        return losses if per_token else losses.sum()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def reduction_scope(self):
        self.optimizer.zero_grad()  # the step's gradients accumulate from zero
        return contextlib.nullcontext()

    def finish(self) -> None:
        reduce_gradients(list(self.model.parameters()), self.group)
        self.optimizer.step()


def main() -> None:
    """Train the reference decoder on the embedded corpus with DCP (or plain data parallel)."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.data import ByteTokenizer, GlobalBatchSampler, open_dataset
    from megatron_dcp.models import Decoder, DecoderConfig
    from megatron_dcp.runtime.groups import (GroupPool, before_init_process_group,
                                             destroy_process_groups)
    from megatron_dcp.runtime.step import StepDriver

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int_flag(1), default=4)
    DCPConfig.add_arguments(parser)
    args = parser.parse_args()
    before_init_process_group()
    dist.init_process_group("gloo")
    model = Decoder(DecoderConfig(vocab_size=ByteTokenizer().vocab_size, hidden_size=64,
                                  num_layers=2, max_position=512), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = GroupPool()
    driver = StepDriver(DCPConfig.from_args(args), pool=pool, model_shape=model.shape())
    engine = TorchEngine(model, optimizer, pool.world_group)
    data = open_dataset(None)
    sampler = GlobalBatchSampler(data.lengths, 4096, seed=1, max_seq_len=512)
    for it in range(args.train_iters):
        docs = sampler.next_batch()
        batch = [torch.from_numpy(data[d][:512].astype("int64")) for d in docs]
        result = driver.step(engine, batch)
        if dist.get_rank() == 0:
            print(f"iteration {it + 1}: loss {result.loss:.4f}, "
                  f"micro-steps {result.micro_steps}, {result.wall_s:.2f} s"
                  + (" | SKIPPED step (no trained token)" if result.empty else ""), flush=True)
    try:
        driver.tally.check()  # every step empty (all sequences skipped): status 1
    finally:
        del engine, driver, pool  # they hold the groups: freed below, before the exit
        destroy_process_groups()


if __name__ == "__main__":
    main()
