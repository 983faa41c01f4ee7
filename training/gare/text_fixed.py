"""Fixed-shape batching of a text tower: every call of the tower gets exactly (rows, context) tokens.

A float tower's rounding of a text can depend on the shape of the call it runs in: the GEMM libraries (MKL,
oneDNN, cuBLAS) pick their kernels, blocking and split of the reduction by the matrix shape, attention and
LayerNorm kernels by the sequence length and batch. A tower run on batches of whatever size the caller sends
would give a text other bits alone than beside others. Two ways keep a text's embedding the same bits alone or
in any batch:
- each text alone at its own length (:func:`encode_each`): the call a text gets alone, whatever the batch;
  invariant by construction, but 32 texts cost 32 forward passes;
- fixed shapes (:class:`FixedShapeEncoder`): the tokens padded to one context length (the model's query
  context, what its tokenizer pads to) and the texts split into chunks of ``rows`` texts, the last chunk padded
  with filler rows (zero tokens), so that every tower call has the one shape (rows, context) and the real rows'
  outputs are kept. Every kernel then is the same launch for a text alone (row 0, beside rows - 1 filler rows)
  as beside 31 other texts; only the row's own data and its place in the batch differ. A row's result does
  not depend on its neighbours when every op of the tower computes rows on their own (GEMM, LayerNorm, the
  activation) or within one text (attention), which holds for the kernels of one fixed launch on the devices
  measured; it is not a law, so an encoder given probe texts checks it at build time (:meth:`check`: the probes
  alone against the probes at other places beside other texts) and runs each text alone instead, with a
  warning, where the check fails. 32 texts cost one forward pass; one text costs one forward pass of 32 rows
  (on a GPU that is launch-bound at these sizes, about the cost of one row).
On CUDA the fixed-shape forward can be captured once in a CUDA graph (``cuda_graph``: static input and output
buffers, warmed up on a side stream as PyTorch documents) and replayed per chunk, without the Python and kernel
launch overhead: the same kernels on the same shapes, so the same bits as the eager forward (checked at build
on the probes; a capture that fails or differs is dropped for the eager forward, with a warning).

The fixed-shape result is not bitwise the per-text result: the same text runs in other shapes (rows x
context instead of 1 x its own length), whose kernels may block and round differently; both are invariant on
their own, and agree within float rounding. The guarantee is per device and thread count, as for every tower
(``gare.text_quant``'s docstring).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from gare.text_packed import token_lengths

log = logging.getLogger(__name__)

DEFAULT_ROWS = 32  # texts per fixed-shape call: a service micro-batch of 32 queries is one forward pass
# How the model's own tower runs (``scheme``): "per-text" (encode_each) or "fixed" (FixedShapeEncoder); "auto"
# picks by device. CUDA: fixed, since at query sizes a GPU forward is launch-bound (one text alone costs about
# what 32 rows cost, so per text 32 texts cost ~32x one). CPU: per text, since a CPU forward is compute-bound
# (padding every text to the context and every chunk to `rows` texts multiplies the work, one text alone at its
# own length is the cheapest call) and per text is invariant by construction; "fixed" stays selectable there.
SCHEMES = ("auto", "per-text", "fixed")

__all__ = ["DEFAULT_ROWS", "SCHEMES", "resolve_scheme", "encode_each", "fit_context", "autocast_tower",
           "FixedShapeEncoder"]


def resolve_scheme(scheme: str, device_type: str) -> str:
    """``scheme`` (one of SCHEMES) on ``device_type`` -> "per-text" or "fixed" ("auto": fixed on CUDA only)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown text encoding scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "auto":
        return "fixed" if device_type == "cuda" else "per-text"
    return scheme


def encode_each(encode: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """``encode`` run on every text alone at its own length: tokens (a, L) -> t (a, d).

    Text i gets ``encode(tokens[i:i+1, :L_i])``, exactly the call it gets when it is sent alone, so its
    embedding cannot depend on the rest of the batch (see the module docstring). ``a`` must be >= 1.
    """
    if tokens.shape[0] == 0:
        raise ValueError("encode_each needs at least one text")
    return torch.cat([encode(tokens[i : i + 1, :n]) for i, n in enumerate(token_lengths(tokens))])


def fit_context(tokens: torch.Tensor, context: int) -> torch.Tensor:
    """tokens (a, L) -> (a, context): zero columns appended, or trailing all-zero columns dropped.

    Nothing after a text's EOT changes its embedding (causal mask, read at EOT), so padding is free; a text
    longer than ``context`` tokens raises :class:`ValueError` (it would be cut).
    """
    a, L = tokens.shape
    if L < context:
        return torch.cat([tokens, tokens.new_zeros(a, context - L)], dim=1)
    if L > context:
        if bool((tokens[:, context:] != 0).any()):
            longest = max(token_lengths(tokens)) if a else 0
            raise ValueError(f"a text of {longest} tokens does not fit the encoder's context of {context} tokens")
        return tokens[:, :context]
    return tokens


def autocast_tower(encode: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str,
                   precision: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``encode`` run under ``precision``'s autocast on ``device`` (fp32: as it is; bf16; fp16 on CUDA only).

    Autocast's cache of cast weights is off: a CUDA graph capture must not keep casts made outside it (PyTorch's
    CUDA graph notes), and a cast is the same bits whether cached or not.
    """
    dev = torch.device(device)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtype:
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if precision == "fp16" and dev.type != "cuda":
        raise ValueError(f"fp16 autocast is only supported on CUDA, not on {dev.type!r}; use bf16 or fp32 there")
    cast = dtype[precision]
    if cast is None:
        return encode

    def run(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=dev.type, dtype=cast, cache_enabled=False):
            return encode(tokens)

    return run


class FixedShapeEncoder:
    """A text tower run at one fixed shape: tokens (a, L <= context) int64 -> t (a, d) float32 on ``device``.

    ``tower_fn``: tokens (rows, context) int64 on ``device`` -> (rows, d), rows independent (module docstring);
    it is called with exactly that shape, ceil(a / rows) times per call (``forward_passes`` counts them, replays
    of the CUDA graph included). ``probe``: token rows (p, <= context), p >= 1, of real texts of different
    lengths; given, :meth:`check` runs at build and a failing device gets each text alone instead (``fixed``
    False). ``cuda_graph`` (CUDA only): capture the forward once and replay it. ``weights``: tensors the tower
    reads; a captured graph reads them where they were at capture, so a call after one of them moved (the model
    sent to another device, its tensors replaced) raises :class:`RuntimeError` instead of reading freed memory.
    Calls are serialised (one set of static buffers).
    """

    def __init__(self, tower_fn: Callable[[torch.Tensor], torch.Tensor], rows: int, context: int,
                 device: torch.device | str, *, cuda_graph: bool = False, probe: torch.Tensor | None = None,
                 weights: Sequence[torch.Tensor] = (), kind: str = "") -> None:
        if int(rows) < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if int(context) < 2:
            raise ValueError(f"context must be >= 2 tokens (SOT, EOT), got {context}")
        self.tower_fn = tower_fn
        self.rows, self.context = int(rows), int(context)
        self.device = torch.device(device)
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device, not {self.device}")
        self.kind = kind
        self.fixed = True  # False: the probe check failed, each text runs alone (encode_each)
        self.failures: list[str] = []  # what the check found (empty: passed or not run)
        self.forward_passes = 0
        self._lock = threading.Lock()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_in: torch.Tensor | None = None  # (rows, context) int64 on the device
        self._static_out: torch.Tensor | None = None  # (rows, d)
        self._weights = list(weights)
        self._weight_ptrs = [w.data_ptr() for w in self._weights]
        if cuda_graph:
            self._capture()
        if probe is not None:
            self.failures = self.check(probe)
            if self.failures:
                log.warning("text encoder %s: this device's kernels do not keep a row's bits at the fixed shape "
                            "%dx%d (%s); encoding each text alone instead (invariant, without the batching's "
                            "speed)", kind or "?", self.rows, self.context, self.failures[0])
                self.fixed = False
                self._drop_graph()

    # ------------------------------------------------------------------ description
    @property
    def graph(self) -> bool:
        """Whether calls replay a captured CUDA graph."""
        return self._graph is not None

    @property
    def shape_key(self) -> str | None:
        """"rows x context" when the fixed shape runs (what changes the bits, for cache keys), else None."""
        return f"{self.rows}x{self.context}" if self.fixed else None

    @property
    def scheme(self) -> str:
        if not self.fixed:
            return "per text (fixed shapes failed the device check)"
        return f"fixed {self.rows}x{self.context}" + (", CUDA graph" if self.graph else "")

    # ------------------------------------------------------------------ running
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must be (a >= 1, L), got {tuple(tokens.shape)}")
        tokens = fit_context(tokens, self.context)
        with self._lock, torch.inference_mode():
            if not self.fixed:
                self.forward_passes += tokens.shape[0]
                return encode_each(self.tower_fn, tokens.to(self.device)).float()
            return torch.cat([self._run_chunk(chunk) for chunk in tokens.split(self.rows)])

    def _padded(self, chunk: torch.Tensor) -> torch.Tensor:
        """chunk (n <= rows, context) -> (rows, context) on the device, filler rows all zero tokens."""
        full = torch.zeros(self.rows, self.context, dtype=torch.int64, device=chunk.device)
        full[: chunk.shape[0]] = chunk
        return full.to(self.device, non_blocking=False)

    def _run_chunk(self, chunk: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
        """One fixed-shape forward: chunk (n <= rows, context) -> its rows' t (n, d) float32 (a copy)."""
        n = chunk.shape[0]
        x = self._padded(chunk)
        self.forward_passes += 1
        if self._graph is None or eager:
            return self.tower_fn(x)[:n].float()
        if [w.data_ptr() for w in self._weights] != self._weight_ptrs:
            raise RuntimeError("the text tower's weights moved since its CUDA graph was captured (the model was "
                               "moved or its tensors replaced); build the encoder again")
        assert self._static_in is not None and self._static_out is not None
        with torch.cuda.device(self.device):  # the graph's device, whatever device is current
            self._static_in.copy_(x)
            self._graph.replay()
            return self._static_out[:n].float().clone()  # clone: the next replay overwrites the static output

    def _capture(self) -> None:
        """Capture the fixed-shape forward in a CUDA graph (warm-up on a side stream first); on failure log
        one warning and stay eager."""
        try:
            with torch.cuda.device(self.device), torch.inference_mode():
                static_in = torch.zeros(self.rows, self.context, dtype=torch.int64, device=self.device)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles, workspaces) outside the capture
                    for _ in range(3):
                        self.tower_fn(static_in)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls (a search running beside the build) do not void the capture
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    static_out = self.tower_fn(static_in)
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any capture failure (an op that syncs, an unsupported kernel): eager
            log.warning("text encoder %s: CUDA graph capture failed (%s: %s); running the fixed-shape forward "
                        "eagerly (the same bits, with the launch overhead)", self.kind or "?", type(e).__name__, e)
            self._drop_graph()
            return
        self._graph, self._static_in, self._static_out = graph, static_in, static_out

    def _drop_graph(self) -> None:
        self._graph = self._static_in = self._static_out = None

    # ------------------------------------------------------------------ the device check
    def check(self, probe: torch.Tensor) -> list[str]:
        """Whether a row keeps its bits at the fixed shape here; returns the failures (empty: passed).

        ``probe`` (p >= 1 texts' tokens): each probe alone (row 0, the rest filler), against the probes placed at
        the last rows beside the other probes repeated (another place, other neighbours); with a CUDA graph also
        the graph's output against the eager forward of the same batch (a graph that differs is dropped, the
        check then judges the eager forward). p + 1 forward passes (+2 with a graph).
        """
        probe = fit_context(probe, self.context).to(self.device)
        p = probe.shape[0]
        if p == 0:
            raise ValueError("check needs at least one probe text")
        with torch.inference_mode():
            order = torch.arange(self.rows) % p  # every row a probe: rows filled with real texts, not filler
            mixed = probe[torch.roll(order, 1)]  # (rows, context): probe j lands at rows j+1, j+1+p, ...
            if self._graph is not None:
                got, want = self._run_chunk(mixed), self._run_chunk(mixed, eager=True)
                if not torch.equal(got, want):
                    log.warning("text encoder %s: the CUDA graph's output differs from the eager forward's "
                                "(max |diff| %.3g); running eagerly", self.kind or "?",
                                float((got - want).abs().max()))
                    self._drop_graph()
            alone = torch.cat([self._run_chunk(probe[j : j + 1]) for j in range(p)])  # (p, d), each at row 0
            batch = self._run_chunk(mixed)  # (rows, d)
        failures = []
        for r in range(self.rows):
            j = int(order[(r - 1) % self.rows])  # the probe at row r (rolled by one)
            if not torch.equal(batch[r], alone[j]):
                failures.append(f"probe {j} ({token_lengths(probe[j : j + 1])[0]} tokens) rounds differently at "
                                f"row {r} of {self.rows} beside other texts than alone at row 0")
                break
        return failures
