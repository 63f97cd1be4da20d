"""A small byte-level transformer language model, trained on the Python standard library.

Every machine with Python has the text, with no download: the standard library's ``.py``
files, in sorted order. ``corpus = "top"`` (the default) takes the files at the top of its
directory, up to ``MAX_BYTES``; ``corpus = "stdlib"`` takes every file of every package (12 MB
on Python 3.11), its tests and ``site-packages`` excepted, and with them the library's own
documentation, which ships as ``pydoc_data/topics.py``. Every 20th file is held out for
evaluation, so the held-out text comes from every part of the corpus and is never trained
on. The bytes are the tokens (vocabulary 256), so there is no tokenizer to ship or agree on.

Shards: with ``shard_by = "file"`` (the default) training file ``i`` belongs to shard
``i % count``, so every shard holds a little of everything. With ``shard_by = "package"``
each top-level package (``email``, ``asyncio``, ``encodings``, ...; a module at the top is a
package of its own) goes whole to one shard, the largest first, each to the shard with the
fewest bytes so far: the shards are about equal in size and different in kind (one holds the
codec tables of ``encodings``, another the English of the documentation).

The data is whatever this Python's standard library holds, so nodes on different Python
versions train (and evaluate) on slightly different text; the averaging does not mind, but
compare ``bits_per_char`` only between nodes of one version.

Options (``[task.options]``):
    corpus: ``"top"`` or ``"stdlib"`` (see above; default ``"top"``).
    shard_by: ``"file"`` or ``"package"`` (see above; default ``"file"``).
    d_model: width of the residual stream (default 64).
    layers: transformer blocks (default 2).
    heads: attention heads; must divide d_model (default 4).
    context: bytes of context (default 64).
    lr: AdamW learning rate (default 3e-3).
    batch_size: windows per step (default 16).
    eval_windows: held-out windows of ``context`` bytes that ``evaluate`` scores (default 32).
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

__all__ = ["CharLM", "package_of", "package_shards", "shard_files", "split_files", "stdlib_files",
           "task"]

DEFAULTS: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 4, "context": 64,
                            "lr": 3e-3, "batch_size": 16, "eval_windows": 32}
CORPORA = ("top", "stdlib")  # task option corpus
SHARD_BY = ("file", "package")  # task option shard_by
MAX_BYTES = 3_000_000  # of source read with corpus = "top", in sorted file order
HOLD_OUT_EVERY = 20  # files i with i % 20 == 19 are held out (5%)
EVAL_SEED = 0  # the held-out windows never depend on the node or the swarm's seed
# Directories of the standard library that corpus = "stdlib" leaves out: its tests (much of
# them generated data) and what was installed into it.
SKIPPED = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


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
    words = {"corpus": CORPORA, "shard_by": SHARD_BY}
    for key, allowed in words.items():
        if ctx.options.get(key, allowed[0]) not in allowed:
            raise TaskError(f"task option {key} must be one of {', '.join(allowed)}, not "
                            f"{ctx.options[key]!r}")
    corpus, by = (ctx.options.get(key, allowed[0]) for key, allowed in words.items())
    opts = read_options({k: v for k, v in ctx.options.items() if k not in words}, DEFAULTS)
    d_model, heads, context = opts["d_model"], opts["heads"], opts["context"]
    if d_model % heads:
        raise TaskError(f"task option heads ({heads}) must divide d_model ({d_model})")
    train_files, held_out = split_files(stdlib_files(corpus))
    eval_text = _read(held_out)
    if len(eval_text) <= context:
        raise TaskError(f"the held-out text ({len(eval_text)} bytes) is shorter than the context")
    eval_x, eval_y = _windows(eval_text, opts["eval_windows"], context,
                              np.random.default_rng(EVAL_SEED))

    torch.manual_seed(ctx.seed)  # every node starts from the same weights
    model = CharLM(d_model, opts["layers"], heads, context)
    # fused: one kernel for the whole update, where the default on a CPU loops over the
    # tensors (4.3 ms of a 24 ms step at 1M parameters, against 1 ms fused).
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"], fused=True)
    batch_size = opts["batch_size"]

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        text = _read(shard_files(train_files, shard, by))
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


def stdlib_files(corpus: str = "top") -> list[Path]:
    """The standard library's ``.py`` files, sorted: with ``corpus = "top"`` those at the top
    of its directory, up to ``MAX_BYTES``; with ``"stdlib"`` every one outside ``SKIPPED``
    directories, sorted by their path in the library.

    Raises:
        TaskError: there are too few (a Python installed without its sources).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    if corpus == "stdlib":
        files = sorted(p for p in root.rglob("*.py")
                       if not SKIPPED.intersection(p.relative_to(root).parts[:-1])
                       and not p.relative_to(root).parts[0].startswith("config-"))
    for path in [] if files else sorted(root.glob("*.py")):
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


def shard_files(files: list[Path], shard: Shard, by: str = "file") -> list[Path]:
    """The training files of ``shard``: with ``by = "file"`` file ``i`` goes to shard
    ``i % count``; with ``by = "package"`` each top-level package goes whole to one shard
    (:func:`package_shards`)."""
    if by == "package":
        return [f for f, k in zip(files, package_shards(files, shard.count)) if k == shard.index]
    return files[shard.index::shard.count]


def package_of(path: Path) -> str:
    """The top-level package a file of the standard library belongs to: the directory below
    the library's root, or the module's own name for a file at the top."""
    parts = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).parts
    return parts[0] if len(parts) > 1 else path.stem


def package_shards(files: list[Path], count: int) -> list[int]:
    """Each file's shard, ``count`` shards cut by package: every package whole in one shard,
    the largest first, each into the shard with the fewest bytes so far (the lowest index on
    a tie), so that the shards come out about equal in size and the split depends only on
    the files."""
    sizes: dict[str, int] = {}
    for f in files:
        sizes[package_of(f)] = sizes.get(package_of(f), 0) + f.stat().st_size
    filled, home = [0] * count, {}
    for package in sorted(sizes, key=lambda p: (-sizes[p], p)):
        home[package] = k = min(range(count), key=lambda i: (filled[i], i))
        filled[k] += sizes[package]
    return [home[package_of(f)] for f in files]


def _read(files: list[Path]) -> np.ndarray:
    """The files' bytes, one after another, as uint8."""
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def _windows(text: np.ndarray, n: int, context: int,
             rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows of ``context + 1`` bytes: inputs ``[:-1]``, targets ``[1:]``."""
    start = rng.integers(0, len(text) - context, size=n)
    w = torch.from_numpy(text[start[:, None] + np.arange(context + 1)].astype(np.int64))
    return w[:, :-1], w[:, 1:]
