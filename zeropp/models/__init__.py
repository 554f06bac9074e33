"""Models used by the demo, the engine tests and the end-to-end benchmark."""

from .gpt import BYTE_VOCAB_SIZE, GPT, PRESETS, GPTConfig, decode_bytes, encode_bytes

__all__ = ["BYTE_VOCAB_SIZE", "GPT", "GPTConfig", "PRESETS", "decode_bytes", "encode_bytes"]
