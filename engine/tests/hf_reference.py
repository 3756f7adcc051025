#!/usr/bin/env python3
"""Cross-checks starling-engine's Qwen3 forward against Hugging Face transformers.

Not part of CI (it needs torch and transformers). Run:

    python3 -m venv /var/tmp/hf && /var/tmp/hf/bin/pip install torch transformers safetensors
    cargo build --release -p starling-engine --bin engine-logits
    /var/tmp/hf/bin/python engine/tests/hf_reference.py <path to engine-logits>

Builds a random tiny Qwen3 (hidden 64, 2 layers, vocab 512, 4 heads over 2 KV heads,
head_dim 16) with `Qwen3Config`, rounds its weights to BF16, saves them as safetensors plus
config.json, runs the BF16 weights in float32 in transformers (eager attention) and in the
engine, and prints the largest absolute difference of the logits over every position.
"""

import json
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM


def main() -> int:
    engine = sys.argv[1] if len(sys.argv) > 1 else "target/release/engine-logits"
    torch.manual_seed(0)
    worst = 0.0
    for tie in (False, True):
        cfg = Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            max_position_embeddings=2048,
            tie_word_embeddings=tie,
            attention_bias=False,
            bos_token_id=1,
            eos_token_id=2,
            torch_dtype="bfloat16",
        )
        cfg._attn_implementation = "eager"
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * (torch.rand_like(p) - 0.5))  # norms near 1
                else:
                    p.normal_(0.0, 0.2)
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        model = model.float().eval()
        tokens = torch.randint(0, 512, (1, 24))
        with torch.no_grad():
            want = model(tokens).logits[0].double()
        with tempfile.TemporaryDirectory() as d:
            state = {
                k: v.to(torch.bfloat16).contiguous()
                for k, v in model.state_dict().items()
                if not (tie and k == "lm_head.weight")
            }
            save_file(state, f"{d}/model.safetensors")
            c = cfg.to_dict()
            c["architectures"] = ["Qwen3ForCausalLM"]
            c["torch_dtype"] = "bfloat16"
            with open(f"{d}/config.json", "w") as f:
                json.dump(c, f)
            run = subprocess.run(
                [engine, d, *map(str, tokens[0].tolist())],
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                print(run.stderr, file=sys.stderr)
                return 1
            out = run.stdout
        got = torch.tensor(json.loads(out)["logits"], dtype=torch.float64)
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        print(f"tie_word_embeddings={tie}: max |engine - transformers| = {diff:.3e} "
              f"(max |logit| {scale:.2f}, relative {diff / scale:.2e}), "
              f"argmax agree {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.3f}")
        worst = max(worst, diff / scale)
    ok = worst < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
