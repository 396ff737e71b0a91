#!/usr/bin/env python
"""Print the evidence figures of moeserve's bundled model (moeserve/models/bundled/tiny-deepseek-v3).

Everything is computed from the shipped folder alone, with transformers' DeepseekV3ForCausalLM as the main model
(BF16 weights, float32 compute) and the MTP layer (model.layers.{L}.*) run as a transformers
DeepseekV3DecoderLayer plus enorm/hnorm/eh_proj/shared_head.norm:
  - held-out loss / perplexity (next token) and MTP loss / top-1 accuracy (token i+2), over every held-out file
  - per-layer expert load on held-out text (max/mean, min/mean of routed-token counts), MTP layer included
  - MTP acceptance: greedy continuations of held-out prompts; at each generated position the MTP draft
    argmax(MTP(h_i, t_{i+1})) is compared with the token the main model produces at i+2 under greedy
  - sample completions (greedy) of held-out Python prompts
  - parity: moeserve.LLM greedy tokens == transformers generate() greedy tokens (float32; bfloat16 reported)

Usage: python scripts/eval_bundled.py [--model DIR] [--json OUT.json] [--windows N] [--skip-moeserve]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import DEFAULT_OUT, corpus_files, read_source  # noqa: E402  (same corpus rule as training)

SEQ = 512


def load_models(path: Path):
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    transformers.logging.set_verbosity_error()  # it lists the MTP layer as unexpected keys, by design
    tok = AutoTokenizer.from_pretrained(str(path))
    model = DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = model.config
    L = cfg.num_hidden_layers
    sd = load_file(str(path / "model.safetensors"))
    p = f"model.layers.{L}."
    mtp_sd = {k[len(p):]: v.float() for k, v in sd.items() if k.startswith(p)}

    class MTP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            D = cfg.hidden_size
            self.enorm = DeepseekV3RMSNorm(D, cfg.rms_norm_eps)
            self.hnorm = DeepseekV3RMSNorm(D, cfg.rms_norm_eps)
            self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
            self.block = DeepseekV3DecoderLayer(cfg, layer_idx=L)
            self.shared_head_norm = DeepseekV3RMSNorm(D, cfg.rms_norm_eps)

        def forward(self, h, next_ids, position_ids):
            """h [B, T, D] main final hidden states (lm_head input); next_ids [B, T] tokens t_{i+1}."""
            e = model.model.embed_tokens(next_ids)
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
            pe = model.model.rotary_emb(x, position_ids)
            x = self.block(x, attention_mask=None, position_ids=position_ids, position_embeddings=pe)
            return model.lm_head(self.shared_head_norm(x))

    mtp = MTP().eval()
    E = cfg.n_routed_experts
    exp = lambda n: torch.stack([mtp_sd.pop(f"mlp.experts.{e}.{n}.weight") for e in range(E)])
    gate_up = torch.cat([exp("gate_proj"), exp("up_proj")], dim=1)  # transformers' fused layout [E, 2I, D]
    down = exp("down_proj")
    block_sd = {k: v for k, v in mtp_sd.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    block_sd["mlp.experts.gate_up_proj"], block_sd["mlp.experts.down_proj"] = gate_up, down
    missing, unexpected = mtp.block.load_state_dict(block_sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    mtp.enorm.weight.data.copy_(mtp_sd["enorm.weight"])
    mtp.hnorm.weight.data.copy_(mtp_sd["hnorm.weight"])
    mtp.eh_proj.weight.data.copy_(mtp_sd["eh_proj.weight"])
    mtp.shared_head_norm.weight.data.copy_(mtp_sd["shared_head.norm.weight"])
    if "shared_head.head.weight" in mtp_sd:
        assert torch.equal(mtp_sd["shared_head.head.weight"], model.lm_head.weight.data)
    return tok, model, mtp


class LoadRecorder:
    """Forward hooks on every DeepseekV3TopkRouter: routed-token counts per expert, per layer."""

    def __init__(self, model, mtp):
        self.counts: dict[str, torch.Tensor] = {}
        self.enabled = True
        routers = [(f"layer {i}", l.mlp.gate) for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "gate")]
        routers.append((f"layer {model.config.num_hidden_layers} (MTP)", mtp.block.mlp.gate))
        for name, r in routers:
            r.register_forward_hook(self._hook(name, r.num_experts))

    def _hook(self, name, E):
        def fn(mod, inp, out):
            if self.enabled:
                idx = out[2]  # [tokens, top_k]
                self.counts[name] = self.counts.get(name, torch.zeros(E, dtype=torch.long)) + torch.bincount(
                    idx.reshape(-1), minlength=E)
        return fn

    def summary(self):
        res = {}
        for name, c in self.counts.items():
            c = c.float()
            res[name] = {"max_over_mean": round((c.max() / c.mean()).item(), 3),
                         "min_over_mean": round((c.min() / c.mean()).item(), 3),
                         "cv": round((c.std() / c.mean()).item(), 3),
                         "share_percent": [round(v, 2) for v in (100 * c / c.sum()).tolist()]}
        return res


def heldout_stream(tok, held: list[str], root: Path) -> torch.Tensor:
    ids = []
    for r in held:
        ids.extend(tok(read_source(root / r))["input_ids"])  # BOS + tokens
        ids.append(tok.eos_token_id)
    return torch.tensor(ids)


@torch.no_grad()
def heldout_metrics(model, mtp, stream: torch.Tensor, max_windows: int, batch: int = 4):
    n = min(max_windows, (stream.numel() - 1) // (SEQ + 1))
    tot = {"main_nll": 0.0, "mtp_nll": 0.0, "main_correct": 0, "mtp_correct": 0, "mtp_n": 0, "main_n": 0,
           "cond_n": 0, "cond_accept": 0}
    for w in range(0, n, batch):
        ids = torch.stack([stream[i * (SEQ + 1):(i + 1) * (SEQ + 1)] for i in range(w, min(n, w + batch))])
        inp = ids[:, :-1]
        out = model.model(inp)
        h = out.last_hidden_state
        logits = model.lm_head(h)
        V = logits.shape[-1]
        tot["main_nll"] += F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum").item()
        main_pred = logits.argmax(-1)  # [B, T]
        tot["main_correct"] += (main_pred == ids[:, 1:]).sum().item()
        tot["main_n"] += ids[:, 1:].numel()
        pos = torch.arange(SEQ - 1)[None].expand(inp.shape[0], -1)
        ml = mtp(h[:, :-1], inp[:, 1:], pos)  # position i predicts ids[i+2]
        tot["mtp_nll"] += F.cross_entropy(ml.reshape(-1, V), ids[:, 2:].reshape(-1), reduction="sum").item()
        mtp_pred = ml.argmax(-1)  # [B, T-1]
        tot["mtp_correct"] += (mtp_pred == ids[:, 2:]).sum().item()
        tot["mtp_n"] += ids[:, 2:].numel()
        # where the main model's greedy t_{i+1} equals the text, its greedy t_{i+2} is main_pred[i+1]
        ok = main_pred[:, :-1] == ids[:, 1:-1]
        tot["cond_n"] += ok.sum().item()
        tot["cond_accept"] += ((mtp_pred == main_pred[:, 1:]) & ok).sum().item()
    return {
        "windows": n, "tokens": tot["main_n"],
        "loss": tot["main_nll"] / tot["main_n"], "ppl": math.exp(tot["main_nll"] / tot["main_n"]),
        "top1": tot["main_correct"] / tot["main_n"],
        "mtp_loss": tot["mtp_nll"] / tot["mtp_n"], "mtp_top1_vs_text": tot["mtp_correct"] / tot["mtp_n"],
        "mtp_accept_where_main_greedy_matches_text": tot["cond_accept"] / max(1, tot["cond_n"]),
    }


def prompts_from(held: list[str], root: Path, k: int) -> list[tuple[str, str]]:
    """Deterministic prompts: from k evenly spaced held-out files, the 4 lines up to and including the
    first `def` line after a module's first 20 lines."""
    out = []
    step = max(1, len(held) // k)
    for r in held[::step]:
        lines = read_source(root / r).splitlines()
        for j in range(20, len(lines) - 1):
            if re.match(r"^\s*def \w+\(.*\):\s*$", lines[j]):
                # no trailing newline: the BPE merges "\n" with the next line's indentation, so a prompt
                # ending in a bare "\n" token would tell the model that column 0 follows
                out.append((r, "\n".join(lines[max(0, j - 3):j + 1])))
                break
        if len(out) == k:
            break
    return out


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    # explicit all-ones mask: generate() infers padding from pad_token_id, and BOS (id 0) must not be masked
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def mtp_acceptance(model, mtp, prompts_ids: list[list[int]], n: int):
    """Greedy-decode each prompt; at every generated position compare the MTP draft with the next greedy token."""
    acc = tot = 0
    for ids in prompts_ids:
        gen = hf_greedy(model, ids, n)
        s = torch.tensor([ids + gen])
        h = model.model(s).last_hidden_state
        T = s.shape[1]
        pos = torch.arange(T - 1)[None]
        draft = mtp(h[:, :-1], s[:, 1:], pos).argmax(-1)[0]  # draft[i] guesses s[i+2]
        p = len(ids)
        for i in range(p - 1, T - 2):  # s[i+1] and s[i+2] are both greedy tokens of the main model
            tot += 1
            acc += int(draft[i].item() == s[0, i + 2].item())
    return acc / max(1, tot), tot


def moeserve_parity(path: Path, prompts_ids: list[list[int]], n: int, hf_tokens: list[list[int]], dtype: str,
                    model_bf16=None):
    from moeserve import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype)
    outs = llm.generate(prompt_token_ids=prompts_ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    ours = [o.outputs[0].token_ids for o in outs]
    if model_bf16 is not None:
        hf_tokens = [hf_greedy(model_bf16, p, n) for p in prompts_ids]
    same_seq = sum(a == b for a, b in zip(ours, hf_tokens))
    first_div = []
    for a, b in zip(ours, hf_tokens):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first_div.append(d)
    return {"dtype": dtype, "identical_sequences": f"{same_seq}/{len(ours)}", "first_divergence": first_div}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--windows", type=int, default=10**9, help="cap on 512-token held-out windows (default: all)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-moeserve", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    res: dict = {"model": str(args.model)}
    sz = (args.model / "model.safetensors").stat().st_size
    tok, model, mtp = load_models(args.model)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    res["size"] = {"model_safetensors_MB": round(sz / 1e6, 2), "params_main_M": round(n_main / 1e6, 3),
                   "params_mtp_layer_M": round(n_mtp / 1e6, 3),
                   "activated_params_note": "see README"}
    print(f"== size: {json.dumps(res['size'])}")

    root, train_rel, held = corpus_files()
    stream = heldout_stream(tok, held, root)
    rec = LoadRecorder(model, mtp)
    m = heldout_metrics(model, mtp, stream, args.windows)
    res["heldout"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
    res["heldout"]["files"] = len(held)
    print(f"== held-out ({len(held)} files, {m['tokens']} predicted tokens): loss {m['loss']:.4f}  ppl {m['ppl']:.3f}  "
          f"top-1 {m['top1']:.4f}\n   MTP loss {m['mtp_loss']:.4f}  MTP top-1 vs text {m['mtp_top1_vs_text']:.4f}  "
          f"MTP acceptance where main greedy == text {m['mtp_accept_where_main_greedy_matches_text']:.4f}")
    res["expert_load_heldout"] = rec.summary()
    print("== expert load on held-out text (routed-token counts per expert):")
    for name, s in res["expert_load_heldout"].items():
        print(f"   {name}: max/mean {s['max_over_mean']}  min/mean {s['min_over_mean']}  cv {s['cv']}")
    rec.enabled = False

    prompts = prompts_from(held, root, args.samples)
    prompts_ids = [tok(p)["input_ids"] for _, p in prompts]
    acc, n = mtp_acceptance(model, mtp, prompts_ids, args.new_tokens)
    res["mtp_acceptance_greedy"] = {"rate": round(acc, 4), "positions": n, "prompts": len(prompts_ids),
                                    "new_tokens_per_prompt": args.new_tokens}
    print(f"== MTP acceptance on greedy continuations of {len(prompts_ids)} held-out prompts: {acc:.4f} "
          f"({n} positions)")

    print("== sample completions (greedy, transformers generate):")
    res["samples"] = []
    hf_tokens = []
    for (r, p), ids in zip(prompts, prompts_ids):
        gen = hf_greedy(model, ids, args.new_tokens)
        hf_tokens.append(gen)
        text = tok.decode(gen)
        res["samples"].append({"file": r, "prompt": p, "completion": text})
        print(f"--- {r}\n{p}\u2588{text}\n")

    if not args.skip_moeserve:
        try:
            res["parity_moeserve_vs_transformers"] = [
                moeserve_parity(args.model, prompts_ids, args.new_tokens, hf_tokens, "float32")]
            mb = type(model).from_pretrained(str(args.model), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
            res["parity_moeserve_vs_transformers"].append(
                moeserve_parity(args.model, prompts_ids, args.new_tokens, hf_tokens, "bfloat16", mb))
        except ImportError as e:
            res["parity_moeserve_vs_transformers"] = f"moeserve not importable: {e}"
        print(f"== parity (greedy, {args.new_tokens} tokens x {len(prompts_ids)} prompts): "
              f"{json.dumps(res['parity_moeserve_vs_transformers'])}")
    res["eval_seconds"] = round(time.time() - t0)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"== done in {res['eval_seconds']}s")


if __name__ == "__main__":
    main()
