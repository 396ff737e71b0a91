#!/usr/bin/env python
"""Train moeserve's bundled default model: a tiny DeepSeek-V3-architecture MoE (with one MTP layer).

Lifecycle (each stage is resumable; state lives in --work, the shipped folder in --out):
  1. corpus     the running interpreter's standard-library *.py files (sysconfig stdlib path), excluding
                site-packages/dist-packages and test directories, split train/held-out by file with a
                deterministic rule (crc32 of the relative path).
  2. tokenizer  a byte-level BPE (`tokenizers`) trained on the train files only; saved so that
                transformers' AutoTokenizer loads it (bos/eos set, bos prepended on encode).
  3. train      a compact PyTorch re-implementation of transformers' DeepseekV3ForCausalLM (same math:
                MLA with rope_interleave, dense first layer, MoE with one shared expert and the sigmoid
                noaux_tc group router) plus one DeepSeek-V3 MTP layer, trained with next-token loss +
                0.3 * MTP loss. e_score_correction_bias is updated after every step from the expert load
                (auxiliary-loss-free balancing: bias += gamma * sign(mean_load - load)); it gets no gradient.
                Checkpoints every --ckpt-every steps; --resume continues from the last one.
  4. export     BF16 safetensors under the standard DeepSeek-V3 checkpoint names (per-expert weights, MTP
                layer at index num_hidden_layers), config.json, generation_config.json, tokenizer files;
                then checks that transformers' DeepseekV3ForCausalLM loads the folder and reproduces the
                training model's logits.

Usage:
  python scripts/train_tiny.py --steps 1020                      # everything, fixed seed 0
  python scripts/train_tiny.py --steps 1020 --resume             # continue after an interruption
  python scripts/train_tiny.py --steps 1020 --export-only        # export the latest checkpoint
  python scripts/train_tiny.py --steps 20 --bench                # measure tokens/s, write nothing shipped
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "moeserve" / "models" / "bundled" / "tiny-deepseek-v3"
DEFAULT_WORK = Path(os.environ.get("MOESERVE_TRAIN_WORK", Path.home() / ".cache" / "moeserve" / "train_tiny"))

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
HELDOUT_MOD = 10  # a file is held out when crc32(relative posix path) % 10 == 0

# The HF config (DeepseekV3Config fields). Sized for <= 30 MB BF16 and ~1.5 h on one CPU thread.
MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,  # dense layer 0
    moe_intermediate_size=128,
    num_hidden_layers=4,  # layer 0 dense, layers 1..3 MoE; the MTP layer is layers.4
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    num_nextn_predict_layers=1,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_interleave=True,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


# ----------------------------------------------------------------------------------------------- corpus
def corpus_files() -> tuple[Path, list[str], list[str]]:
    """Return (stdlib root, train relpaths, held-out relpaths), both sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            rel = (Path(dirpath) / f).relative_to(root).as_posix()
            (held if zlib.crc32(rel.encode()) % HELDOUT_MOD == 0 else train).append(rel)
    return root, sorted(train), sorted(held)


def read_source(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


# -------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(root: Path, train: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_source(root / r) for r in train), trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}# {{ m['content'] }}\n"
            "{% elif m['role'] == 'user' %}{{ m['content'] }}{% else %}{{ m['content'] }}{{ eos_token }}"
            "{% endif %}{% endfor %}"
        ),
    }, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    return tok


def tokenize_files(tok, root: Path, rels: list[str]) -> torch.Tensor:
    """One stream: for each file, BOS + tokens + EOS (the post-processor adds BOS)."""
    encs = tok.encode_batch([read_source(root / r) for r in rels])
    ids = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.int16 if MODEL_CONFIG["vocab_size"] < 32768 else torch.int32)


sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import MLP, Block, TinyDeepseekV3  # noqa: E402

# ----------------------------------------------------------------------------------------- HF export
def hf_config(c: dict) -> dict:
    cfg = {k: v for k, v in c.items() if k not in ("rope_theta",)}
    cfg.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        rope_scaling=None,
        rope_theta=c["rope_theta"],
        ep_size=1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        use_cache=True,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    return cfg


def hf_state_dict(model: TinyDeepseekV3) -> dict[str, torch.Tensor]:
    """Standard DeepSeek-V3 checkpoint names; per-expert weights; MTP layer at index L."""
    c, sd = model.c, {}
    I = c["moe_intermediate_size"]
    bf = lambda t: t.detach().to(torch.bfloat16).contiguous()

    def block(prefix: str, b: Block):
        sd[f"{prefix}.input_layernorm.weight"] = bf(b.input_layernorm.weight)
        sd[f"{prefix}.post_attention_layernorm.weight"] = bf(b.post_attention_layernorm.weight)
        a = b.self_attn
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            sd[f"{prefix}.self_attn.{n}.weight"] = bf(getattr(a, n).weight)
        sd[f"{prefix}.self_attn.q_a_layernorm.weight"] = bf(a.q_a_layernorm.weight)
        sd[f"{prefix}.self_attn.kv_a_layernorm.weight"] = bf(a.kv_a_layernorm.weight)
        m = b.mlp
        if isinstance(m, MLP):
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[f"{prefix}.mlp.{n}.weight"] = bf(getattr(m, n).weight)
            return
        sd[f"{prefix}.mlp.gate.weight"] = bf(m.gate_weight)
        sd[f"{prefix}.mlp.gate.e_score_correction_bias"] = m.e_score_correction_bias.detach().float().contiguous()
        for e in range(m.E):
            sd[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = bf(m.w_gate_up[e, :I])
            sd[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = bf(m.w_gate_up[e, I:])
            sd[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = bf(m.w_down[e])
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[f"{prefix}.mlp.shared_experts.{n}.weight"] = bf(getattr(m.shared_experts, n).weight)

    sd["model.embed_tokens.weight"] = bf(model.embed_tokens.weight)
    for i, b in enumerate(model.layers):
        block(f"model.layers.{i}", b)
    sd["model.norm.weight"] = bf(model.norm.weight)
    sd["lm_head.weight"] = bf(model.lm_head.weight)
    L = c["num_hidden_layers"]
    p = f"model.layers.{L}"
    sd[f"{p}.enorm.weight"] = bf(model.mtp.enorm.weight)
    sd[f"{p}.hnorm.weight"] = bf(model.mtp.hnorm.weight)
    sd[f"{p}.eh_proj.weight"] = bf(model.mtp.eh_proj.weight)
    block(p, model.mtp.block)
    sd[f"{p}.shared_head.norm.weight"] = bf(model.mtp.shared_head_norm.weight)
    # The released DeepSeek-V3 checkpoint repeats the shared embedding and head inside the MTP layer.
    sd[f"{p}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"{p}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    return sd


def load_hf_state_dict(model: TinyDeepseekV3, sd: dict[str, torch.Tensor]):
    """Inverse of hf_state_dict (used to evaluate exactly the exported BF16 weights)."""
    c = model.c
    I, L = c["moe_intermediate_size"], c["num_hidden_layers"]
    with torch.no_grad():
        def cp(dst, name):
            dst.copy_(sd[name].to(dst.dtype))

        def block(prefix, b):
            cp(b.input_layernorm.weight, f"{prefix}.input_layernorm.weight")
            cp(b.post_attention_layernorm.weight, f"{prefix}.post_attention_layernorm.weight")
            a = b.self_attn
            for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
                cp(getattr(a, n).weight, f"{prefix}.self_attn.{n}.weight")
            cp(a.q_a_layernorm.weight, f"{prefix}.self_attn.q_a_layernorm.weight")
            cp(a.kv_a_layernorm.weight, f"{prefix}.self_attn.kv_a_layernorm.weight")
            m = b.mlp
            if isinstance(m, MLP):
                for n in ("gate_proj", "up_proj", "down_proj"):
                    cp(getattr(m, n).weight, f"{prefix}.mlp.{n}.weight")
                return
            cp(m.gate_weight, f"{prefix}.mlp.gate.weight")
            cp(m.e_score_correction_bias, f"{prefix}.mlp.gate.e_score_correction_bias")
            for e in range(m.E):
                cp(m.w_gate_up[e, :I], f"{prefix}.mlp.experts.{e}.gate_proj.weight")
                cp(m.w_gate_up[e, I:], f"{prefix}.mlp.experts.{e}.up_proj.weight")
                cp(m.w_down[e], f"{prefix}.mlp.experts.{e}.down_proj.weight")
            for n in ("gate_proj", "up_proj", "down_proj"):
                cp(getattr(m.shared_experts, n).weight, f"{prefix}.mlp.shared_experts.{n}.weight")

        cp(model.embed_tokens.weight, "model.embed_tokens.weight")
        for i, b in enumerate(model.layers):
            block(f"model.layers.{i}", b)
        cp(model.norm.weight, "model.norm.weight")
        cp(model.lm_head.weight, "lm_head.weight")
        p = f"model.layers.{L}"
        cp(model.mtp.enorm.weight, f"{p}.enorm.weight")
        cp(model.mtp.hnorm.weight, f"{p}.hnorm.weight")
        cp(model.mtp.eh_proj.weight, f"{p}.eh_proj.weight")
        block(p, model.mtp.block)
        cp(model.mtp.shared_head_norm.weight, f"{p}.shared_head.norm.weight")


def export(model: TinyDeepseekV3, out: Path, train_info: dict):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(hf_config(model.c), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": 1, "do_sample": False, "max_new_tokens": 64,
    }, indent=2) + "\n")
    (out / "training_info.json").write_text(json.dumps(train_info, indent=2) + "\n")
    n_params = sum(t.numel() for k, t in sd.items() if not k.endswith(("shared_head.head.weight",))
                   and not (k.startswith(f"model.layers.{model.c['num_hidden_layers']}.embed_tokens")))
    print(f"exported {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB, {n_params / 1e6:.2f}M params)")
    return sd


def check_hf_parity(model: TinyDeepseekV3, out: Path, ids: torch.Tensor):
    """transformers' DeepseekV3ForCausalLM must load the folder and reproduce our logits (fp32 compute)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    load_hf_state_dict(model, load_file(str(out / "model.safetensors")))
    hf = DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf.eval()
    model.eval()
    with torch.no_grad():
        ours, _ = model(ids, with_mtp=False)
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    same = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"HF parity: max |logit diff| = {diff:.2e}, argmax agreement = {same:.4f}")
    assert diff < 1e-3, diff
    return diff


# ------------------------------------------------------------------------------------------- training
def lr_at(step: int, steps: int, peak: float, warmup: int, decay_frac: float) -> float:
    """Warmup-stable-decay: linear warmup, constant peak, then linear decay to 2% of peak over the last
    decay_frac of the steps. Until the decay starts the schedule does not depend on --steps, so a run can be
    resumed with a different --steps (to fit a deadline) and still be the same as one run with that value."""
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = int(steps * (1 - decay_frac))
    if step < decay_start:
        return peak
    p = (step - decay_start) / max(1, steps - decay_start)
    return peak * (1.0 - 0.98 * min(1.0, p))


def batch(stream: torch.Tensor, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - T - 1, (B,), generator=gen)
    return torch.stack([stream[s:s + T + 1] for s in starts.tolist()]).long()


def losses(model, ids, mtp_weight: float):
    inp = ids[:, :-1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, mlog = model(inp)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, V), ids[:, 1:].reshape(-1))
    mtp = F.cross_entropy(mlog.float().reshape(-1, V), ids[:, 2:].reshape(-1))
    return main, mtp, main + mtp_weight * mtp


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, T: int, max_windows: int = 64):
    """Mean loss over non-overlapping windows (fixed, deterministic)."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // (T + 1))
    tot_main = tot_mtp = 0.0
    for w in range(0, n, 8):
        ids = torch.stack([stream[i * (T + 1):(i + 1) * (T + 1)] for i in range(w, min(n, w + 8))]).long()
        m, t, _ = losses(model, ids, 0.0)
        tot_main += m.item() * ids.shape[0]
        tot_mtp += t.item() * ids.shape[0]
    model.train()
    return tot_main / n, tot_mtp / n


JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def reexec_with_fast_allocator():
    """glibc malloc returns the big per-step buffers (logits, their grads) to the OS and page-faults them back
    every step; that costs ~40% of the step time here. Re-exec once under jemalloc (apt: libjemalloc2) with
    decay disabled, or else with glibc's mmap/trim thresholds raised. Speed only: results are identical."""
    if os.environ.get("MOESERVE_TRAIN_REEXEC") == "1":
        return
    env = dict(os.environ, MOESERVE_TRAIN_REEXEC="1")
    if os.path.exists(JEMALLOC):
        env["LD_PRELOAD"] = (env.get("LD_PRELOAD", "") + " " + JEMALLOC).strip()
        env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    else:
        env.update(MALLOC_MMAP_THRESHOLD_="4294967296", MALLOC_TRIM_THRESHOLD_="4294967296")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main():
    reexec_with_fast_allocator()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--steps", type=int, default=1020)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--decay-frac", type=float, default=0.25)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free bias update speed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--bench", action="store_true", help="time a few steps and exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    c = dict(MODEL_CONFIG)
    args.work.mkdir(parents=True, exist_ok=True)

    # 1-2. corpus and tokenizer
    root, train_rel, held_rel = corpus_files()
    tok_dir = args.work / "tokenizer"
    data_path = args.work / "data.pt"
    if not data_path.exists():
        t0 = time.time()
        tok = train_tokenizer(root, train_rel, c["vocab_size"], tok_dir)
        data = {"train": tokenize_files(tok, root, train_rel), "heldout": tokenize_files(tok, root, held_rel),
                "train_files": train_rel, "heldout_files": held_rel, "stdlib": str(root),
                "python": sys.version.split()[0]}
        torch.save(data, data_path)
        print(f"tokenizer + data in {time.time() - t0:.0f}s")
    data = torch.load(data_path)
    tr, ho = data["train"], data["heldout"]
    tr_bytes = sum((root / r).stat().st_size for r in train_rel)
    ho_bytes = sum((root / r).stat().st_size for r in held_rel)
    print(f"corpus {root} (Python {data['python']}): train {len(train_rel)} files {tr_bytes / 1e6:.2f} MB "
          f"{tr.numel()} tokens; held-out {len(held_rel)} files {ho_bytes / 1e6:.2f} MB {ho.numel()} tokens")

    model = TinyDeepseekV3(c)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = args.work / "ckpt.pt"
    step, log, resumes = 0, [], []
    if (args.resume or args.export_only) and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, log = st["step"], st["log"]
        resumes = st.get("resumes", [])
        if args.resume and step < args.steps:
            resumes.append({"at_step": step, "steps": args.steps})
        print(f"resumed at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params {n_params / 1e6:.2f}M (incl. MTP layer)")
    B, T = args.batch_size, args.seq_len
    logf = open(args.work / "train_log.jsonl", "a")
    t_start, tokens_seen = time.time(), step * B * T
    while step < args.steps and not args.export_only:
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = batch(tr, B, T, gen)
        t0 = time.time()
        m, t, loss = losses(model, ids, args.mtp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        # auxiliary-loss-free balancing (DeepSeek-V3): no gradient, a sign step toward the mean load
        maxmean = []
        with torch.no_grad():
            for moe in model.moe_layers():
                load = moe.last_load.float()
                moe.e_score_correction_bias += args.bias_gamma * torch.sign(load.mean() - load)
                maxmean.append(round((load.max() / load.mean()).item(), 2))
        step += 1
        tokens_seen += B * T
        dt = time.time() - t0
        rec = {"step": step, "loss": round(loss.item(), 4), "main": round(m.item(), 4), "mtp": round(t.item(), 4),
               "lr": lr, "gnorm": round(gnorm, 3), "load_max_mean": maxmean, "tok_s": round(B * T / dt),
               "tokens": tokens_seen, "elapsed": round(time.time() - t_start)}
        if step % args.eval_every == 0 or step == args.steps:
            rec["heldout_main"], rec["heldout_mtp"] = [round(v, 4) for v in evaluate(model, ho, T, 32)]
        log.append(rec)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        if step % 10 == 0 or step <= 3 or "heldout_main" in rec:
            print(json.dumps(rec), flush=True)
        if args.bench and step >= args.steps:
            print(f"bench: {B * T * step / (time.time() - t_start):.0f} tok/s overall")
            return
        if step % args.ckpt_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "log": log, "resumes": resumes, "args": vars(args) | {"out": str(args.out), "work": str(args.work)}},
                       str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
    if args.bench:
        return

    # 4. export + checks
    tr_main, tr_mtp = evaluate(model, tr, T, 64)
    ho_main, ho_mtp = evaluate(model, ho, T, 10**9)
    info = {
        "seed": args.seed, "steps": step, "batch_size": B, "seq_len": T, "tokens_seen": step * B * T,
        "peak_lr": args.lr, "warmup": args.warmup, "schedule": f"warmup {args.warmup} steps, constant, linear decay to 2% over the last {args.decay_frac:.0%} of steps",
        "optimizer": "AdamW(0.9, 0.95), wd 0.1 on matrices, grad clip 1.0", "mtp_loss_weight": args.mtp_weight,
        "bias_update_gamma": args.bias_gamma, "precision": "fp32 master weights, bf16 autocast matmuls",
        "threads": args.threads, "python": data["python"], "stdlib": data["stdlib"],
        "corpus_rule": f"*.py under stdlib, skipping dirs {sorted(EXCLUDED_DIRS)}; held-out iff crc32(relpath) % {HELDOUT_MOD} == 0",
        "train_files": len(train_rel), "heldout_files": len(held_rel), "train_bytes": tr_bytes, "heldout_bytes": ho_bytes,
        "train_tokens": tr.numel(), "heldout_tokens": ho.numel(),
        "final_train_loss_sampled_64x512": round(tr_main, 4), "final_heldout_loss": round(ho_main, 4),
        "final_heldout_ppl": round(math.exp(ho_main), 3), "final_heldout_mtp_loss": round(ho_mtp, 4),
        "train_loss_last_50_steps": round(sum(r["main"] for r in log[-50:]) / max(1, len(log[-50:])), 4),
        "train_step_seconds": round(sum(B * T / r["tok_s"] for r in log)),
        "resumed": resumes,
        "heldout_files_list": held_rel,
    }
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_files_list"}, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f).write_bytes((tok_dir / f).read_bytes())
    export(model, args.out, info)
    check_hf_parity(model, args.out, ho[: 4 * 129].long().view(4, 129))


if __name__ == "__main__":
    main()
