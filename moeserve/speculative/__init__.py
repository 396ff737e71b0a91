"""Speculative decoding with DeepSeek's multi-token-prediction (MTP) layer as the draft (docs/speculative.md)."""
