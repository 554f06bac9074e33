"""The GPT model: shapes, the parameter count of the GPT-2 preset from the config formula, seeded init."""

import pytest
import torch

from zeropp.models import BYTE_VOCAB_SIZE, GPT, PRESETS, GPTConfig, decode_bytes, encode_bytes


def expected_params(c: GPTConfig) -> int:
    """GPT-2 parameter count from the config alone (output head tied to the token embedding)."""
    d, b = c.n_embd, int(c.bias)
    embeddings = c.vocab_size * d + c.block_size * d
    layer_norm = d + b * d
    attention = d * 3 * d + b * 3 * d + d * d + b * d
    mlp = d * 4 * d + b * 4 * d + 4 * d * d + b * d
    return embeddings + c.n_layer * (2 * layer_norm + attention + mlp) + layer_norm


def test_gpt2_preset_is_124m():
    config = GPTConfig.preset("gpt2")
    assert (config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_embd) == (
        50257, 1024, 12, 12, 768,
    )
    model = GPT(config, seed=0)
    assert expected_params(config) == 124_439_808  # the published GPT-2 small count, wpe included
    assert model.num_params() == expected_params(config)
    assert model.num_params(non_embedding=True) == 124_439_808 - 50257 * 768 - 1024 * 768
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in ("gpt2", "gpt2-bytes")])
def test_small_presets_count(name):
    config = GPTConfig.preset(name)
    assert GPT(config).num_params() == expected_params(config)


def test_no_bias_count_and_overrides():
    config = GPTConfig.preset("tiny", bias=False, n_layer=3, byte_vocab=True)
    assert config.vocab_size == BYTE_VOCAB_SIZE and config.n_layer == 3
    assert GPT(config).num_params() == expected_params(config)
    assert GPTConfig.preset("gpt2", byte_vocab=True).vocab_size == BYTE_VOCAB_SIZE


def test_forward_shapes_and_loss():
    config = GPTConfig.preset("tiny")
    model = GPT(config, seed=1)
    idx = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, config.vocab_size) and logits.dtype == torch.float32
    assert loss is None
    logits, loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)
    # At init the prediction is close to uniform: the loss is near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 1.0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_causal():
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_context_limit():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_seeded_init_is_deterministic():
    config = GPTConfig.preset("mini")
    torch.manual_seed(123)
    a = GPT(config, seed=7).state_dict()
    torch.manual_seed(456)  # the global RNG must not matter
    b = GPT(config, seed=7).state_dict()
    c = GPT(config, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_init_statistics():
    config = GPTConfig.preset("small")
    model = GPT(config, seed=0)
    block = model.blocks[0]
    assert abs(model.wte.weight.std().item() - 0.02) < 1e-3
    residual = 0.02 / (2 * config.n_layer) ** 0.5
    assert abs(block.attn.c_proj.weight.std().item() - residual) < 0.05 * residual
    assert torch.all(block.attn.c_attn.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)


def test_bad_configs():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)


def test_byte_codec_and_generate():
    ids = encode_bytes("héllo")
    assert ids.dtype == torch.long and ids.max() < BYTE_VOCAB_SIZE
    assert decode_bytes(ids) == "héllo"
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    out = model.generate(ids[None], 5, temperature=0)
    assert out.shape == (1, ids.numel() + 5)
    assert torch.equal(out, model.generate(ids[None], 5, temperature=0))
