"""Prefill/decode disaggregation: kv_transfer_params (params.py), the NIXL transport (nixl_connector.py),
the engine's side of it (kv_transfer.py) and the proxy that routes each request prefill -> decode (proxy.py)."""
