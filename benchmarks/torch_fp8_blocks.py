"""The FP8 peer: torchao float8 training (torch.compile) on the blocks of
``python -m gtp_jax.bench fp8``.

Llama-3-8B-shaped blocks (d 4096, ff 14336, 32 heads, 8 kv heads), one sequence of 8192
tokens on one GPU, bf16 weights; step = forward + backward + fused AdamW. Recipes: bf16,
and torchao's float8 "tensorwise" / "rowwise". Env: LAYERS (4), RECIPES
(bf16,tensorwise,rowwise). Prints one line per recipe: median step ms, TFLOP/s, peak GiB.
"""

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, FF, H, KV, S, B = 4096, 14336, 32, 8, 8192, 1
L = int(os.environ.get("LAYERS", 4))
HD = D // H


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.q = nn.Linear(D, D, bias=False)
        self.kv = nn.Linear(D, 2 * KV * HD, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.g = nn.Linear(D, FF, bias=False)
        self.u = nn.Linear(D, FF, bias=False)
        self.d = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, KV, HD).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, D))
        h = self.n2(x)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


def run(recipe: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(L)]).cuda().to(torch.bfloat16)
    if recipe != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    ms = sorted(times)[len(times) // 2] * 1e3
    # 6 * tokens * params of the projections, plus causal attention
    flops = 6 * B * S * L * (D * D * 2 + D * 2 * KV * HD + 3 * D * FF) + 6 * B * L * H * S * S * HD
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"torch {recipe:9s} {L} blocks (8b shape), seq {S}: step {ms:.1f} ms  "
          f"{flops / ms / 1e9:.0f} TFLOP/s  peak {peak:.1f} GiB", flush=True)


for name in os.environ.get("RECIPES", "bf16,tensorwise,rowwise").split(","):
    try:
        run(name)
    except Exception as err:  # one recipe failing must not hide the others
        print(f"torch {name} failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
    torch.cuda.empty_cache()  # the recipe's model and optimizer are gone with run()
    torch.cuda.reset_peak_memory_stats()
