"""``ModelSpec``: what the planner needs to know about a model: its units (the engine's flat parameter groups, each a
list of parameter element counts in the engine's order), its shape (layers, hidden size, vocabulary) and its
FLOPs per token.

Three ways in: a preset (``from_preset``: a ``zeropp.models`` GPT, whose units are exactly the engine's, checked
against ``zeropp.engine.policy.plan_units`` in the tests, or a Llama-2 shape of ``LLAMA_PRESETS``), a Hugging Face
``config.json`` (``from_hf_config``: GPT-2 style or Llama style, gated MLP and grouped-query attention included) or
bare sizes (``from_sizes``: a parameter count, layers and hidden size; the blocks are GPT blocks of ``12 h^2 + 13 h``
parameters and the root unit holds the rest).

Units follow the engine's default policy (``zeropp.engine.policy``): one unit per transformer block and a root unit
(``""``) with every other parameter (embeddings, final norm, an untied head), first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class UnitSpec:
    """One engine unit: its name (``""`` for the root) and its trainable parameters' element counts, in order."""

    name: str
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it.

    Args:
        name: a label for reports.
        units: the engine's units, root first.
        layers: transformer blocks.
        hidden: hidden size ``h``.
        seq: the longest context (a default for the batch's sequence length).
        vocab: vocabulary size.
        ffn: MLP inner size.
        gated: gated MLP (three matrices, Llama) instead of two (GPT-2).
    """

    name: str
    units: tuple[UnitSpec, ...]
    layers: int
    hidden: int
    seq: int
    vocab: int
    ffn: int
    gated: bool = False

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "seq", "vocab", "ffn"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {field}={value!r} must be a positive integer")
        if not self.units or any(n < 0 for u in self.units for n in u.numels):
            raise ValueError(f"model {self.name!r} needs units with non-negative parameter counts")

    def groups(self) -> list[tuple[UnitSpec, int]]:
        """The distinct units with how many times each occurs, in order of first occurrence (the root first): a
        model's identical blocks are planned once."""
        counts: dict[tuple[str, tuple[int, ...]], int] = {}
        first: dict[tuple[str, tuple[int, ...]], UnitSpec] = {}
        for u in self.units:
            key = ("root" if u.name == "" else "block", u.numels)
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, u)
        return [(first[k], counts[k]) for k in first]

    @property
    def params(self) -> int:
        """Trainable parameters."""
        return sum(u.numel for u in self.units)

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward and backward, no recomputation): ``6 N`` for the matrix products of
        the ``N`` parameters plus the attention scores and values, ``12 L h seq`` (Kaplan et al. / Megatron)."""
        return 6.0 * self.params + 12.0 * self.layers * self.hidden * seq

    def activation_bytes(self, micro: int, seq: int, dtype_bytes: int) -> int:
        """Activations kept for backward per rank, in bytes: ``17 dtype_bytes micro seq h`` per layer (Korthikanti
        et al. 2022, 34 s b h bytes per layer in 16 bits, without the attention-score terms: fused attention keeps
        no scores) plus the logits in float32."""
        per_layer = 17 * dtype_bytes * micro * seq * self.hidden
        return self.layers * per_layer + 4 * micro * seq * self.vocab


def _gpt_block(h: int, ffn: int, bias: bool) -> tuple[int, ...]:
    """A GPT-2 block's parameters in ``zeropp.models.gpt.Block``'s order."""
    b = bias
    return tuple(n for n, keep in (
        (h, True), (h, b),                                  # ln_1
        (3 * h * h, True), (3 * h, b), (h * h, True), (h, b),  # attn.c_attn, attn.c_proj
        (h, True), (h, b),                                  # ln_2
        (ffn * h, True), (ffn, b), (ffn * h, True), (h, b),  # mlp.c_fc, mlp.c_proj
    ) if keep)


def from_preset(name: str, seq: int | None = None) -> ModelSpec:
    """A ``zeropp.models`` GPT preset (``GPTConfig.PRESETS``: "tiny", "gpt2", ...) or a Llama shape
    (``LLAMA_PRESETS``: "llama-7b", "llama-13b", "llama-70b"; the planner's alone, ``zeropp.models`` has no Llama);
    a GPT preset's ``name`` may end in ``":nobias"`` for the preset without biases (the engine tests' tiny model),
    and may start with ``"preset:"`` as ``python -m zeropp.bench.convergence --model`` spells it."""
    from ..models.gpt import PRESETS, GPTConfig

    base, _, flag = name.removeprefix("preset:").partition(":")
    if base in LLAMA_PRESETS and not flag:
        return from_hf_dict(LLAMA_PRESETS[base], base, seq)
    if base not in PRESETS or flag not in ("", "nobias"):
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} (optionally with "
                         f"':nobias') or {sorted(LLAMA_PRESETS)}, or pass a Hugging Face config.json or "
                         f"--params/--layers/--hidden")
    c = GPTConfig.preset(base, bias=False) if flag else GPTConfig.preset(base)
    h = c.n_embd
    root = (c.vocab_size * h, c.block_size * h, h) + ((h,) if c.bias else ())  # wte (tied head), wpe, ln_f
    block = _gpt_block(h, 4 * h, c.bias)
    units = (UnitSpec("", root),) + tuple(UnitSpec(f"blocks.{i}", block) for i in range(c.n_layer))
    return ModelSpec(name, units, c.n_layer, h, seq or c.block_size, c.vocab_size, 4 * h)


def _first(config: dict, keys: tuple[str, ...], path: str, default: int | None = None) -> int:
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}: {key}={value!r} must be a positive integer")
            return value
    if default is None:
        raise ValueError(f"{path} has none of {list(keys)}: not a decoder config this planner reads (GPT-2 or "
                         f"Llama style); pass --params/--layers/--hidden instead")
    return default


GATED_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2")
"""Hugging Face ``model_type`` values with a gated MLP (gate, up and down matrices) and no biases."""


def from_hf_config(path: str | Path, seq: int | None = None) -> ModelSpec:
    """A decoder from a Hugging Face ``config.json`` (``from_hf_dict`` on its contents, named by its folder)."""
    path = str(path)
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config {path!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return from_hf_dict(config, Path(path).parent.name or Path(path).name, seq, path)


def from_hf_dict(config: dict, name: str, seq: int | None = None, source: str | None = None) -> ModelSpec:
    """A decoder from a Hugging Face config's keys: GPT-2 style (``n_embd``, ``n_layer``: LayerNorm with biases,
    fused QKV, a 4x GELU MLP, tied head) or Llama style (``hidden_size``, ``num_hidden_layers``,
    ``intermediate_size``, ``num_key_value_heads``: RMSNorm, no biases, gated MLP, head tied only if
    ``tie_word_embeddings``). ``source`` names the config in errors (default ``name``)."""
    path = source or name
    h = _first(config, ("hidden_size", "n_embd", "d_model"), path)
    layers = _first(config, ("num_hidden_layers", "n_layer", "num_layers"), path)
    vocab = _first(config, ("vocab_size",), path)
    heads = _first(config, ("num_attention_heads", "n_head"), path)
    positions = _first(config, ("max_position_embeddings", "n_positions", "n_ctx"), path, 2048)
    model_type = str(config.get("model_type", ""))
    gated = model_type in GATED_TYPES
    ffn = _first(config, ("intermediate_size", "n_inner"), path, 4 * h)
    if h % heads:
        raise ValueError(f"{path}: hidden size {h} is not a multiple of num_attention_heads={heads}")
    if gated:
        kv = _first(config, ("num_key_value_heads",), path, heads) * (h // heads)
        block = (h, h * h, kv * h, kv * h, h * h, h, ffn * h, ffn * h, ffn * h)  # norm, q k v o, norm, gate up down
        tied = bool(config.get("tie_word_embeddings", False))
        root = (vocab * h, h) + (() if tied else (vocab * h,))
    else:
        block = _gpt_block(h, ffn, True)
        root = (vocab * h, positions * h, h, h)
    units = (UnitSpec("", root),) + tuple(UnitSpec(f"layers.{i}", block) for i in range(layers))
    return ModelSpec(name, units, layers, h, seq or positions, vocab, ffn, gated)


def _llama(h: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict:
    return {"model_type": "llama", "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": ffn, "vocab_size": 32000,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


LLAMA_PRESETS = {
    "llama-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-13b": _llama(5120, 40, 40, 40, 13824),
    "llama-70b": _llama(8192, 80, 64, 8, 28672),
}
"""Llama-2's published shapes (Hugging Face ``config.json`` keys): 6.74B, 13.0B and 69.0B parameters, vocabulary
32000, context 4096, untied head; 70B with grouped-query attention (8 key-value heads)."""


def from_sizes(params: int, layers: int, hidden: int, seq: int, vocab: int = 50257) -> ModelSpec:
    """A GPT of about ``params`` parameters: ``layers`` GPT-2 blocks of hidden size ``hidden`` and a root unit of
    the remaining parameters (embeddings, head)."""
    for name, value in (("params", params), ("layers", layers), ("hidden", hidden), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name}={value!r} must be a positive integer")
    block = _gpt_block(hidden, 4 * hidden, True)
    root = params - layers * sum(block)
    if root < hidden:
        raise ValueError(f"--params={params} is less than {layers} GPT blocks of hidden size {hidden} hold "
                         f"({layers * sum(block)}); raise --params or lower --layers/--hidden")
    return ModelSpec(f"{params / 1e9:.3g}B", (UnitSpec("", (root,)),) +
                     tuple(UnitSpec(f"blocks.{i}", block) for i in range(layers)), layers, hidden, seq, vocab,
                     4 * hidden)
