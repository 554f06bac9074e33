"""A small GPT in the style of nanoGPT, written to be read in one sitting.

Used by the demo, the engine tests and the end-to-end benchmark: the model is a plain ``nn.Module`` with
nothing zeropp-specific in it.

    from zeropp.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2"), seed=0)        # GPT-2 small, 124,439,808 parameters
    tiny = GPT(GPTConfig.preset("tiny"), seed=0)         # byte-level, for tests
    logits, loss = tiny(idx, targets)

Architecture (GPT-2): token + position embeddings, ``n_layer`` pre-LayerNorm blocks of causal self-attention and
a 4x GELU MLP, a final LayerNorm, and an output head tied to the token embedding. Initialisation follows GPT-2:
N(0, 0.02) for weights, N(0, 0.02 / sqrt(2 * n_layer)) for the projections that write into the residual stream,
zero biases, LayerNorm at (1, 0). It draws from a private ``torch.Generator`` seeded with ``seed``, so the same
config and seed give the same weights bit for bit, whatever the global RNG state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB_SIZE = 256
"""Vocabulary of the byte-level presets: one token per byte value (see ``encode_bytes``)."""

GPT2_VOCAB_SIZE = 50257


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``block_size`` is the longest context, ``n_embd`` must be a multiple of ``n_head``."""

    vocab_size: int = GPT2_VOCAB_SIZE
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named config from ``PRESETS``, with any field overridden, e.g. ``preset("gpt2", block_size=256)``.

        ``byte_vocab=True`` swaps the vocabulary for the 256 byte values.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        if overrides.pop("byte_vocab", False):
            overrides["vocab_size"] = BYTE_VOCAB_SIZE
        return replace(PRESETS[name], **overrides)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GPTConfig] = {
    # GPT-2 small (124M): the model of the paper's smallest runs and of the end-to-end benchmark.
    "gpt2": GPTConfig(),
    # Same body, bytes as tokens: 86.0M parameters, no tokenizer needed.
    "gpt2-bytes": GPTConfig(vocab_size=BYTE_VOCAB_SIZE),
    # Byte-level models for tests and quick runs on a CPU.
    "small": GPTConfig(vocab_size=BYTE_VOCAB_SIZE, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "mini": GPTConfig(vocab_size=BYTE_VOCAB_SIZE, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "tiny": GPTConfig(vocab_size=BYTE_VOCAB_SIZE, block_size=64, n_layer=2, n_head=2, n_embd=64),
}


def encode_bytes(text: str) -> torch.Tensor:
    """Token ids of ``text`` for the byte-level vocabulary: its UTF-8 bytes, as an int64 tensor."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_bytes(ids: torch.Tensor) -> str:
    """Inverse of ``encode_bytes`` (invalid UTF-8 is replaced, so any ids in 0..255 decode)."""
    return bytes(int(i) for i in ids.reshape(-1).tolist()).decode("utf-8", errors="replace")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder. ``forward(idx, targets=None) -> (logits, loss)``; ``loss`` is None without targets."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted and communicated once
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 initialisation from a private generator: the same seed gives the same weights. A model built on the
        meta device (``zeropp.Init``) has nothing to initialise: ``zeropp.initialize`` materialises it unit by unit
        with each module's own ``reset_parameters`` (or a ``param_init_fn``)."""
        if self.wte.weight.is_meta:
            return
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else 0.02
                if module is not self.lm_head:  # tied to wte, initialised there
                    module.weight.normal_(0.0, std, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=gen)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, the tied embedding counted once; ``non_embedding`` leaves out both embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: int64 token ids of shape (B, T), T <= block_size. Returns logits (B, T, vocab_size) and the
        mean cross-entropy against ``targets`` (B, T) when given (target -1 is ignored)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the context block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by sampling ``max_new_tokens`` tokens; ``temperature=0`` takes the argmax."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[0][:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
