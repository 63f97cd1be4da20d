"""A tiny byte-level transformer language model, trained on the Python standard library.

Every machine with Python has the text: the ``.py`` files at the top of the standard
library's directory, in sorted order, up to ``MAX_BYTES``. Every 20th file is held out for
evaluation; training file ``i`` belongs to shard ``i % count``. The bytes are the tokens
(vocabulary 256), so there is no tokenizer to ship or agree on.

The data is whatever this Python's standard library holds, so nodes on different Python
versions train (and evaluate) on slightly different text; the averaging does not mind, but
compare ``bits_per_char`` only between nodes of one version.

Options (``[task.options]``):
    d_model: width of the residual stream (default 64).
    layers: transformer blocks (default 2).
    heads: attention heads; must divide d_model (default 4).
    context: bytes of context (default 64).
    lr: AdamW learning rate (default 3e-3).
    batch_size: windows per step (default 16).
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from daemon.task import Context, Shard, Task, TaskError, evaluating, read_options

__all__ = ["CharLM", "shard_files", "split_files", "stdlib_files", "task"]

DEFAULTS: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 4, "context": 64,
                            "lr": 3e-3, "batch_size": 16}
MAX_BYTES = 3_000_000  # of source read, in sorted file order
HOLD_OUT_EVERY = 20  # files i with i % 20 == 19 are held out (5%)
EVAL_WINDOWS = 32
EVAL_SEED = 0  # the held-out windows never depend on the node or the swarm's seed


class Block(nn.Module):
    """Pre-norm causal self-attention, then an MLP, each added to the residual stream."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Byte and position embeddings, ``layers`` blocks, a final norm and a linear head."""

    def __init__(self, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def task(ctx: Context) -> Task:
    """The model, its optimizer and batches of this node's files.

    Raises:
        TaskError: an option is unknown or bad, or the standard library has too little source.
    """
    opts = read_options(ctx.options, DEFAULTS)
    d_model, heads, context = opts["d_model"], opts["heads"], opts["context"]
    if d_model % heads:
        raise TaskError(f"task option heads ({heads}) must divide d_model ({d_model})")
    train_files, held_out = split_files(stdlib_files())
    eval_text = _read(held_out)
    if len(eval_text) <= context:
        raise TaskError(f"the held-out text ({len(eval_text)} bytes) is shorter than the context")
    eval_x, eval_y = _windows(eval_text, EVAL_WINDOWS, context, np.random.default_rng(EVAL_SEED))

    torch.manual_seed(ctx.seed)  # every node starts from the same weights
    model = CharLM(d_model, opts["layers"], heads, context)
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    batch_size = opts["batch_size"]

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        text = _read(shard_files(train_files, shard))
        if len(text) <= context:
            raise TaskError(f"charlm shard {shard.index}/{shard.count} has {len(text)} bytes of "
                            f"text, not more than the context ({context}): too many shards")
        rng = np.random.default_rng([ctx.seed % 2**64, shard.index])
        while True:
            yield _windows(text, batch_size, context, rng)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def evaluate() -> dict[str, float]:
        with evaluating(model) as device:
            logits = model(eval_x.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1), eval_y.to(device).flatten()).item()
        return {"loss": loss, "bits_per_char": loss / math.log(2)}

    return Task(model, opt, batches, step, batch_size=batch_size, evaluate=evaluate)


def stdlib_files() -> list[Path]:
    """The ``.py`` files at the top of the standard library, sorted, up to ``MAX_BYTES``.

    Raises:
        TaskError: there are none (a Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        if total >= MAX_BYTES:
            break
        files.append(path)
        total += path.stat().st_size
    if len(files) < HOLD_OUT_EVERY:
        raise TaskError(f"the charlm task needs the standard library's sources; {root} has "
                        f"{len(files)} .py files")
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every ``HOLD_OUT_EVERY``-th file is held out."""
    held = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return train, held


def shard_files(files: list[Path], shard: Shard) -> list[Path]:
    """The training files of ``shard``: file ``i`` goes to shard ``i % count``."""
    return files[shard.index::shard.count]


def _read(files: list[Path]) -> np.ndarray:
    """The files' bytes, one after another, as uint8."""
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def _windows(text: np.ndarray, n: int, context: int,
             rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows of ``context + 1`` bytes: inputs ``[:-1]``, targets ``[1:]``."""
    start = rng.integers(0, len(text) - context, size=n)
    w = torch.from_numpy(text[start[:, None] + np.arange(context + 1)].astype(np.int64))
    return w[:, :-1], w[:, 1:]
