"""The packed text tower: a batch's tokens back to back in one (T, w) tensor, every row computed on its own.

A batched text tower pads its texts to one length and runs every matrix product over the whole batch; a text's
embedding then depends on the batch (its padding, the row count the GEMM picks its kernel by). The packed tower
keeps the batch's speed without that dependence (the towers' guarantee: a text's embedding is the same bits alone
or in any batch):
- the texts' tokens are packed back to back without padding (T rows, each text's rows in order);
- every op on the packed rows computes each row on its own (LayerNorm's per-row kernel, the Linears, see
  below) or each element with one correctly rounded float op (add, mul);
- what mixes rows or calls a transcendental function (attention, the MLP activation, the final projection) runs
  per text on that text's rows, with the shapes the text has alone.
The Linears are pluggable (``linear``: an ``nn.Linear`` -> module on (T, K) rows):
- ``gare.text_quant.Int8Linear``: int8 products summed exactly in int32, row-wise scales: each row's output is a
  function of that row by construction;
- :class:`Fp32RowLinear`: float32 GEMMs of a fixed family of row counts (a multiple of ``ROW_BLOCK``, at most
  ``MAX_ROWS`` per call). A float GEMM's rounding of a row can depend on the call's row count and the row's
  place in it (MKL takes another path for fewer than 16 rows: measured here, every count 1-15 rounded other
  than 16+). On the CPUs measured, every count from 16 up and every place gave a row the same bits; a machine's
  GEMM is checked for it when the tower is built (:func:`rows_independent`), and a tower whose check fails is
  run one text at a time instead (``gare.text_quant.build_text_encoder``), which is invariant by construction.

Packing buys the GEMM's efficiency on many rows: one ViT-B/32 text of ~11 tokens alone runs its products on
11-16 rows (the weights read from memory for little work); 32 texts packed run them on ~350 rows. The
guarantee is per machine and thread count, as for every tower (a different CPU or ``torch.set_num_threads`` may
round differently, for a text alone as in a batch).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ROW_BLOCK = 16  # GEMM row counts are multiples of this: MKL's small-M path (M < 16) rounds a row differently
MAX_ROWS = 256  # rows per GEMM call; the build-time check covers every multiple of ROW_BLOCK up to it

__all__ = ["ROW_BLOCK", "MAX_ROWS", "token_lengths", "Fp32RowLinear", "PackedBlock", "PackedTextTower",
           "rows_independent"]


def token_lengths(tokens: torch.Tensor) -> list[int]:
    """Each text's own length in tokens (a, L) -> [L_i]: its EOT position + 1 (EOT has the largest id, as
    ``encode_text_tokens`` reads it); nothing after EOT can change the text's embedding (causal mask)."""
    return (tokens.argmax(dim=-1) + 1).tolist()


class Fp32RowLinear(nn.Module):
    """``nn.Linear`` in float32 on packed rows (T, K) -> (T, N), in GEMMs whose row counts are multiples of
    ``ROW_BLOCK`` (zero rows pad the last block) of at most ``MAX_ROWS`` rows each. ``gemm`` is the product this
    and :func:`rows_independent` run (a test may swap in one that rounds by the row count, as a machine's might)."""

    gemm: Callable[..., torch.Tensor] = staticmethod(F.linear)

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", lin.weight.detach().float().cpu().clone())  # (N, K)
        bias = lin.bias.detach().float().cpu().clone() if lin.bias is not None else None
        self.register_buffer("bias", bias)  # (N,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        padded = -(-T // ROW_BLOCK) * ROW_BLOCK
        if padded != T:  # zero rows: a row's result does not depend on its neighbours (rows_independent)
            x = torch.cat([x, x.new_zeros(padded - T, x.shape[1])])
        if padded <= MAX_ROWS:  # one call: its output as it is (a cat of one tensor would copy it)
            return self.gemm(x, self.weight, self.bias)[:T]
        y = torch.cat([self.gemm(part, self.weight, self.bias) for part in x.split(MAX_ROWS)])  # (padded, N)
        return y[:T]


class PackedBlock(nn.Module):
    """A ``gare.text_quant`` tower block on packed rows (T, w): Linears on all rows, attention and activation per
    text."""

    def __init__(self, blk: nn.Module, linear: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.ln_1, self.ls_1, self.ln_2, self.ls_2 = blk.ln_1, blk.ls_1, blk.ln_2, blk.ls_2
        self.heads = blk.attn.heads
        self.qkv, self.out = linear(blk.attn.qkv), linear(blk.attn.out)
        self.c_fc, self.act, self.c_proj = linear(blk.mlp.c_fc), blk.mlp.gelu, linear(blk.mlp.c_proj)

    def attend(self, qkv: torch.Tensor, lens: list[int], mask: torch.Tensor) -> torch.Tensor:
        """qkv (T, 3w) packed -> (T, w): causal attention within each text, one text at a time (its own L)."""
        w = qkv.shape[1] // 3
        out = []
        for part, n in zip(qkv.split(lens), lens, strict=True):
            q, k, v = part.view(1, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (1, h, n, w/h)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:n, :n])  # (1, h, n, w/h)
            out.append(y.transpose(1, 2).reshape(n, w))
        return torch.cat(out)

    def forward(self, x: torch.Tensor, lens: list[int], mask: torch.Tensor) -> torch.Tensor:
        """x (T, w) the texts' rows back to back, lens their lengths (sum T), mask (ctx, ctx) additive."""
        x = x + self.ls_1(self.out(self.attend(self.qkv(self.ln_1(x)), lens, mask)))
        # the activation per text: its vectorised and scalar-tail code paths may round differently, and which
        # elements take the tail depends on the tensor's size (and the threads' split of it)
        h = torch.cat([self.act(part) for part in self.c_fc(self.ln_2(x)).split(lens)])  # (T, 4w)
        return x + self.ls_2(self.c_proj(h))


class PackedTextTower(nn.Module):
    """A ``gare.text_quant.TextTower`` run on packed rows with ``linear`` Linears (module docstring)."""

    def __init__(self, tower: nn.Module, linear: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        tower = copy.deepcopy(tower)
        self.token_embedding = tower.token_embedding
        self.register_buffer("positional_embedding", tower.positional_embedding)
        self.register_buffer("attn_mask", tower.attn_mask)
        self.blocks = nn.ModuleList(PackedBlock(b, linear) for b in tower.blocks)
        self.ln_final = tower.ln_final
        self.register_buffer("text_projection", tower.text_projection)
        self.eval()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (a, L), any padding after each EOT -> t (a, d) float32."""
        lens = token_lengths(tokens)
        own = torch.arange(tokens.shape[1]) < torch.tensor(lens)[:, None]  # (a, L): each text's own tokens
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)[own]  # (T,) position within its text
        x = self.token_embedding(tokens[own]) + self.positional_embedding[pos]  # (T, w), row-major: texts in order
        for blk in self.blocks:
            x = blk(x, lens, self.attn_mask)
        x = self.ln_final(x[torch.tensor(lens).cumsum(0) - 1])  # (a, w): each text's EOT row
        # the projection per text: a batched (a, w) @ (w, d) could round row i differently for another a
        return torch.cat([row @ self.text_projection for row in x.split(1)])  # (a, d)


def rows_independent(tower: nn.Module, seed: int = 0) -> list[str]:
    """Check this machine's GEMM for what :class:`Fp32RowLinear` needs; returns the failures (empty: passed).

    For each distinct Linear shape of ``tower`` (a :class:`PackedTextTower`; its first block's weights): a probe of ``ROW_BLOCK`` random rows
    is multiplied alone (one 16-row call), then placed between random rows in a call of every row count 16, 32,
    ..., ``MAX_ROWS`` (at an offset that moves with the count) and of 32 rows at every offset 0-16; each probe row
    must come out with the same bits every time. About 2,700 rows per shape.
    """
    g = torch.Generator().manual_seed(seed)
    calls = [(m, (m // ROW_BLOCK - 1) * 21 % (m - ROW_BLOCK + 1)) for m in range(ROW_BLOCK, MAX_ROWS + 1, ROW_BLOCK)]
    calls += [(2 * ROW_BLOCK, at) for at in range(ROW_BLOCK + 1)]
    seen: set[tuple[int, int, bool]] = set()
    failures: list[str] = []
    for name, lin in tower.blocks[0].named_children():
        if not isinstance(lin, Fp32RowLinear):
            continue
        N, K = lin.weight.shape
        if (N, K, lin.bias is not None) in seen:
            continue
        seen.add((N, K, lin.bias is not None))
        probe = torch.randn(ROW_BLOCK, K, generator=g)
        ref = lin.gemm(probe, lin.weight, lin.bias)  # (16, N): the probe rows in a call of their own
        for m, at in calls:
            rows = torch.randn(m, K, generator=g)
            rows[at : at + ROW_BLOCK] = probe
            if not torch.equal(lin.gemm(rows, lin.weight, lin.bias)[at : at + ROW_BLOCK], ref):
                failures.append(f"{name} ({N}x{K}): the probe rows' bits change in a {m}-row GEMM at offset {at}")
                break
    return failures
