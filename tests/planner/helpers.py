"""A toy device with round numbers so hand-computed costs are easy to check."""
from moeserve.perf.hardware import Efficiency, Hardware
from moeserve.perf.models import ModelSpec

TOY_EFF = Efficiency(gemm=0.5, attention=0.25, memory=0.5, link=0.5, link_latency_us=10.0,
                     step_overhead_ms=1.0, memory_utilization=0.9)
TOY_HW = Hardware(key="toy", name="toy", bf16_tflops=100, int8_tops=200, fp8_tflops=200, hbm_gib=80,
                  hbm_tbps=1.0, scale_up_gbps=100, scale_out_gbps=10, scale_up_domain=8, eff=TOY_EFF)
TOY_MODEL = ModelSpec(name="toy", hidden_size=64, num_hidden_layers=4, first_k_dense_replace=1,
                      intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                      n_shared_experts=1, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_attention_heads=4,
                      vocab_size=100)
