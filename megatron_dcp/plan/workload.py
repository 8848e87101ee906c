"""Workloads: the sequence lengths of one global batch.

* text: one token count per sequence;
* video: ``frames x height x width`` (latent patches) per sequence; ``video_lengths`` turns them
  into token counts, ``video_workload`` into token counts and tokens per frame (``height x
  width``: each video's own frame size, `megatron_dcp.plan.make_plan`'s ``frame_tokens``);
  built-in video mixes (``VIDEO_MIXES``, see `VideoMix`) and shapes files (`read_shapes_file`:
  lines ``frames height width``);
* built-in distributions (``DISTRIBUTIONS``), sampled until a global-batch token budget is met:

  ========== =================================================================================
  ``short``    short-dominated: 90 % of sequences 256-4k tokens (log-uniform), 8 % 4k-32k,
               2 % 32k-``max_len`` (the long tail of web / code corpora)
  ``balanced`` log-uniform over 256-``max_len``: every length scale holds the same number of
               sequences
  ``long``     long-dominated: 70 % of sequences ``max_len``/8-``max_len``, 30 % 1k-16k
               (long-context continued pre-training)
  ``uniform``  uniform over 1-``max_len`` tokens
  ========== =================================================================================

  ``max_len`` defaults to 131,072 (128k). Sampling is deterministic given the seed.
* files: one token count per line (``#`` comments and blank lines ignored), or a Megatron indexed
  dataset ``.idx`` (its sequence-lengths array; see `read_idx_lengths`);
* a dataset's documents read as a training run reads them (`dataset_batch`): one global batch
  of a token budget, whole documents or Megatron-LM's fixed-length samples cut at their
  documents' boundaries.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from megatron_dcp.plan.idx_format import read_lengths

DEFAULT_MAX_LEN = 131072


class WorkloadError(ValueError):
    """Bad sequence lengths or an unreadable workload file."""


def validate_lengths(lengths: Iterable, where: str = "lengths") -> list[int]:
    """Lengths as a list of positive ints; non-integers, non-positive values or no values raise."""
    result: list[int] = []
    for i, value in enumerate(lengths):
        integer_like = isinstance(value, (int, float)) or hasattr(value, "__index__")
        if isinstance(value, bool) or not integer_like:
            raise WorkloadError(f"{where}: sequence {i} has length {value!r}, not an integer")
        if isinstance(value, float):
            if not value.is_integer():
                raise WorkloadError(f"{where}: sequence {i} has length {value!r}, not an integer")
            value = int(value)
        value = int(value)
        if value < 1:
            raise WorkloadError(f"{where}: sequence {i} has length {value}; lengths must be >= 1")
        result.append(value)
    if not result:
        raise WorkloadError(f"{where}: the global batch is empty (no sequences)")
    return result


def video_lengths(shapes: Sequence[Sequence[int]]) -> list[int]:
    """Token counts of videos given as ``(frames, height, width)`` in latent patches."""
    result = []
    for i, shape in enumerate(shapes):
        if len(shape) != 3 or any(int(x) != x or x < 1 for x in shape):
            raise WorkloadError(f"video {i}: shape {tuple(shape)!r} must be three positive "
                                "integers "
                                "(frames, height, width)")
        frames, height, width = (int(x) for x in shape)
        result.append(frames * height * width)
    return result


def video_workload(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Token counts and tokens per frame (``height x width``) of videos given as ``(frames,
    height, width)`` in latent patches: `make_plan`'s ``lengths`` and ``frame_tokens``."""
    lengths = video_lengths(shapes)
    return lengths, [int(shape[1]) * int(shape[2]) for shape in shapes]


# ---------------------------------------------------------------------- video mixes
VAE_SPATIAL = 8
"""Pixels per latent cell along height and width (Open-Sora 1.2's and most video VAEs' 8x)."""
PATCH = 2
"""Latent cells per patch along height and width (the DiT's 2x2 patches, STDiT's 1x2x2)."""
VAE_FRAMES = (17, 5)
"""Video frames to latent frames: Open-Sora 1.2's VAE encodes 17 frames into 5 latents."""
RESOLUTIONS = {"240p": 240 * 426, "360p": 360 * 640, "480p": 480 * 854, "720p": 720 * 1280}
"""Pixel area of each resolution (16:9 frames); other aspect ratios keep the area, as Open-Sora's
aspect-ratio buckets do."""
ASPECTS = ((16 / 9, 0.6), (9 / 16, 0.2), (1.0, 0.2))
"""(width / height, probability) of a drawn video: landscape, portrait, square."""
DURATIONS = {"image": (1, 1), "2s": (17, 51), "4s": (52, 102), "8s": (103, 204),
             "16s": (205, 408)}
"""Video frames (24 fps) of each duration class, drawn uniformly within; ``image`` is one frame.
The upper ends are Open-Sora 1.2's frame buckets 51, 102, 204, 408."""


@dataclass(frozen=True)
class VideoMix:
    """A distribution of latent video shapes: a resolution and a duration class drawn
    independently (``(name, probability)`` pairs), an aspect ratio from `ASPECTS`."""

    resolutions: tuple[tuple[str, float], ...]
    durations: tuple[tuple[str, float], ...]
    doc: str


VIDEO_MIXES = {
    "short": VideoMix((("240p", 0.4), ("360p", 0.3), ("480p", 0.2), ("720p", 0.1)),
                      (("image", 0.4), ("2s", 0.35), ("4s", 0.15), ("8s", 0.07), ("16s", 0.03)),
                      "images and short low-resolution clips dominate (web video pre-training's "
                      "early stages)"),
    "balanced": VideoMix((("240p", 0.25), ("360p", 0.25), ("480p", 0.25), ("720p", 0.25)),
                         (("image", 0.2), ("2s", 0.2), ("4s", 0.2), ("8s", 0.2), ("16s", 0.2)),
                         "every resolution and duration class equally likely"),
    "long": VideoMix((("240p", 0.1), ("360p", 0.2), ("480p", 0.3), ("720p", 0.4)),
                     (("image", 0.05), ("2s", 0.1), ("4s", 0.2), ("8s", 0.3), ("16s", 0.35)),
                     "long high-resolution clips dominate (late-stage, high-quality fine-tuning)"),
}
"""Built-in video mixes (the resolutions 240p-720p and frame buckets up to 408 frames of
Open-Sora 1.2's / VideoSys's bucket configs; the weights are this project's, documented in
docs/BENCHMARKS.md)."""


def latent_shape(video_frames: int, pixels: int, aspect: float) -> tuple[int, int, int]:
    """``(frames, height, width)`` in latent patches of a video of ``video_frames`` frames with
    ``pixels`` per frame at ``width / height = aspect``: ``VAE_FRAMES`` in time (one frame stays
    one), ``VAE_SPATIAL x PATCH`` pixels per patch in space."""
    frames = 1 if video_frames == 1 else max(1, round(video_frames * VAE_FRAMES[1]
                                                      / VAE_FRAMES[0]))
    height = math.sqrt(pixels / aspect)
    width = pixels / height
    cell = VAE_SPATIAL * PATCH
    return frames, max(1, int(height // cell)), max(1, int(width // cell))


def _pick(rng: random.Random, choices: Sequence[tuple]) -> object:
    u, acc = rng.random(), 0.0
    for value, weight in choices:
        acc += weight
        if u < acc:
            return value
    return choices[-1][0]


def sample_videos(mix: str, global_batch_tokens: int, *, seed: int = 0
                  ) -> list[tuple[int, int, int]]:
    """Latent ``(frames, height, width)`` shapes drawn from ``VIDEO_MIXES[mix]`` until their
    tokens reach ``global_batch_tokens`` (videos are whole: the last one may pass it).
    Deterministic given the seed."""
    if mix not in VIDEO_MIXES:
        raise WorkloadError(f"unknown video mix {mix!r}: choose one of {', '.join(VIDEO_MIXES)}")
    if global_batch_tokens < 1:
        raise WorkloadError(f"global batch tokens {global_batch_tokens} must be >= 1")
    spec = VIDEO_MIXES[mix]
    rng = random.Random(f"video:{mix}:{seed}")
    shapes: list[tuple[int, int, int]] = []
    total = 0
    while total < global_batch_tokens:
        resolution = _pick(rng, spec.resolutions)
        low, high = DURATIONS[_pick(rng, spec.durations)]
        aspect = _pick(rng, ASPECTS)
        shape = latent_shape(rng.randint(low, high), RESOLUTIONS[resolution], aspect)
        shapes.append(shape)
        total += shape[0] * shape[1] * shape[2]
    return shapes


def _data_lines(path: str, what: str, layout: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of every line of the text file ``path`` that holds more than a
    ``#`` comment, the comment cut off. A file that cannot be read, or is not text, is a
    `WorkloadError` naming ``what`` (e.g. ``"lengths file"``) and, for the latter, the
    expected ``layout``."""
    try:
        with open(path) as handle:
            lines = handle.readlines()
    except OSError as err:
        raise WorkloadError(f"cannot read {what} {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{what} {path!r} is not text ({layout})") from None
    numbered = ((number, line.split("#", 1)[0].strip()) for number, line in enumerate(lines, 1))
    return [(number, text) for number, text in numbered if text]


def read_shapes_file(path: str) -> list[tuple[int, int, int]]:
    """Video shapes, one ``frames height width`` line (latent patches, whitespace-separated) per
    video; blank lines and ``#`` comments are ignored. Errors name the file and line."""
    shapes = []
    for number, text in _data_lines(path, "shapes file", "lines of 'frames height width'"):
        fields = text.split()
        if len(fields) != 3:
            raise WorkloadError(f"{path}:{number}: expected 'frames height width' (three "
                                f"integers), got {len(fields)} field(s): {' '.join(fields)!r}")
        try:
            values = tuple(int(x) for x in fields)
        except ValueError:
            raise WorkloadError(f"{path}:{number}: {' '.join(fields)!r} are not three integers "
                                "(frames height width in latent patches)") from None
        if min(values) < 1:
            raise WorkloadError(f"{path}:{number}: frames, height and width must be >= 1, got "
                                f"{' '.join(fields)}")
        shapes.append(values)
    if not shapes:
        raise WorkloadError(f"{path}: no video shapes (lines of 'frames height width')")
    return shapes


def _log_uniform(rng: random.Random, low: float, high: float) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _short(rng: random.Random, max_len: int) -> int:
    u = rng.random()
    if u < 0.90:
        return _log_uniform(rng, 256, min(4096, max_len))
    if u < 0.98:
        return _log_uniform(rng, min(4096, max_len), min(32768, max_len))
    return _log_uniform(rng, min(32768, max_len), max_len)


def _balanced(rng: random.Random, max_len: int) -> int:
    return _log_uniform(rng, min(256, max_len), max_len)


def _long(rng: random.Random, max_len: int) -> int:
    if rng.random() < 0.7:
        return _log_uniform(rng, max(1, max_len // 8), max_len)
    return _log_uniform(rng, min(1024, max_len), min(16384, max_len))


def _uniform(rng: random.Random, max_len: int) -> int:
    return rng.randint(1, max_len)


DISTRIBUTIONS = {"short": _short, "balanced": _balanced, "long": _long, "uniform": _uniform}


def sample_lengths(dist: str, global_batch_tokens: int, *, seed: int = 0,
                   max_len: int = DEFAULT_MAX_LEN) -> list[int]:
    """Lengths drawn from a built-in distribution until ``global_batch_tokens`` is reached (the last
    sequence is cut so the total is exact)."""
    if dist not in DISTRIBUTIONS:
        raise WorkloadError(f"unknown distribution {dist!r}: choose one of "
                            f"{', '.join(DISTRIBUTIONS)}")
    if global_batch_tokens < 1:
        raise WorkloadError(f"global batch tokens {global_batch_tokens} must be >= 1")
    if max_len < 1:
        raise WorkloadError(f"max_len {max_len} must be >= 1")
    rng = random.Random(f"{dist}:{seed}")
    draw = DISTRIBUTIONS[dist]
    lengths: list[int] = []
    total = 0
    while total < global_batch_tokens:
        n = max(1, min(max_len, draw(rng, max_len), global_batch_tokens - total))
        lengths.append(n)
        total += n
    return lengths


def read_lengths_file(path: str) -> list[int]:
    """One token count per line; blank lines and ``#`` comments are ignored."""
    if path.endswith(".idx"):
        return read_idx_lengths(path)
    values = []
    for number, text in _data_lines(path, "lengths file", "one token count per line; a "
                                    "Megatron index must end in .idx"):
        try:
            value = int(text)
        except ValueError:
            raise WorkloadError(
                f"{path}:{number}: {text!r} is not an integer token count") from None
        if value < 1:
            raise WorkloadError(f"{path}:{number}: length {value} must be >= 1")
        values.append(value)
    if not values:
        raise WorkloadError(f"{path}: no sequence lengths (the file is empty)")
    return values


def read_idx_lengths(path: str) -> list[int]:
    """Sequence lengths of a Megatron indexed dataset index (``.idx``, read by
    `megatron_dcp.plan.idx_format`), checked as lengths; `WorkloadError` naming the file."""
    try:
        lengths = read_lengths(path)
    except ValueError as err:
        raise WorkloadError(str(err)) from None
    except OSError as err:
        raise WorkloadError(f"cannot read index {path!r}: {err.strerror or err}") from None
    return validate_lengths(lengths, where=path)


def dataset_batch(documents: Sequence[int], tokens: int, *, batch: int = 0,
                  seq_length: "int | None" = None, max_len: "int | None" = None) -> list[int]:
    """The sequence lengths of global batch ``batch`` (0, 1, ...) of ``tokens`` tokens of a
    dataset whose documents hold ``documents`` tokens (dataset order), read without shuffling:
    batch k starts ``k x tokens`` into the documents laid end to end (wrapping at the end).

    Without ``seq_length`` every document is a sequence (at most ``max_len`` tokens; the batch's
    last one cut to the budget). With it, as Megatron-LM's GPT dataset and the launcher's data
    path: the stream is cut into samples of ``seq_length`` tokens (the budget rounded down to
    whole samples), and every document piece inside a sample, with the target of its last
    token, is a sequence (``piece + 1`` tokens). `WorkloadError` when the budget exceeds the
    dataset or holds no sample."""
    total = sum(documents)
    if tokens > total:
        raise WorkloadError(f"a global batch of {tokens} tokens is more than the dataset holds "
                            f"({total} tokens in {len(documents)} documents)")
    if seq_length is not None:
        if tokens < seq_length:
            raise WorkloadError(f"a global batch of {tokens} tokens holds no sample of "
                                f"--seq-length {seq_length}")
        tokens -= tokens % seq_length
    k, offset = 0, (batch * tokens) % total
    while offset >= documents[k]:
        offset -= documents[k]
        k += 1
    out, left, room = [], tokens, seq_length or math.inf
    while left > 0:
        piece = min(documents[k % len(documents)] - offset, left, room)
        offset += piece
        left -= piece
        if seq_length is None:
            out.append(min(piece, max_len or piece))
        else:
            out.append(piece + 1)
            room -= piece
            room = room or seq_length
        if offset == documents[k % len(documents)] or seq_length is None:
            k, offset = k + 1, 0
    return out
