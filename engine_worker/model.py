"""Our own forward for the Llama family and its relatives (Llama/SmolLM2/SmolLM3, Mistral, Qwen2
with qkv bias, Qwen3 with q/k norm, Gemma 2/3, Phi-3/4, Granite, OLMo 2, and the mixtures of
experts Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral: what differs is ``ModelConfig.features``, the
layers are ``engine_worker.layers``', a mixture's MLP ``engine_worker.moe``'s), loaded from
safetensors or from a GGUF at its own precision. It runs on a flat batch
of tokens from many sequences and reads/writes the paged KV cache through an
``engine_worker.attention`` backend. Linear layers are ``LinearWeight``s
(``engine_worker.linear``): the forward calls ``apply`` whatever format ``WeightFormat`` gave
them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.gguf_tensors import read_gguf
from engine_worker.layers import EagerLayers, LayerLoader, LayerWeights, rope_tables
from engine_worker.linear import LinearWeight, WeightSource, refine_top_logits
from engine_worker.model_config import ModelConfig
from engine_worker.model_features import text_tensor_name
from engine_worker.moe import stack_expert_tensors
from engine_worker.scripted_decode import ScriptedDecode
from engine_worker.weight_format import WeightFormat
from runtime.model_files import gguf_weights

try:
    from numpy._core import multiarray as np_multiarray  # numpy 2
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as np_multiarray  # type: ignore[no-redef]

logger = logging.getLogger("splitserve.engine.model")


class ForwardOutput(NamedTuple):
    """What a forward returns: logits [rows, vocab] (float32), and the final hidden states they
    were computed from (the head's input rows, in the same order). A prompt tail keeps the row
    of its prompt's end (prefix_tails.py), which a later identical prompt samples from."""

    logits: torch.Tensor
    final_hidden: torch.Tensor


class LlamaFamilyModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, WeightSource],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        weight_format: WeightFormat | None = None,
        load_workers: int = 1,
    ) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        fmt = weight_format or WeightFormat("auto", dtype, device)
        self.weight_format = fmt

        def take(name: str) -> torch.Tensor:
            return fmt.dense(tensors.pop(name))

        embed_source = tensors["model.embed_tokens.weight"]
        self.embed = take("model.embed_tokens.weight")
        features = config.features
        self.embedding_scale = features.embedding_scale
        if features.round_embedding_scale:  # Gemma multiplies by the scale in the dtype
            self.embedding_scale = float(torch.tensor(self.embedding_scale, dtype=dtype))
        loader = LayerLoader(config, tensors, fmt)
        # Layers (and the head) are independent: built by ``load_workers`` threads (numpy and
        # torch's ops release the GIL; ``loading`` keeps each op on its thread), in order.
        with ThreadPoolExecutor(max(1, load_workers)) as pool:
            head = pool.submit(self._head, tensors, embed_source)  # the largest: first
            self.layers: list[LayerWeights] = list(pool.map(loader.layer, range(config.num_layers)))
            self.lm_head, head_source = head.result()
        self.expert_load = loader.expert_load  # a mixture of experts' load (None: dense)
        self.eager_layers = EagerLayers(config, self.layers)
        final_norm = loader.norm("model.norm.weight")
        if final_norm is None:
            raise KeyError("model.norm.weight")
        self.norm = final_norm
        # Below float32 the head's output is rounded: each row's top logits are recomputed in
        # float32 from the checkpoint's own head rows (blocks: small, kept on the CPU) or the
        # dense head's (linear.refine_top_logits).
        self.exact_head: WeightSource | None = None
        if dtype != torch.float32:
            self.exact_head = _exact_head_rows(head_source, self.lm_head, device)
        self.ropes = rope_tables(config, max_positions, device, dtype)
        self.cos, self.signed_sin = self.ropes[0]
        # The hot decode step's layers compiled from the same definition, one TorchScript call
        # (``use_scripted_decode``).
        self.scripted_decode: ScriptedDecode | None = None

    def _head(
        self, tensors: dict[str, WeightSource], embed_source: WeightSource
    ) -> tuple[LinearWeight, WeightSource]:
        """The lm_head and the checkpoint tensor it is built from."""
        fmt = self.weight_format
        if "lm_head.weight" in tensors and not self.config.tie_word_embeddings:
            head_source = tensors.pop("lm_head.weight")
            return fmt.linear([head_source], None, head=True), head_source
        # Tied: a quantized head is built from the checkpoint's own embedding tensor (its
        # blocks, for a GGUF); the dense head is the embedding table itself.
        tensors.pop("lm_head.weight", None)
        return fmt.linear([embed_source], None, dense=self.embed, head=True), embed_source

    def expert_stats(self) -> dict:
        """A mixture of experts' load since the start, as ``EngineStats`` fields ({}: dense)."""
        if self.expert_load is None:
            return {}
        load = self.expert_load
        buckets, rows = load.totals()
        return {
            "expert_rows_buckets_total": list(buckets),
            "expert_rows_total": rows,
            "expert_reads_total": load.reads,
            "expert_bytes_total": load.bytes,
        }

    def use_scripted_decode(self, enabled: bool = True) -> bool:
        """Runs decode-only steps on a kept workspace through ``ScriptedDecode`` where it applies
        to these layers (scripted once, here); returns whether it does."""
        self.scripted_decode = ScriptedDecode.build(self) if enabled else None
        return self.scripted_decode is not None

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        weight_format: WeightFormat | None = None,
    ) -> LlamaFamilyModel:
        """A checkpoint directory: config.json plus either *.safetensors or one GGUF checkpoint
        (a file, or the parts of a split one)."""
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        with loading() as threads:
            tensors = load_tensors(model_dir, config)
            if not config.features.plain:
                logger.info("%s: %s", config.model_type, config.features.describe())
            try:
                model = cls(config, tensors, device, dtype, max_positions, weight_format, threads)
            except KeyError as exc:  # the config asks for more than the checkpoint holds
                raise ValueError(
                    f"{model_dir}: the checkpoint has no tensor {exc.args[0]!r}, which its config "
                    f"({config.model_type}, {config.num_layers} layers) needs"
                ) from None
        leftover = [n for n in tensors if "rotary_emb" not in n]
        if leftover:
            logger.warning("ignored %d unexpected weights, e.g. %s", len(leftover), leftover[:3])
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        logit_rows: torch.Tensor | None,
        decode_rows: int = 0,
        sampling_rows: int = 0,
        batches: tuple[int, int] | None = None,
        kept: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """input_ids/positions [T]; ``metadata`` from ``attention.prepare`` for this step; the
        first ``decode_rows`` rows are decoded tokens', the first ``sampling_rows`` logit rows
        sample a token (the others are prompt logprobs). ``batches``: the decoding and the
        sampling requests those rows belong to, when a request verifying drafts has several
        (the kernel choice is by requests: ``LinearWeight.apply``). ``kept`` [K, hidden]: final
        hidden states of rows computed in earlier steps (prompt ends: prefix_tails.py), sampled
        after this step's sampling rows, in the same head call. Returns the logits
        [len(logit_rows) + K, vocab] (float32) of the sampling rows, the kept ones, the others,
        and the final hidden states of those rows in that order."""
        num_tokens = input_ids.shape[0]
        # index_select: the same rows as indexing, without its general path (~4 µs a call)
        ropes = [
            (
                cos.index_select(0, positions).unsqueeze(1),
                sin.index_select(0, positions).unsqueeze(1),
            )
            for cos, sin in self.ropes
        ]
        decode_batch, sampling_batch = batches or (None, None)
        hidden = self.embed.index_select(0, input_ids)
        if self.embedding_scale != 1.0:
            hidden = hidden * self.embedding_scale
        scripted = self.scripted_decode
        if scripted is not None and scripted.applies(
            attention, metadata, num_tokens, decode_rows, batches
        ):
            hidden = scripted.run(hidden, ropes, metadata)
        else:
            hidden = self.eager_layers.run(
                hidden, ropes, attention, metadata, decode_rows, decode_batch
            )
        attention.finish(metadata)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        hidden = self.norm(hidden)
        if kept is not None:
            hidden = torch.cat([hidden[:sampling_rows], kept, hidden[sampling_rows:]])
            sampling_rows += kept.shape[0]
            sampling_batch = None if sampling_batch is None else sampling_batch + kept.shape[0]
        return ForwardOutput(self.head(hidden, sampling_rows, sampling_batch), hidden)

    def head(
        self, hidden: torch.Tensor, sampling_rows: int, sampling_batch: int | None = None
    ) -> torch.Tensor:
        """Logits (float32) of final hidden states; the first ``sampling_rows`` sample a token
        (of ``sampling_batch`` requests), which picks the head's copy as for decode rows."""
        logits = self.lm_head.apply(hidden, sampling_rows, sampling_batch).float()
        if self.exact_head is not None:
            refine_top_logits(logits, hidden, self.exact_head)
        features = self.config.features
        if features.logits_divisor != 1.0:  # Granite
            logits /= features.logits_divisor
        if features.final_softcap:  # Gemma 2
            cap = features.final_softcap
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits


@contextmanager
def loading() -> Iterator[int]:
    """Settings while the weights load (restored after): torch on one thread, and numpy's large
    arrays on plain pages. Loading is thousands of whole-tensor ops on fresh memory; measured on
    a shared 2-core machine (load 5-8), each torch op's two OpenMP threads waited on each other
    (1.1B Q4_K_M: 97 s with 2 threads, 33 s with 1), and numpy's huge-page advice on its large
    arrays made the kernel compact memory at each first touch (0.7 GB: 2-3.8 s, 0.4-0.6 s
    without). Yields the torch thread count it replaced: the threads loading may use."""
    threads = torch.get_num_threads()
    set_huge = getattr(np_multiarray, "_set_madvise_hugepage", None)
    huge = set_huge(False) if set_huge is not None else None
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)
        if set_huge is not None:
            set_huge(huge)


def _exact_head_rows(
    source: WeightSource, head: LinearWeight, device: torch.device
) -> WeightSource | None:
    if not isinstance(source, torch.Tensor) and device.type == "cpu":
        return source
    dense = getattr(head, "dense", head)
    return getattr(dense, "weight", None)


def load_tensors(model_dir: Path, config: ModelConfig) -> dict[str, WeightSource]:
    """Every weight of the checkpoint under its Hugging Face name, at the file's precision (a
    multimodal checkpoint's language model only: ``model_features.text_tensor_name``)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        tensors: dict[str, WeightSource] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    text_name = text_tensor_name(name)
                    if text_name is not None:
                        tensors[text_name] = f.get_tensor(name)
        if config.features.moe is not None:
            stack_expert_tensors(tensors)
        return tensors
    ggufs = gguf_weights(model_dir)  # one file, or the parts of a split one
    if ggufs:
        return read_gguf(ggufs, config.num_heads, config.num_kv_heads)
    raise FileNotFoundError(f"{model_dir} has no *.safetensors or *.gguf weights")
