"""PyTorch FSDP2 peer of gtp_jax's transformer preset, for side-by-side benchmarks.

Launched by ``python -m gtp_jax.bench overlap --torch`` as
``torchrun --nproc_per_node=N benchmarks/torch_fsdp2.py``; env: PRESET, SEQ, MB (sequences
per GPU), STEPS, LAYERS (0: the preset's), COMPILE (1, the default: each block
``torch.compile``d, then ``fully_shard``, torchtitan's recipe; 0: eager), PROFILE (a path:
write a chrome trace of 3 steps there, for ``python -m gtp_jax.bench.kernels``), REPLICATE
(R > 1: HSDP, R replicas of world / R shards), FLOAT8 (1: torchao float8 training,
tensorwise scaling, with the weights all-gathered in float8 and their scales precomputed
after each optimizer step, torchao's FSDP2 recipe; the head stays bf16; needs torchao on
PYTHONPATH), AC (activation checkpointing per block as torchtitan applies it, before
compiling and sharding: "none", the default; "full": each block recomputed in the backward;
"op": selective, the outputs of matmuls and attention saved, the rest recomputed), REDUCE
("float32", the default, torchtitan's; "bfloat16": gradients reduce-scattered in bf16), MODEL
("preset", the default; "user": the blocks of ``gtp_jax.bench.user_model.UserDecoder``, a GELU
MLP instead of SwiGLU, sized by USER_D, USER_BLOCKS, USER_HEADS, USER_FF, USER_VOCAB, as
``bench overlap``'s ``--user-*`` options). Same architecture (RMSNorm, SwiGLU, untied head;
rotary-free attention has the same cost), bf16 compute with fp32 master weights, fused AdamW,
``fully_shard`` per block. Prints ``RESULT {json}`` on rank 0.
"""

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SIZES = {  # vocab, d_model, heads, layers, d_ff[, kv heads, head dim]
    "tiny": (256, 128, 4, 4, 352),
    "small": (32000, 512, 8, 6, 1408),
    "100m": (32000, 768, 12, 12, 2048),
    "1b": (32000, 2048, 16, 16, 5632),
    "llama3-8b": (128256, 4096, 32, 32, 14336, 8, 128),  # grouped-query, as gtp_jax's preset
    "llama3-70b": (128256, 8192, 64, 80, 28672, 8, 128),
}


class Block(nn.Module):
    def __init__(self, d, heads, ff, kv=None, hd=None, gelu=False):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv or heads, hd or d // heads
        self.gelu = gelu
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, (heads + 2 * self.kv) * self.hd, bias=False)
        self.out = nn.Linear(heads * self.hd, d, bias=False)
        self.gate_up = nn.Linear(d, (1 if gelu else 2) * ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, -1, self.hd).split(
            [self.heads, self.kv, self.kv], dim=2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.heads)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, self.heads * self.hd))
        if self.gelu:  # the user decoder's MLP (jax.nn.gelu: the tanh approximation)
            return x + self.down(F.gelu(self.gate_up(self.mlp_norm(x)), approximate="tanh"))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff, kv=None, hd=None, gelu=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff, kv, hd, gelu) for _ in range(layers))
        self.final_norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def main():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    user = os.environ.get("MODEL", "preset") == "user"
    if user:  # defaults: gtp_jax.bench.user_model.UserDecoderConfig's
        vocab, d, heads, layers, ff = (int(os.environ.get(f"USER_{k}", v)) for k, v in (
            ("VOCAB", 32000), ("D", 2048), ("HEADS", 16), ("BLOCKS", 16), ("FF", 8192)))
        gqa = []
    else:
        vocab, d, heads, layers, ff, *gqa = SIZES[os.environ.get("PRESET", "1b")]
    layers = int(os.environ.get("LAYERS", "0")) or layers
    seq, mb = int(os.environ.get("SEQ", "2048")), int(os.environ.get("MB", "4"))
    steps = int(os.environ.get("STEPS", "20"))
    torch.manual_seed(0)
    model = Decoder(vocab, d, heads, layers, ff, *(gqa or (None, None)), gelu=user).cuda()
    float8 = os.environ.get("FLOAT8", "0") == "1"
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda module, name: name != "head")
    compiled = os.environ.get("COMPILE", "1") != "0"
    replicate = int(os.environ.get("REPLICATE", "1"))
    mesh = None
    if replicate > 1:  # HSDP: shard within groups of world / replicate, replicate across them
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (replicate, world // replicate),
                                mesh_dim_names=("replicate", "shard"))
    ac = os.environ.get("AC", "none")
    if ac != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        kwargs = {}
        if ac == "op":
            from torch.utils.checkpoint import (
                CheckpointPolicy,
                create_selective_checkpoint_contexts,
            )

            saved = {torch.ops.aten.mm.default,
                     torch.ops.aten._scaled_dot_product_efficient_attention.default,
                     torch.ops.aten._scaled_dot_product_flash_attention.default,
                     torch.ops.aten._scaled_dot_product_cudnn_attention.default}

            def sac_policy(ctx, op, *args, **kw):
                return (CheckpointPolicy.MUST_SAVE if op in saved
                        else CheckpointPolicy.PREFER_RECOMPUTE)

            kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(sac_policy)
        model.blocks = nn.ModuleList(checkpoint_wrapper(b, preserve_rng_state=False, **kwargs)
                                     for b in model.blocks)
    reduce = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        os.environ.get("REDUCE", "float32")]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for block in model.blocks:
        if compiled:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    gen = torch.Generator(device="cuda")
    gen.manual_seed(rank)

    def step():
        tokens = torch.randint(0, vocab, (mb, seq + 1), device="cuda", generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if float8:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    for _ in range(4 if compiled else 2):  # compiling takes the first steps
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    med = statistics.median(times)

    def local_bytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    param_bytes = sum(local_bytes(p) for p in model.parameters())
    opt_bytes = sum(local_bytes(v) for st in opt.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
    grad_bytes = param_bytes  # reduced gradients are cast to the (float32) parameters
    if os.environ.get("PROFILE"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            prof.export_chrome_trace(os.environ["PROFILE"])
    kv, hd = gqa or (heads, d // heads)  # the formula of TransformerConfig.train_flops_per_token
    attn = 2 * d * hd * (heads + kv)
    mlp = (2 if user else 3) * d * ff
    flops_per_token = (6.0 * (layers * (attn + mlp) + vocab * d)
                       + 6.0 * layers * heads * hd * seq)
    flops = flops_per_token * mb * seq
    if rank == 0:
        print("RESULT " + json.dumps({
            "variant": ("user_" if user else "")
                       + ("torch_hsdp" if replicate > 1 else "torch_fsdp2")
                       + ("_compiled" if compiled else "_eager") + ("_float8" if float8 else ""),
            "devices": world,
            "device_kind": torch.cuda.get_device_name(), "preset": os.environ.get("PRESET", "1b"),
            "layers": layers, "seq": seq, "per_device_batch": mb, "step_ms": med * 1e3,
            "step_ms_min": min(times) * 1e3, "loss": float(loss),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "state_gib": (param_bytes + grad_bytes + opt_bytes) / 2**30,
            "recipe": f"fully_shard per block, {'compiled' if compiled else 'eager'}, AC "
                      f"{ac}, reduce {os.environ.get('REDUCE', 'float32')}"
                      + (", torchao float8" if float8 else ""),
            "first_step_s": first_step_s,
            "tflops_per_device": flops / med / 1e12, "mfu": flops / med / 989e12,
            "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
