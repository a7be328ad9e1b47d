#!/usr/bin/env python3
"""The PyTorch side of the GPU speed benchmark (gpu_speed.py): the work memtrain's run does, step for step.

  torch_speed.py --model gpt --device cuda --n_layer 12 --n_head 12 --n_embd 768 --block_size 1024 --vocab 50304 \
                 --micro_batch 16 --accum_steps 4 --steps 12 --log_every 4 [--compile]
  torch_speed.py --model llama --n_layer 16 --n_head 32 --n_kv_head 8 --n_embd 2048 --ffn 8192 --vocab 128256 ...

Like memtrain's synthetic run: each micro-batch's tokens are drawn on the host and copied to the device, the loss is
the fp32 cross-entropy of the logits scaled by 1 / accum_steps, bf16 autocast over fp32 parameters, gradients clipped
to norm 1 (foreach), torch.optim.AdamW(fused=True) with memtrain's groups. The timed span is memtrain's: the wall time
between log points (every log_every steps, where the host waits for the device and reads the loss), per step; the
steps before the first log point after the warm-up are not timed. GPT is scripts/reference/gpt_ref.py (memtrain's GPT
op for op); Llama is written here as transformers' LlamaForCausalLM computes it (pre-RMSNorm in fp32, rotary
embeddings by halves, grouped-query SDPA, SwiGLU), its head tied where --tie. Prints one JSON line.
"""
import argparse, json, math, os, statistics, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from gpt_ref import GPT  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h, self.kv, self.d = a.n_head, a.n_kv_head, a.n_embd // a.n_head
        C = a.n_embd
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(C, 1e-5), RMSNorm(C, 1e-5)
        self.q_proj = nn.Linear(C, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(C, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(C, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, C, bias=False)
        self.gate_proj = nn.Linear(C, a.ffn, bias=False)
        self.up_proj = nn.Linear(C, a.ffn, bias=False)
        self.down_proj = nn.Linear(a.ffn, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k_proj(y).view(B, T, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(y).view(B, T, self.kv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, T, C))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(a) for _ in range(a.n_layer)])
        self.norm = RMSNorm(a.n_embd, 1e-5)
        self.lm_head = None if a.tie else nn.Linear(a.n_embd, a.vocab, bias=False)
        d = a.n_embd // a.n_head
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        ang = torch.outer(torch.arange(a.block_size, dtype=torch.float), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.norm(x), w)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(a):
    """The benchmark's model on the CPU, with memtrain's initial values: N(0, 0.02) matrices, zero biases, unit norms."""
    torch.manual_seed(0)
    if a.model == "gpt":
        model = GPT(dict(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd))
    else:
        model = Llama(a)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if p.dim() >= 2 else (p.zero_() if name.endswith("bias") else p.fill_(1.0))
    return model


def flops_per_token(a, n_all):
    """memtrain's count, 6 N + 12 L C T (GPT: N without the position table; Llama, PaLM's: the lookup table is no
    matmul unless it is the tied head), and for GPT llm.c's, 6 N + 6 L C T over every parameter (else None)."""
    C, L, T = a.n_embd, a.n_layer, a.block_size
    if a.model == "gpt":
        return 6 * (n_all - T * C) + 12 * L * C * T, 6 * n_all + 6 * L * C * T
    return 6 * (n_all - (0 if a.tie else a.vocab * C)) + 12 * L * C * T, None


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=12, n_head=12, n_kv_head=0, n_embd=768, ffn=0, block_size=1024, vocab=50304, micro_batch=16,
                     accum_steps=4, steps=12, log_every=4, warmup=4, threads=0).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--tie", action="store_true", help="llama: the head is the token embedding")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile(model)")
    a = ap.parse_args()
    a.n_kv_head = a.n_kv_head or a.n_head
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    model = build_model(a).to(dev)
    params = list(model.parameters())
    n_all = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=dev.type == "cuda")
    run = torch.compile(model) if a.compile else model
    cuda = dev.type == "cuda"
    sdp = None
    if cuda:
        h = a.n_head
        qkv = torch.randn(a.micro_batch, a.block_size, 3 * a.n_embd, device=dev, dtype=torch.bfloat16)
        q, k, v = (t.view(a.micro_batch, a.block_size, h, a.n_embd // h).transpose(1, 2) for t in qkv.split(a.n_embd, 2))
        sdp = int(torch._fused_sdp_choice(q, k, v, is_causal=True))  # 0 math, 1 flash, 2 efficient, 3 cudnn
        del qkv, q, k, v
        torch.cuda.reset_peak_memory_stats()  # the peak of the training steps alone
    g = torch.Generator().manual_seed(1)
    marks, losses = [], []
    compile_s = None
    t_start = time.perf_counter()
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for _ in range(a.accum_steps):
            x = torch.randint(0, a.vocab, (a.micro_batch, a.block_size + 1), generator=g)
            inp, tgt = x[:, :-1].to(dev, non_blocking=True), x[:, 1:].to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
                _, loss = run(inp, tgt)
            (loss / a.accum_steps).backward()
            total += loss.detach() / a.accum_steps
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=cuda or None)
        opt.step()
        if step == 1 and a.compile:
            if cuda:
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t_start
        if step % a.log_every == 0 or step == a.steps:
            losses.append(total.item())  # waits for the device, as memtrain's log point does
            marks.append((step, time.perf_counter()))
    timed = [(s1 - s0, t1 - t0) for (s0, t0), (s1, t1) in zip(marks, marks[1:]) if s0 >= a.warmup]
    ms = statistics.median(1000 * dt / ds for ds, dt in timed)
    tokens = a.micro_batch * a.accum_steps * a.block_size
    flops, flops_llmc = flops_per_token(a, n_all)
    out = {"ms_per_step": ms, "tokens_per_s": tokens / ms * 1000, "flops_per_token": flops, "flops_per_token_llmc": flops_llmc,
           "parameters": n_all, "final_loss": losses[-1], "sdp_choice": sdp, "compile_s": compile_s,
           "loss_finite": all(math.isfinite(v) for v in losses)}
    if cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
