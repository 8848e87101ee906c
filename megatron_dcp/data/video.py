"""Latent videos for the video DiT: an embedded synthetic mix, a directory of latent tensors, and
`VideoBatch`, the table of one global batch that every rank holds.

A latent video is a float tensor ``[frames, height, width, channels]`` (one token per latent
patch; an image is one frame). Its tokens, frame-major, are rows of the batch table.

* `SyntheticVideos`: no download. Videos are drawn from a documented mix (`SYNTHETIC_MIXES`: from
  1-frame images to long clips at several resolutions, sized for training on a CPU; the
  simulator's mixes at real resolutions are `megatron_dcp.plan.workload.VIDEO_MIXES`), each a
  smooth random pattern (sums of low-frequency waves over frame, row and column, per channel)
  so a model can learn it; video ``i`` depends only on ``(seed, i)``.
* `LatentDirectory`: every ``.pt`` / ``.npy`` file of a directory (sorted by name), one video
  each, shaped ``[frames, height, width, channels]``, floating point, one channel count for all;
  a wrong file raises an error naming it.
* `VideoBatch`: the latents ``x0``, noise and timestep ``t`` (one per video) and class labels of
  a global batch. Noise and ``t`` of a video are a pure function of ``(seed, iteration, index of
  the video in the global batch)``, so every rank and every plan sees the same randomness.
  `VideoBatch.sequences` gives the runtime its global batch: per video the 1-D tensor of its
  row ids, as a `SelfTargetBatch` (every token is its own target) with a digest of each video's
  content.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_dcp.runtime.targets import SelfTargetBatch


@dataclass(frozen=True)
class VideoKind:
    """One component of a synthetic mix: ``weight`` (share of the videos), frames drawn uniformly
    from ``frames`` (inclusive range), a frame size ``(height, width)`` drawn from ``sizes``."""

    name: str
    weight: float
    frames: tuple[int, int]
    sizes: tuple[tuple[int, int], ...]


SYNTHETIC_MIXES: dict[str, tuple[VideoKind, ...]] = {
    # The default: images at three resolutions, short and medium clips, and a long tail of long
    # clips (the longest is 32 x 12 x 12 = 4,608 tokens, 72x the smallest image).
    "mixed": (
        VideoKind("image", 0.30, (1, 1), ((8, 8), (8, 12), (12, 12))),
        VideoKind("short", 0.35, (2, 8), ((8, 8), (8, 12))),
        VideoKind("medium", 0.25, (8, 16), ((8, 8), (12, 12))),
        VideoKind("long", 0.10, (16, 32), ((8, 12), (12, 12))),
    ),
    # For tests: the same shape of mix at a few tokens per frame.
    "tiny": (
        VideoKind("image", 0.30, (1, 1), ((2, 2), (2, 3), (3, 3))),
        VideoKind("short", 0.35, (2, 4), ((2, 2), (2, 3))),
        VideoKind("medium", 0.25, (4, 8), ((2, 3), (3, 3))),
        VideoKind("long", 0.10, (8, 12), ((3, 3), (3, 4))),
    ),
}


def mix_limits(mix: Sequence[VideoKind]) -> tuple[int, int, int]:
    """Largest ``(frames, height, width)`` a mix can draw."""
    return (max(k.frames[1] for k in mix), max(h for k in mix for h, _ in k.sizes),
            max(w for k in mix for _, w in k.sizes))


class _VideoShapes:
    """What a set of latent videos knows from its ``shapes`` (``(frames, height, width)`` in
    latent patches, one per video): how many videos and their tokens."""

    shapes: list[tuple[int, int, int]]

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def lengths(self) -> list[int]:
        """Tokens of every video (frames x height x width of its shape)."""
        return [f * h * w for f, h, w in self.shapes]


class SyntheticVideos(_VideoShapes):
    """``count`` latent videos drawn from ``SYNTHETIC_MIXES[mix]`` (see the module docstring); class
    label = the index of the video's kind in the mix."""

    def __init__(self, count: int, *, channels: int = 4, mix: str = "mixed", seed: int = 0,
                 max_frames: Optional[int] = None) -> None:
        if mix not in SYNTHETIC_MIXES:
            raise ValueError(f"unknown video mix {mix!r}; known: {sorted(SYNTHETIC_MIXES)}")
        if count < 1 or channels < 1:
            raise ValueError(f"SyntheticVideos: count={count} and channels={channels} must be "
                             "positive")
        self.kinds = SYNTHETIC_MIXES[mix]
        self.mix, self.channels, self.seed = mix, int(channels), int(seed)
        rng = np.random.Generator(np.random.PCG64([self.seed, 0x51DE0]))
        weights = np.array([k.weight for k in self.kinds])
        picks = rng.choice(len(self.kinds), size=count, p=weights / weights.sum())
        self.labels = [int(p) for p in picks]
        self.shapes = []
        for p in picks:
            kind = self.kinds[p]
            frames = int(rng.integers(kind.frames[0], kind.frames[1] + 1))
            if max_frames is not None:
                frames = min(frames, max_frames)
            h, w = kind.sizes[int(rng.integers(len(kind.sizes)))]
            self.shapes.append((frames, h, w))

    @property
    def num_classes(self) -> int:
        """Kinds of the mix (the class labels)."""
        return len(self.kinds)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Video ``i`` as ``[frames, height, width, channels]`` float32."""
        f, h, w = self.shapes[i]
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, 0x5EED, i))
        waves = 3
        freq = torch.rand(waves, 3, generator=gen) * 0.6
        phase = torch.rand(waves, self.channels, generator=gen) * 2 * np.pi
        amp = torch.randn(waves, self.channels, generator=gen) / waves ** 0.5
        grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w),
                                          indexing="ij"), dim=-1).float()   # [f, h, w, 3]
        angle = grid @ freq.T                                                 # [f, h, w, waves]
        video = (torch.sin(angle[..., None] + phase) * amp).sum(dim=-2)      # [f, h, w, C]
        return video.contiguous()


class LatentDirectory(_VideoShapes):
    """The ``.pt`` / ``.npy`` files of ``path`` (sorted), one latent video each, checked at open:
    4-D ``[frames, height, width, channels]``, floating point, no empty dimension, one channel
    count for all. ``.npy`` shapes are read from the header (memory-mapped); ``.pt`` files are
    loaded with ``weights_only=True``."""

    SUFFIXES = (".pt", ".npy")

    def __init__(self, path: str, *, max_frames: Optional[int] = None) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"--data-path {path!r}: not a directory of .pt/.npy latent videos")
        names = sorted(n for n in os.listdir(path) if n.endswith(self.SUFFIXES))
        if not names:
            raise ValueError(f"--data-path {path!r}: no .pt or .npy files in it")
        self.files = [os.path.join(path, n) for n in names]
        self.max_frames = max_frames
        self.labels = None
        self.num_classes = 0
        self.shapes, self.channels = [], None
        for f in self.files:
            shape = self._check(f, _load(f, header_only=True))
            frames = min(shape[0], max_frames) if max_frames else shape[0]
            self.shapes.append((frames, shape[1], shape[2]))

    def _check(self, path: str, data) -> tuple[int, ...]:
        shape = tuple(int(n) for n in data.shape)
        if len(shape) != 4:
            raise ValueError(f"{path}: latent video must be [frames, height, width, channels], "
                             f"got shape {shape}")
        if min(shape) < 1:
            raise ValueError(f"{path}: latent video has an empty dimension: shape {shape}")
        kind = str(data.dtype)
        if not (torch.is_floating_point(data) if isinstance(data, torch.Tensor)
                else np.issubdtype(data.dtype, np.floating)):
            raise ValueError(f"{path}: latent video must be floating point, got dtype {kind}")
        if self.channels is None:
            self.channels = shape[3]
        elif shape[3] != self.channels:
            raise ValueError(f"{path}: {shape[3]} channels, the files before it have "
                             f"{self.channels}")
        return shape

    def __getitem__(self, i: int) -> torch.Tensor:
        """Video ``i`` as float32 ``[frames, height, width, channels]`` (first ``max_frames``)."""
        path = self.files[i]
        data = _load(path, header_only=False)
        video = torch.as_tensor(np.asarray(data)) if not isinstance(data, torch.Tensor) else data
        video = video[: self.shapes[i][0]].to(torch.float32).contiguous()
        if not bool(torch.isfinite(video).all()):
            raise ValueError(f"{path}: latent video holds NaN or infinite values")
        return video


def _load(path: str, header_only: bool):
    """A ``.npy`` (memory-mapped when only the shape is wanted) or ``.pt`` tensor file."""
    try:
        if path.endswith(".npy"):
            return np.load(path, mmap_mode="r" if header_only else None, allow_pickle=False)
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        raise ValueError(f"{path}: cannot read a latent video: {type(exc).__name__}: {exc}"
                         ) from exc
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"{path}: a .pt latent video must hold one tensor, got "
                         f"{type(data).__name__}")
    return data


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (numpy's SeedSequence: well mixed, identical everywhere)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts])
    return int(state.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


def video_noise(seed: int, iteration: int, index: int, shape: Sequence[int]
                ) -> tuple[torch.Tensor, float]:
    """Noise ``[frames, height, width, channels]`` and timestep ``t`` of the video at ``index`` of
    the global batch of ``iteration``: a pure function of these (``t`` logit-normal, in (0, 1))."""
    gen = torch.Generator().manual_seed(_mix_seed(seed, iteration, index))
    t = float(torch.sigmoid(torch.randn((), generator=gen, dtype=torch.float64)))
    return torch.randn(tuple(shape), generator=gen), t


@dataclass
class VideoBatch:
    """The table of one global batch (every rank holds all of it; see the module docstring).

    ``x0``/``noise``: ``[N, C]`` rows of all videos, video after video, frame-major;
    ``t``: ``[S]``; ``labels``: ``[S]`` class labels or ``None``; ``shapes``: ``(frames, height,
    width)`` per video; ``offsets``: first row of each video (``S + 1`` entries);
    ``video_of_row``: ``[N]``.
    """

    x0: torch.Tensor
    noise: torch.Tensor
    t: torch.Tensor
    labels: Optional[torch.Tensor]
    shapes: list[tuple[int, int, int]]
    offsets: list[int]
    video_of_row: torch.Tensor
    digests: list[str]

    @classmethod
    def build(cls, videos: Sequence[torch.Tensor], *, seed: int, iteration: int,
              labels: Optional[Sequence[int]] = None) -> "VideoBatch":
        """The batch of latent ``videos`` (each ``[frames, height, width, channels]``) at training
        step ``iteration``; noise and ``t`` from `video_noise`."""
        if not videos:
            raise ValueError("VideoBatch: no videos")
        channels = {int(v.shape[-1]) for v in videos}
        bad = [i for i, v in enumerate(videos) if v.dim() != 4 or min(v.shape) < 1]
        if bad or len(channels) != 1:
            raise ValueError(f"VideoBatch: videos must be [frames, height, width, channels] with "
                             f"one channel count; bad: {bad}, channels {sorted(channels)}")
        x0, noise, ts, shapes, offsets, digests = [], [], [], [], [0], []
        for i, v in enumerate(videos):
            v = v.to(torch.float32)
            n, t = video_noise(seed, iteration, i, v.shape)
            shapes.append(tuple(int(s) for s in v.shape[:3]))
            x0.append(v.reshape(-1, v.shape[-1]))
            noise.append(n.reshape(-1, v.shape[-1]))
            ts.append(t)
            offsets.append(offsets[-1] + x0[-1].shape[0])
            h = hashlib.sha256(x0[-1].numpy().tobytes())
            h.update(repr((shapes[-1], seed, iteration, i,
                           None if labels is None else int(labels[i]))).encode())
            digests.append(h.hexdigest()[:16])
        counts = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])])
        return cls(torch.cat(x0), torch.cat(noise), torch.tensor(ts, dtype=torch.float32),
                   None if labels is None else torch.tensor([int(x) for x in labels]),
                   shapes, offsets,
                   torch.repeat_interleave(torch.arange(len(videos)), counts), digests)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def lengths(self) -> list[int]:
        """Tokens of every video."""
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    @property
    def frame_tokens(self) -> list[int]:
        """Tokens per frame of every video (for the planner's cost model)."""
        return [h * w for _, h, w in self.shapes]

    def rows(self, i: int) -> torch.Tensor:
        """Row ids of video ``i`` (its tokens, frame-major)."""
        return torch.arange(self.offsets[i], self.offsets[i + 1])

    def sequences(self) -> SelfTargetBatch:
        """The global batch for `run_plan` / `StepDriver.step`: every video's row ids, every
        token its own target, with the videos' content digests."""
        return SelfTargetBatch([self.rows(i) for i in range(len(self))], self.digests,
                               self.frame_tokens)

    def to(self, device: torch.device) -> "VideoBatch":
        """The table on ``device`` (shapes, offsets and digests stay on the host)."""
        move = (lambda x: None if x is None else x.to(device))
        return VideoBatch(move(self.x0), move(self.noise), move(self.t), move(self.labels),
                          self.shapes, self.offsets, move(self.video_of_row), self.digests)
