"""Mixture-of-experts MLPs (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral), defined once: the layer's MLP
where ``ModelFeatures.moe`` says the layer is sparse (``layers.LayerLoader`` builds a
``MoeBlock`` in place of the gated MLP, ``layers.run_layers`` applies it).

A step: the router's logits in float32, softmax, the ``top_k`` largest (renormalized where the
family does); the batch's (row, choice) pairs sorted by expert (one gather of their rows), so
each chosen expert runs once over all the rows that chose it, reading its weights once, and its
output, times the row's routing weight, is added to those rows in float32 (one ``index_add_``).
Experts nobody chose are not touched. On our int4 kernel (``GroupedExperts``) a layer makes two
kernel calls whatever it chose: every chosen expert's gate_up in one, their down in another;
other formats call each chosen expert's layers in turn. ``ExpertLoad`` counts the experts read
and their bytes. A row's sum adds its experts in expert order whatever else the step holds, and
each kernel computes a row alike whatever rows share its call (linear.py), so a row's result does
not depend on its batch (DESIGN property 9).

Weights: each expert is a linear layer of ``WeightFormat`` built from its rows of the stacked
tensors (a GGUF's ``ffn_*_exps``: whole rows of blocks, so a Q4_K expert is int4 groups on our
kernel, as dense layers are); experts keep no dense copy (``WeightFormat.linear(expert=True)``):
prompt rows run on their blocks too. Qwen2-MoE's shared expert is a plain gated MLP (with the
dense layers' copies), its output times sigmoid(x . shared_expert_gate).

Checkpoint layouts, all read into one: per-expert tensors (``mlp.experts.E.gate_proj`` ...,
Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``), transformers' fused ones
(``mlp.experts.gate_up_proj`` [E, 2 I, H], ``mlp.experts.down_proj`` [E, H, I]) and a GGUF's
stacked ones become ``mlp.experts.{gate,up,down}_proj.weight`` with the experts' rows one after
the other ([E I, H] and [E H, I]); Mixtral's router ``block_sparse_moe.gate`` becomes
``mlp.gate``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine_worker.linear import Int4Linear, LinearWeight, WeightSource, dequantize
from engine_worker.model_config import ModelConfig
from engine_worker.weight_format import WeightFormat
from engine_worker.weight_sources import row_range
from ipc.messages import EXPERT_ROWS_BUCKETS

_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
MAX_PENDING = 1024  # counts kept before they are folded into the histogram


class ExpertLoad:
    """How many rows each expert took, per step and MoE layer, as a histogram over
    ``EXPERT_ROWS_BUCKETS`` (an expert no row chose counts as 0 rows): what an operator reads to
    see the experts' imbalance. The blocks hand in each call's counts; ``totals`` folds them in
    (once per step, by the engine's stats). Beside it, counted where the kernels are called:
    ``reads``, the experts whose weights a call read (each chosen expert once: the histogram's
    observations above 0 rows, when the step reads each once), and ``bytes``, their weights'
    bytes (what bounds a decode step's speed)."""

    def __init__(self) -> None:
        self.bounds = np.array(EXPERT_ROWS_BUCKETS, dtype=np.int64)
        self.buckets = [0] * (len(EXPERT_ROWS_BUCKETS) + 1)  # the last: above every bound
        self.rows = 0
        self.reads = 0
        self.bytes = 0
        self._pending: list[np.ndarray] = []

    def observe(self, counts: np.ndarray, reads: int, nbytes: int) -> None:
        self._pending.append(counts)
        self.reads += reads
        self.bytes += nbytes
        if len(self._pending) >= MAX_PENDING:  # forwards run with no engine reading the stats
            self.totals()

    def totals(self) -> tuple[list[int], int]:
        """(observations per bucket, rows) since the engine started."""
        if self._pending:
            # numpy, one thread: torch's bucketize woke its thread pool for a few hundred
            # values (7 ms a step on a loaded machine, in a profile of the speed model)
            counts = np.concatenate(self._pending)
            self._pending.clear()
            found = np.searchsorted(self.bounds, counts, side="left")
            added = np.bincount(found, minlength=len(self.buckets)).tolist()
            self.buckets = [a + b for a, b in zip(self.buckets, added)]
            self.rows += int(counts.sum())
        return self.buckets, self.rows


class Router:
    """The router's logits in float32, each row's the same bits whatever rows share the call and
    whatever the thread count: on a CPU one matrix-vector product per row (numpy's matmul over
    the rows stacked as [T, 1, hidden]: the same BLAS gemv for every row, its weights read as
    they lie). Measured: a float32 matrix product (``F.linear``, numpy's) gives a row other bits
    at 2 or 11 rows than alone; oneDNN on a packed copy kept them but cost 120-200 us a call in
    a decode step (its OpenMP team woken for a 48 x 2048 router: 393 kB, ~15 us of bytes), the
    gemv ~6 us a row. Elsewhere ``F.linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.float().contiguous()  # [experts, hidden]
        # [hidden, experts]: a transposed view, so each row's product is a gemv over weight's rows
        self.columns = self.weight.numpy().T if self.weight.device.type == "cpu" else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.columns is None:
            return F.linear(x, self.weight)
        rows = np.ascontiguousarray(x.numpy())[:, None, :]  # [T, 1, hidden]: T gemv calls
        return torch.from_numpy((rows @ self.columns)[:, 0])


class GroupedExperts:
    """A mixture's experts on our int4 kernel (``Int4Linear`` with its blocks, all of one
    layout): a step's gate_up of every chosen expert in one call of
    ``splitserve::int4_decode_grouped_mm`` (each expert over the rows that chose it, its weights
    read once), the activation once over all those rows, then their down in one more call."""

    def __init__(
        self, gate_up: list[Int4Linear], down: list[Int4Linear], prompt_int8: bool = False
    ) -> None:
        self.gate_up = [lin.packed for lin in gate_up]
        self.down = [lin.packed for lin in down]
        self.gate_up_parts, self.down_parts = gate_up[0].parts, down[0].parts
        self.prompt_int8 = prompt_int8  # prompt rows with int8 activations

    @staticmethod
    def of(
        gate_up: list[LinearWeight], down: list[LinearWeight], prompt_int8: bool = False
    ) -> GroupedExperts | None:
        """The experts grouped, where every one is on our kernel in one layout; else None."""
        parts = []
        for layers in (gate_up, down):
            own = [
                lin
                for lin in layers
                if isinstance(lin, Int4Linear) and lin.own_kernel and lin.bias is None
            ]
            if len(own) != len(layers) or len({(lin.packed.shape, lin.parts) for lin in own}) > 1:
                return None
            parts.append(own)
        return GroupedExperts(parts[0], parts[1], prompt_int8)

    def run(
        self,
        x: torch.Tensor,
        used: list[int],
        counts: list[int],
        activation: Callable[[torch.Tensor], torch.Tensor],
        prompt: bool = False,
    ) -> torch.Tensor:
        """x's rows (sorted by expert: ``counts[i]`` rows for expert ``used[i]``) through their
        experts; ``prompt``: they are prompt rows (int8 activations where ``prompt_int8``)."""
        ops = torch.ops.splitserve
        grouped = (
            ops.int4_prompt_grouped_mm
            if prompt and self.prompt_int8
            else ops.int4_decode_grouped_mm
        )
        gate_up = grouped(x, [self.gate_up[e] for e in used], counts, self.gate_up_parts)
        gate, up = gate_up.chunk(2, dim=-1)
        return grouped(activation(gate) * up, [self.down[e] for e in used], counts, self.down_parts)


@dataclass(slots=True)
class MoeBlock:
    router: Router
    gate_up: list[LinearWeight]  # per expert: gate and up rows stacked
    down: list[LinearWeight]
    top_k: int
    normalize: bool  # the kept probabilities renormalized to sum 1
    load: ExpertLoad
    shared_gate_up: LinearWeight | None = None  # Qwen2-MoE's shared expert
    shared_down: LinearWeight | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]
    trace: list[torch.Tensor] | None = None  # a list: each call's choices appended (tests)
    grouped: GroupedExperts | None = None  # the experts in one kernel call per part
    expert_bytes: list[int] = field(default_factory=list)  # per expert: gate_up's and down's
    prompt_int8: bool = False  # prompt rows with int8 activations (grouped experts)
    # and decode rows too in steps of more decoding requests than this (the format's crossover)
    int8_above: int = 0

    def __post_init__(self) -> None:
        self.grouped = GroupedExperts.of(self.gate_up, self.down, self.prompt_int8)
        self.expert_bytes = [g.nbytes + d.nbytes for g, d in zip(self.gate_up, self.down)]

    def apply(
        self,
        x: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor],
        decode_rows: int = 0,
        decode_batch: int | None = None,
    ) -> torch.Tensor:
        """The block's output for ``x`` [T, hidden] (the MLP's input, normed)."""
        weights, chosen = route(self.router.logits(x), self.top_k, self.normalize)
        if self.trace is not None:
            self.trace.append(chosen.clone())
        int8 = self.prompt_int8 and self.grouped is not None
        batch = decode_rows if decode_batch is None else decode_batch
        # Under int8 prompt rows take the int8 kernel, and decode rows too in a step of more
        # decoding requests than the format's crossover (as its linear layers take them):
        # each row on the path it would take in any other step of its kind and batch.
        decode_int8 = int8 and batch > self.int8_above
        split = min(max(decode_rows, 0), x.shape[0])  # rows [0, split) decode
        if int8 and not decode_int8 and 0 < split < x.shape[0]:
            out = torch.cat(
                [
                    self._experts(x[:split], weights[:split], chosen[:split], activation),
                    self._experts(x[split:], weights[split:], chosen[split:], activation, True),
                ]
            )
        else:  # one kind of row, or all on one kernel
            prompt = int8 and (decode_int8 or split == 0)
            out = self._experts(x, weights, chosen, activation, prompt)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = self.shared_gate_up.apply(x, decode_rows, decode_batch).chunk(2, dim=-1)
            shared = self.shared_down.apply(activation(gate) * up, decode_rows, decode_batch)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out += shared.float()
        return out.to(x.dtype)

    def _experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor],
        prompt: bool = False,
    ) -> torch.Tensor:
        """Each chosen expert once over its rows; the weighted sum per row, float32, each row's
        experts added in expert order (one index_add_ over the pairs sorted by expert). The
        bookkeeping on a few dozen integers runs in numpy (a microsecond an operation, where a
        torch operation costs several and may wake its thread pool). ``prompt``: x's rows are
        prompt rows (``GroupedExperts.run``)."""
        flat = chosen.cpu().numpy().ravel()
        order = flat.argsort(kind="stable")  # the (row, choice) pairs by expert
        counts = np.bincount(flat, minlength=len(self.down))
        used_at = np.flatnonzero(counts)
        used, per_expert = used_at.tolist(), counts[used_at].tolist()
        self.load.observe(counts, len(used), sum(self.expert_bytes[e] for e in used))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if not used:  # no rows
            return out
        rows = torch.from_numpy(order // self.top_k).to(x.device)  # each pair's row
        scale = torch.from_numpy(weights.cpu().numpy().ravel()[order]).to(x.device)
        pairs = x.index_select(0, rows)
        if self.grouped is not None:
            y = self.grouped.run(pairs, used, per_expert, activation, prompt)
        else:
            parts = pairs.split(per_expert)
            y = torch.cat([self._expert(e, part, activation) for e, part in zip(used, parts)])
        return out.index_add_(0, rows, y.float().mul_(scale.unsqueeze(1)))

    def _expert(
        self, expert: int, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        gate, up = self.gate_up[expert].apply(x).chunk(2, dim=-1)
        return self.down[expert].apply(activation(gate) * up)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, experts [T, top_k]): softmax over the router's ``logits``
    (float32), the ``top_k`` most probable, renormalized where ``normalize``."""
    probabilities = logits.softmax(dim=-1)
    weights, chosen = probabilities.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def load_moe(
    tensors: dict[str, WeightSource],
    fmt: WeightFormat,
    config: ModelConfig,
    layer: int,
    load: ExpertLoad,
) -> MoeBlock:
    """Layer ``layer``'s mixture out of ``tensors`` (the names of ``stack_expert_tensors``)."""
    spec = config.features.moe
    assert spec is not None
    p = f"model.layers.{layer}.mlp."
    router = dequantize(tensors.pop(p + "gate.weight")).to(fmt.device).float()
    hidden, size, count = config.hidden_size, spec.expert_size, spec.num_experts
    if tuple(router.shape) != (count, hidden):
        raise ValueError(f"{p}gate.weight is {tuple(router.shape)}, not ({count}, {hidden})")
    gate, up, down = (
        expert_rows(tensors.pop(f"{p}experts.{part}.weight"), count, f"{p}experts.{part}", shape)
        for part, shape in zip(EXPERT_PARTS, ((size, hidden), (size, hidden), (hidden, size)))
    )
    block = MoeBlock(
        router=Router(router),
        gate_up=[fmt.linear([g, u], expert=True) for g, u in zip(gate, up)],
        down=[fmt.linear([d], expert=True) for d in down],
        top_k=spec.top_k,
        normalize=spec.normalize,
        load=load,
        prompt_int8=fmt.prompt_kernel == "int8",
        int8_above=fmt.int8_rows_above(),
    )
    if spec.shared_size:
        shared = p + "shared_expert."
        block.shared_gate_up = fmt.linear(
            [tensors.pop(shared + "gate_proj.weight"), tensors.pop(shared + "up_proj.weight")]
        )
        block.shared_down = fmt.linear([tensors.pop(shared + "down_proj.weight")])
        if p + "shared_expert_gate.weight" in tensors:
            block.shared_gate = fmt.dense(tensors.pop(p + "shared_expert_gate.weight")).view(1, -1)
    return block


def expert_rows(
    source: WeightSource, count: int, name: str, shape: tuple[int, int]
) -> list[WeightSource]:
    """Each of ``count`` experts' [rows, cols] = ``shape`` out of a stacked tensor (3-D, or 2-D
    with the experts' rows one after the other; quantized blocks: whole rows, views)."""
    rows, cols = shape
    if isinstance(source, torch.Tensor) and source.dim() == 3:
        source = source.reshape(-1, source.shape[-1])
    q = source if isinstance(source, torch.Tensor) else source.q
    if tuple(q.shape) != (count * rows, cols):
        raise ValueError(
            f"{name} holds {tuple(q.shape)} weights, not {count} experts of {rows} x {cols}"
        )
    return [row_range(source, e * rows, (e + 1) * rows) for e in range(count)]


def stack_expert_tensors(tensors: dict[str, WeightSource]) -> None:
    """A Hugging Face checkpoint's experts under the stacked names ``load_moe`` reads (in
    place): per-expert tensors concatenated in expert order, transformers' fused gate_up split,
    Mixtral's names renamed."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in list(tensors):
        if ".block_sparse_moe.gate." in name:
            tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(name)
            continue
        found = _PER_EXPERT.match(name)
        if found:
            prefix, expert, part = found.groups()
            part = _MIXTRAL_PARTS.get(part, part)
            tensor = tensors.pop(name)
            assert isinstance(tensor, torch.Tensor)  # a safetensors checkpoint's
            per_expert.setdefault((prefix, part), {})[int(expert)] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):  # transformers' fused [E, 2 I, H]
            gate, up = tensors.pop(name).chunk(2, dim=1)  # type: ignore[union-attr]
            tensors[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            tensors[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
            tensors[name + ".weight"] = tensors.pop(name)
    for (prefix, part), experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}: the checkpoint's experts of {part} are not 0 to N - 1")
        stacked = torch.cat([experts[e] for e in range(len(experts))])
        tensors[f"{prefix}mlp.experts.{part}.weight"] = stacked
